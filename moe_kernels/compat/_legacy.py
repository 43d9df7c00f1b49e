"""The first, simplified adapters: DeepSpeed's and Megatron-LM's routing conventions, computed with our ops.

Simplified readings (capacity by `capacity_for`, in double precision, which differs by one from
DeepSpeed's float32 and Megatron's arithmetic on a few shapes); the drop-ins with the libraries'
own signatures and arithmetic are compat.deepspeed, compat.megatron and compat.torchtitan.

Readings implemented (the deterministic variants; see docs/dispatch.md):
- DeepSpeed `top1gating` / `top2gating` (deepspeed/moe/sharded_moe.py) with drop_tokens=True,
  use_rts=False, noisy_gate_policy=None and no second-expert sampling; ties between tokens competing
  for a slot go to the lower token index (DeepSpeed's torch.topk leaves them unspecified).
- Megatron-core `topk_softmax_with_capacity` (moe/moe_utils.py), drop policies "probs" and
  "position", without padding to capacity; ties again to the lower token index.
"""

import torch

from moe_kernels.ops import capacity_for, capacity_positions, topk_softmax

__all__ = ["deepspeed_gating", "megatron_routing"]


def _dense(T, E, C, experts, positions, values):
    """[T, E, C] with values[t, s] at (t, experts[t, s], positions[t, s]) for kept choices."""
    kept = positions >= 0
    token = torch.arange(T, device=experts.device).unsqueeze(1).expand_as(experts)
    out = values.new_zeros(T, E, C)
    return out.index_put((token[kept], experts[kept], positions[kept]), values[kept])


def deepspeed_gating(logits: torch.Tensor, k: int, capacity_factor: float = 1.0, min_capacity: int = 4):
    """DeepSpeed's gate outputs (top1gating for k = 1, top2gating for k = 2).

    Args:
      logits: [S, E] float32 / float16 / bfloat16 router logits.
      k: 1 or 2. capacity_factor, min_capacity: C = max(min_capacity, ceil(capacity_factor * S * k / E)).
    Returns:
      l_aux: scalar, E * sum_e mean_s(softmax)[e] * fraction of first choices to e (GShard's loss).
      combine_weights: [S, E, C] in the logits' dtype; top-1: the softmax probability of the kept
        choice; top-2: the two softmax probabilities renormalised over the kept choices.
      dispatch_mask: [S, E, C] bool, combine_weights != 0 (as DeepSpeed computes it).
      exp_counts: [E] int64, choices per expert before dropping (on the logits' device; DeepSpeed
        copies it to the host).
    Slots are filled first choices before second choices, by token index: capacity_positions'
    default order, which is DeepSpeed's cumsum of mask1, then of mask2 offset by mask1's totals.
    """
    if k not in (1, 2):
        raise ValueError(f"k must be 1 (top1gating) or 2 (top2gating), got {k}")
    S, E = logits.shape
    C = capacity_for(S, E, k, capacity_factor, min_capacity)
    weights, experts = topk_softmax(logits, k, renormalize=False)  # full-softmax probabilities
    positions, exp_counts = capacity_positions(experts, E, C)
    kept = positions >= 0
    weights = torch.where(kept, weights, 0.0)
    if k == 2:
        denom = weights.sum(1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
        weights = weights / denom
    combine_weights = _dense(S, E, C, experts, positions, weights)
    gates = torch.softmax(logits, dim=1)
    me = gates.mean(0)
    ce = torch.nn.functional.one_hot(experts[:, 0], E).to(gates.dtype).mean(0)
    l_aux = (me * ce).sum() * E
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def megatron_routing(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float | None = None,
    drop_policy: str = "probs",
    use_pre_softmax: bool = False,
):
    """Megatron-core's router output `(probs [T, E], routing_map bool [T, E])`.

    Args:
      logits: [T, E] router logits. k: experts per token.
      capacity_factor: None = dropless; else each expert keeps C = ceil(capacity_factor * T * k / E)
        choices, chosen by drop_policy: "probs" (the highest routing probabilities; our
        capacity_positions with priority = the weights) or "position" (the lowest token indices,
        all of a token's choices at once; priority = -token index).
      use_pre_softmax: False = softmax over the top-k logits (our renormalize=True); True = the
        full-softmax probabilities of the top k.
    Returns:
      probs: [T, E] in the logits' dtype, the weight of every kept choice, 0 elsewhere.
      routing_map: [T, E] bool, the kept choices.
    """
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    T, E = logits.shape
    weights, experts = topk_softmax(logits, k, renormalize=not use_pre_softmax)
    if capacity_factor is None:
        kept = torch.ones_like(experts, dtype=torch.bool)
    else:
        C = capacity_for(T, E, k, capacity_factor)
        if drop_policy == "probs":
            priority = weights
        else:  # by token index: exact in float32 up to 2^24 tokens
            priority = -torch.arange(T, device=logits.device, dtype=torch.float32).unsqueeze(1).expand(T, k)
        positions, _ = capacity_positions(experts, E, C, priority=priority)
        kept = positions >= 0
    probs = logits.new_zeros(T, E).scatter(1, experts, torch.where(kept, weights, 0.0))
    routing_map = torch.zeros(T, E, dtype=torch.bool, device=logits.device).scatter(1, experts, kept)
    return probs, routing_map
