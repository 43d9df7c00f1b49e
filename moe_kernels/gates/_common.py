"""Argument checks shared by the gates of this package."""

import torch


def check_sizes(d_model, num_experts, k):
    for name, value in (("d_model", d_model), ("num_experts", num_experts), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if d_model < 1 or num_experts < 1:
        raise ValueError(f"d_model and num_experts must be >= 1, got {d_model}, {num_experts}")
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must be in [1, num_experts = {num_experts}], got {k}")


def check_input(x, d_model, mask):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != d_model:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [T, d_model] with d_model = {d_model}, got {shape}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != (x.shape[0],)):
        raise ValueError(f"mask must be [T] = [{x.shape[0]}]")
