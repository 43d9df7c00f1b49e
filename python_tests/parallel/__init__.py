"""moe_kernels.parallel in real process groups (gloo, spawned ranks; what each rank runs is
support/_expert_parallel_ranks.py)."""
