"""The session's whole collection, kept by conftest before a shard (MOE_KERNELS_TEST_SHARD,
python_tests/run_shards.py) keeps its part: for the tests that look at what was collected."""

import pytest

# config.stash[COLLECTED]: every test item collected in this session, in collection order.
COLLECTED = pytest.StashKey[list]()
