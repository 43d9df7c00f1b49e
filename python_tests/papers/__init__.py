"""Smoke tests of the paper reproductions in examples/, one per script (test_<script>.py for
examples/<script>.py): tiny runs that check the pipeline end to end, not the papers' numbers (the
full runs are documented commands in docs/)."""
