"""DeepSpeed's gating functions as drop-ins: `top1gating`, `top2gating`, `topkgating`.

Signatures, argument order, defaults and return values are those of deepspeed/moe/sharded_moe.py
at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641 (DEEPSPEED_COMMIT), so DeepSpeed's own calls
(TopKGate.forward's positional calls included) work unchanged. The routing is computed with our
ops: `topk_router` selects the experts, `capacity_positions` assigns the slots and drops the
overflow; the dense [S, E, C] tensors are built only because DeepSpeed's callers consume them.

Terms: S tokens, E experts, k choices per token, C capacity (slots per expert).

Exact where DeepSpeed is deterministic: selection (torch.argmax takes the first maximum, so does
topk_router), capacity (DeepSpeed's float32 arithmetic, `_capacity`), kept choices, slots,
exp_counts; with `generator=None` the random draws (RSample, random token selection, top-2
sampling) come from the global RNG in DeepSpeed's order and shapes, so one seed gives DeepSpeed's
routing. Where DeepSpeed's result rests on torch.topk's unspecified order among equal values, ours
is pinned: equal values go to the lower index (lower expert within a token, lower token within
an expert). That covers: top-1 drops without random token selection (DeepSpeed's topk over a 0/1
column: every routed token ties), equal uniforms under use_rts, equal probabilities at the k-th
place of topkgating and at the capacity boundary of drop_policy="probs".

Differences on purpose: the caller's logits are never modified (DeepSpeed's top2gating adds its
Gumbel noise to them in place); a floating `used_token` works in the dense path too (DeepSpeed's
fails in one_hot). Distributed arguments: see `_no_drop_capacity`.
"""

import math
import struct

import torch
import torch.distributed as dist

from moe_kernels.ops import _validate, capacity_positions, topk_router

__all__ = ["top1gating", "top2gating", "topkgating"]

DEEPSPEED_COMMIT = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"
NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")


# ---------------------------------------------------------------- capacity
def _float32(x: float, name: str) -> float:
    """x rounded to the nearest float32 (struct packs with the C cast: round to nearest even)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        raise ValueError(f"{name} = {x} is beyond the float32 range DeepSpeed computes capacity in") from None


def _capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed's capacity: max(min_capacity, ceil((S / E) * (capacity_factor * k))) in float32.

    DeepSpeed multiplies the Python float S / E by the float32 tensor torch.tensor(capacity_factor
    * k): both operands are rounded to float32 and the product is a float32 product, not
    capacity_for's double-precision ceil(cf * S * k / E): the two differ by one where a rounding
    crosses an integer (S = 35, E = 3, k = 1, cf = 1.2: DeepSpeed 15, capacity_for 14; S = 50,
    E = 5, k = 1, cf = 1.1: DeepSpeed 11, capacity_for 12). Pure Python, no tensor: the double
    product of two float32 values is exact, so rounding it once is the float32 multiply.
    """
    ratio = _float32(num_tokens / num_experts, "num_tokens / num_experts")
    factor = _float32(capacity_factor * k, "capacity_factor * k")
    return max(min_capacity, math.ceil(_float32(ratio * factor, "the capacity")))


def _no_drop_capacity(counts: torch.Tensor, ep_group) -> int:
    """drop_tokens=False: C = the largest expert count, the MAX over `ep_group` when it has more
    than one rank (DeepSpeed's all_reduce, here torch.distributed's: deepspeed.comm wraps it).

    DeepSpeed then rounds C up to a multiple of its tensor-parallel world size when its global
    `groups.mpu` is set and the expert-model-parallel world size is 1; that is DeepSpeed's global
    state, which this package cannot see: here the tensor-parallel size is 1 (no rounding).
    """
    capacity = counts.max() if counts.numel() else counts.new_zeros(())
    if ep_group is not None and dist.get_world_size(group=ep_group) > 1:
        capacity = capacity.clone()
        dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=ep_group)
    return int(capacity)


# ---------------------------------------------------------------- shared pieces
def _check_common(logits, capacity_factor, min_capacity, drop_tokens, sparse_routes) -> tuple[int, int]:
    _validate.tensor("logits", logits, dim=2, shape="[S, E]", dtypes=_validate.FLOAT_DTYPES)
    S, E = logits.shape
    if S < 1 or E < 1:
        raise ValueError(f"logits must be [S, E] with S >= 1 tokens and E >= 1 experts, got {tuple(logits.shape)}")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, int | float):
        raise TypeError(f"capacity_factor must be a float, got {type(capacity_factor).__name__}")
    if not (math.isfinite(capacity_factor) and capacity_factor >= 0):
        raise ValueError(f"capacity_factor must be a finite number >= 0, got {capacity_factor}")
    _validate.integer("min_capacity", min_capacity, low=0)
    for name, value in (("drop_tokens", drop_tokens), ("sparse_routes", sparse_routes)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return S, E


def _top_experts(values: torch.Tensor, k: int) -> torch.Tensor:
    """[S, k] int64: the k largest entries of each row of `values` by descending value, equal
    values to the lower expert index (torch.argmax's first maximum for k = 1). topk_router with
    no bias and one group ranks its input itself, so `values` may be probabilities."""
    return topk_router(values.detach(), k)[1]


def _uniform(logits: torch.Tensor, generator) -> torch.Tensor:
    """[S, E] float32 U(0, 1): DeepSpeed's Uniform(0, 1).rsample, i.e. 0 + rand * 1 = rand."""
    return torch.rand(logits.shape, generator=generator, device=logits.device)


def _gumbel(logits: torch.Tensor, generator) -> torch.Tensor:
    """[S, E] float32 standard Gumbel draws as DeepSpeed's gumbel_rsample makes them (torch's
    Gumbel(0, 1).rsample): u = tiny + rand * ((1 - eps) - tiny), then -log(-log(u))."""
    finfo = torch.finfo(torch.float32)
    low = torch.tensor(finfo.tiny, device=logits.device)
    high = torch.tensor(1 - finfo.eps, device=logits.device)
    u = low + torch.rand(logits.shape, generator=generator, device=logits.device) * (high - low)
    return -torch.log(-torch.log(u))


def _tokens_in_order(experts: torch.Tensor, kept: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[S, 1] slots of the kept choices numbered by token index within each expert (DeepSpeed's
    cumsum over tokens of the kept mask), -1 elsewhere. Used after a priority pass, whose slots
    follow the priority instead."""
    return capacity_positions(torch.where(kept, experts, -1), num_experts, capacity)[0]


def _dense(experts, positions, values, num_experts: int, capacity: int, dtype) -> torch.Tensor:
    """[S, E, C] with values[t, s] at (t, experts[t, s], positions[t, s]) for every kept choice."""
    S = experts.shape[0]
    kept = positions >= 0
    token = torch.arange(S, device=experts.device).unsqueeze(1).expand_as(experts)
    out = torch.zeros(S, num_experts, capacity, dtype=dtype, device=experts.device)
    return out.index_put((token[kept], experts[kept], positions[kept]), values[kept].to(dtype))


def _capacity_tensor(capacity: int, device) -> torch.Tensor:
    """DeepSpeed's sparse_routes capacity: a 0-dim int64 tensor."""
    return torch.tensor(capacity, dtype=torch.int64, device=device)


def _outputs(l_aux, experts, positions, weights, exp_counts, capacity, capacity_device, sparse_routes, combine_dtype):
    """DeepSpeed's return values from [S, k] experts / positions (-1 = dropped) / weights (0 where
    dropped). Dense: (l_aux, combine_weights [S, E, C], dispatch_mask [S, E, C] bool, exp_counts).
    sparse_routes: (l_aux, capacity 0-dim int64, E, indices [k, S] int32 (-1 = dropped),
    locations [k, S] int32 (0 where dropped), gates [k, S], exp_counts)."""
    E = exp_counts.shape[0]
    if sparse_routes:
        kept = positions >= 0
        indices = torch.where(kept, experts, -1).t().to(torch.int32).contiguous()
        locations = torch.where(kept, positions, 0).t().to(torch.int32).contiguous()
        gates = weights.t().contiguous()
        return l_aux, _capacity_tensor(capacity, capacity_device), E, indices, locations, gates, exp_counts
    combine_weights = _dense(experts, positions, weights, E, capacity, combine_dtype)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


# ---------------------------------------------------------------- the gates
def top1gating(
    logits,
    capacity_factor,
    min_capacity,
    used_token=None,
    noisy_gate_policy=None,
    drop_tokens=True,
    use_rts=True,
    ep_group=None,
    sparse_routes=False,
    use_tutel=False,
    *,
    generator=None,
):
    """DeepSpeed's top1gating (Switch routing with random token selection).

    Args:
      logits: [S, E] floating router logits (DeepSpeed's TopKGate passes float32).
      capacity_factor: float >= 0; min_capacity: int >= 0, at most S (DeepSpeed asserts it; here
        a ValueError). C = `_capacity(S, E, 1, capacity_factor, min_capacity)`.
      used_token: None or [S] tensor of 0 / 1 (bool, int or float) on the logits' device; a
        token with 0 is not routed (counted nowhere, dispatched nowhere).
      noisy_gate_policy: None / "None" / "Jitter": the expert is argmax(softmax(logits)).
        "RSample": argmax(logits + Gumbel noise) (the weights stay the clean softmax). "Jitter"
        does nothing here, as in DeepSpeed: TopKGate applies it to the gate's input.
      drop_tokens: True = capacity C, each expert keeps C tokens; False = C is the largest
        expert count (see `_no_drop_capacity`; then at most S), nothing dropped.
      use_rts: random token selection: an over-full expert keeps the C tokens with the largest
        U(0, 1) draws ([S, E] draws, drawn even when nothing overflows, as DeepSpeed does).
        False: it keeps its C lowest token indices (DeepSpeed: torch.topk's order among ties).
      ep_group: a torch.distributed process group; used only with drop_tokens=False.
      sparse_routes: return the per-route form DeepSpeed's MOELayer consumes (see below).
      use_tutel: DeepSpeed then computes the slots with tutel's fast_cumsum_sub_one, which equals
        cumsum - 1: same slots, so the flag changes nothing here.
      generator: keyword-only (ours): the torch.Generator of the RSample and use_rts draws. None
        = the global RNG, drawn in DeepSpeed's order (Gumbel first, then uniform), so a seed
        reproduces DeepSpeed's routing.

    Returns (dense): l_aux (0-dim: E * sum_e mean_s(softmax)[e] * fraction of used tokens routed
      to e before drops), combine_weights [S, E, C] (the softmax probability of the kept token's
      expert at its slot; float32, float64 for float64 logits), dispatch_mask [S, E, C] bool
      (combine_weights != 0, as DeepSpeed), exp_counts [E] (tokens per expert before drops:
      int64, float for a floating used_token, as DeepSpeed's einsum promotes).
    Returns (sparse_routes=True): l_aux, capacity (0-dim int64), E, indices [1, S] int32 (-1 =
      dropped or unused), locations [1, S] int32 (0 where dropped), gates [1, S] (the kept
      probability, 0 where dropped), exp_counts.
    Slots number the kept tokens of an expert by token index. Differentiable in `logits`
    (combine_weights, gates, l_aux).
    """
    S, E = _check_common(logits, capacity_factor, min_capacity, drop_tokens, sparse_routes)
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}")
    for name, value in (("use_rts", use_rts), ("use_tutel", use_tutel)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if S < min_capacity:
        raise ValueError(
            f"min_capacity must be at most the number of tokens S = {S} (DeepSpeed asserts it), got {min_capacity}"
        )
    used = None
    if used_token is not None:
        _validate.tensor("used_token", used_token, dim=1, shape="[S]")
        if used_token.shape[0] != S:
            raise ValueError(f"used_token must be [S] = [{S}], got shape {tuple(used_token.shape)}")
        _validate.same_device(logits=logits, used_token=used_token)
        if not ((used_token == 0) | (used_token == 1)).all():
            raise ValueError("used_token must hold only 0 and 1 (DeepSpeed multiplies the routing mask by it)")
        used = used_token.reshape(S, 1) != 0

    # Draws in DeepSpeed's order: the RSample Gumbel noise, then the random-token-selection uniforms.
    noisy = logits + _gumbel(logits, generator) if noisy_gate_policy == "RSample" else None
    gates = torch.softmax(logits, dim=1)
    experts = _top_experts(gates if noisy is None else noisy, 1)  # [S, 1]
    if used is not None:
        experts = torch.where(used, experts, -1)
    uniform = _uniform(logits, generator) if use_rts else None

    if drop_tokens:
        capacity = _capacity(S, E, 1, capacity_factor, min_capacity)
        capacity_device = torch.device("cpu")
        if uniform is not None:
            priority = uniform.gather(1, experts.clamp(min=0))
            chosen, counts = capacity_positions(experts, E, capacity, priority=priority)
            positions = _tokens_in_order(experts, chosen >= 0, E, capacity)
        else:
            positions, counts = capacity_positions(experts, E, capacity)
    else:
        positions, counts = capacity_positions(experts, E, S)
        capacity = min(_no_drop_capacity(counts, ep_group), S)
        capacity_device = logits.device

    me = gates.mean(dim=0)
    ce = counts.float() / S
    l_aux = (me * ce).sum() * E
    exp_counts = counts if used_token is None else counts.to(torch.promote_types(used_token.dtype, torch.int64))
    weights = torch.where(positions >= 0, gates.gather(1, experts.clamp(min=0)), 0.0)
    combine_dtype = torch.promote_types(gates.dtype, torch.float32)
    return _outputs(
        l_aux, experts, positions, weights, exp_counts, capacity, capacity_device, sparse_routes, combine_dtype
    )


def top2gating(
    logits,
    capacity_factor,
    min_capacity,
    drop_tokens=True,
    ep_group=None,
    top2_2nd_expert_sampling=True,
    sparse_routes=False,
    *,
    generator=None,
):
    """DeepSpeed's top2gating (GShard top-2).

    Args:
      logits: [S, E] floating router logits, E >= 2. Never modified (DeepSpeed adds the
        second-expert noise to them in place).
      capacity_factor: float >= 0; min_capacity: int >= 0. C = `_capacity(S, E, 2, ...)`.
      drop_tokens: True = every expert keeps its first C choices, all first choices before any
        second choice, by token index within each (DeepSpeed's cumsum order = capacity_positions'
        default order); False = C is the largest expert count (`_no_drop_capacity`).
      ep_group: a torch.distributed process group; used only with drop_tokens=False.
      top2_2nd_expert_sampling: True = the second expert is argmax(logits + Gumbel noise) over
        the experts other than the first; False = argmax(logits) over them.
      sparse_routes: return the per-route form (see below).
      generator: keyword-only (ours): the torch.Generator of the Gumbel draws; None = the global
        RNG as DeepSpeed draws it.

    The first expert is argmax(softmax(logits)); both argmaxes take the lowest index among equal
    values, as torch.argmax does.

    Returns (dense): l_aux (0-dim, E * sum_e mean_s(softmax)[e] * fraction of first choices to
      e), combine_weights [S, E, C] (the two softmax probabilities renormalised over the kept
      choices, denominator clamped at eps; float32, float64 for float64 logits), dispatch_mask
      [S, E, C] bool, exp_counts [E] int64 (choices per expert before drops).
    Returns (sparse_routes=True): l_aux, capacity (0-dim int64), E, indices [2, S] int32 (-1 =
      dropped), locations [2, S] int32 (0 where dropped), gates [2, S], exp_counts.
    """
    S, E = _check_common(logits, capacity_factor, min_capacity, drop_tokens, sparse_routes)
    if E < 2:
        raise ValueError(f"top2gating needs logits [S, E] with E >= 2 experts, got {tuple(logits.shape)}")
    if not isinstance(top2_2nd_expert_sampling, bool):
        raise TypeError(f"top2_2nd_expert_sampling must be a bool, got {type(top2_2nd_expert_sampling).__name__}")

    gates = torch.softmax(logits, dim=1)
    first = _top_experts(gates, 1)
    second_key = logits
    if top2_2nd_expert_sampling:  # in DeepSpeed's dtype: its in-place add keeps the logits' dtype
        second_key = (logits + _gumbel(logits, generator)).to(logits.dtype)
    second = _top_experts(second_key.detach().scatter(1, first, float("-inf")), 1)
    experts = torch.cat([first, second], dim=1)

    if drop_tokens:
        capacity = _capacity(S, E, 2, capacity_factor, min_capacity)
        capacity_device = torch.device("cpu")
        positions, counts = capacity_positions(experts, E, capacity)
    else:
        positions, counts = capacity_positions(experts, E, 2 * S)
        capacity = _no_drop_capacity(counts, ep_group)
        capacity_device = logits.device

    me = gates.mean(dim=0)
    ce = torch.bincount(first[:, 0], minlength=E).float() / S
    l_aux = (me * ce).mean() * E * E
    # DeepSpeed's einsum with its float32 masks promotes the gathered probabilities to float32.
    compute = torch.promote_types(gates.dtype, torch.float32)
    weights = torch.where(positions >= 0, gates.gather(1, experts).to(compute), 0.0)
    denom = weights.sum(dim=1, keepdim=True).clamp(min=torch.finfo(compute).eps)
    weights = weights / denom
    return _outputs(l_aux, experts, positions, weights, counts, capacity, capacity_device, sparse_routes, compute)


def topkgating(
    logits,
    k,
    capacity_factor,
    min_capacity,
    drop_tokens=True,
    ep_group=None,
    drop_policy="probs",
    sparse_routes=False,
):
    """DeepSpeed's topkgating (top-k with capacity, any k).

    Args:
      logits: [S, E] floating router logits. k: experts per token, 1 <= k <= E: the k largest
        softmax probabilities, by descending probability, equal ones to the lower expert index
        (DeepSpeed's torch.topk leaves that order unspecified).
      capacity_factor: float >= 0; min_capacity: int >= 0. C = `_capacity(S, E, k, ...)`.
      drop_tokens: True = every expert keeps C choices chosen by `drop_policy`; False = C is the
        largest expert count (`_no_drop_capacity`), nothing dropped.
      ep_group: a torch.distributed process group; used only with drop_tokens=False.
      drop_policy: "probs" = an over-full expert keeps its C highest probabilities, equal ones to
        the lower token index (DeepSpeed: torch.topk's order); "position" = its C lowest token
        indices. Checked whatever drop_tokens is (DeepSpeed checks it only when dropping).
      sparse_routes: return the per-route form (see below).

    Returns (dense): l_aux (0-dim, E^2 / k * mean_e(mean_s(softmax)[e] * fraction of tokens
      choosing e)), combine_weights [S, E, C] (the kept probabilities renormalised over a
      token's kept choices, denominator clamped at eps; float32, float64 for float64 logits),
      dispatch_mask [S, E, C] bool, exp_counts [E] int64 (choices per expert before drops).
    Returns (sparse_routes=True): l_aux, capacity (0-dim int64), E, indices [k, S] int32 (route
      r of token t = its (r+1)-th choice; -1 = dropped), locations [k, S] int32 (0 where
      dropped), gates [k, S] (in the logits' dtype), exp_counts.
    Slots number the kept choices of an expert by token index.
    """
    S, E = _check_common(logits, capacity_factor, min_capacity, drop_tokens, sparse_routes)
    _validate.integer("k", k, low=1, high=E, what=f" (E = {E} experts)")
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")

    gates = torch.softmax(logits, dim=1)
    experts = _top_experts(gates, k)  # [S, k]
    probs = gates.gather(1, experts)
    # One choice per row, token-major: capacity_positions' default order is then DeepSpeed's
    # cumsum over tokens, and its ties (by row) go to the lower token index.
    flat = experts.reshape(S * k, 1)
    if drop_tokens:
        capacity = _capacity(S, E, k, capacity_factor, min_capacity)
        capacity_device = torch.device("cpu")
        if drop_policy == "probs":
            chosen, counts = capacity_positions(flat, E, capacity, priority=probs.detach().reshape(S * k, 1))
            positions = _tokens_in_order(flat, chosen >= 0, E, capacity)
        else:
            positions, counts = capacity_positions(flat, E, capacity)
    else:
        positions, counts = capacity_positions(flat, E, S)  # a token chooses an expert at most once
        capacity = _no_drop_capacity(counts, ep_group)
        capacity_device = logits.device
    positions = positions.view(S, k)

    me = gates.mean(dim=0)
    ce = counts.float() / S
    l_aux = (me * ce).mean() * E * E / k
    weights = torch.where(positions >= 0, probs, 0.0)
    weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    combine_dtype = torch.promote_types(gates.dtype, torch.float32)
    return _outputs(l_aux, experts, positions, weights, counts, capacity, capacity_device, sparse_routes, combine_dtype)
