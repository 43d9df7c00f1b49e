"""The sparse gate of eq 16 (Shazeer et al. 2017, Appendix F, 000_9a6c7e46ac45e7a4.txt):
G(x)_i = G_sigma(x)_i M_i / sum_j G_sigma(x)_j M_j, for any mask M (top-k eq 17, batchwise eq 18,
threshold eq 19)."""

import torch

from moe_kernels.ops import _validate


def sparse_gates(gate_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """eq 16: the gate probabilities kept by `mask`, renormalised to sum to 1 per token.

    Args:
      gate_probs: [T, E] float, G_sigma(x) = Softmax(x W_g) (eq 15), non-negative.
      mask: [T, E] bool, M(G_sigma(x)).

    Returns:
      [T, E] in gate_probs' dtype (computed in float32, float64 for float64). A row whose mask is
      empty (possible with the batchwise and threshold masks), or whose kept probabilities sum to
      0, gives all-zero gates and zero gradients, never NaN: that token is routed nowhere.
    """
    _validate.tensor("gate_probs", gate_probs, dim=2, shape="[T, E]", dtypes=(*_validate.ROUTING_DTYPES, torch.float64))
    _validate.tensor("mask", mask, dtypes=(torch.bool,))
    if mask.shape != gate_probs.shape:
        raise ValueError(f"mask must be [T, E] = {list(gate_probs.shape)}, got shape {tuple(mask.shape)}")
    compute = torch.float64 if gate_probs.dtype == torch.float64 else torch.float32
    kept = torch.where(mask, gate_probs.to(compute), 0.0)
    denom = kept.sum(dim=-1, keepdim=True)
    empty = denom == 0
    # Divide by 1 where the row is empty: its numerators are 0, and so are the gradients.
    gates = kept / torch.where(empty, 1.0, denom)
    return gates.to(gate_probs.dtype)
