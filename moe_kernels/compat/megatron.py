"""Megatron-Core's MoE routing functions with their own signatures, computed with our ops.

From megatron/core/transformer/moe/moe_utils.py of NVIDIA/Megatron-LM:
- `topk_routing_with_score_function`, `apply_router_token_dropping`, `get_capacity` as of
  commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22);
- `topk_softmax_with_capacity`, the earlier one-call form returning three values, as of commit
  0d3368255c59b2e4ed666721682ca779e20526e3 (2025-08-15), the last before c08d89be split it into
  the two functions above.

Selection and weights come from `topk_router`, drops from `capacity_positions`. Where Megatron's
result depends on the unspecified tie order of `torch.topk` (equal scores at the k-th place,
equal probabilities or the 0/1 map of the "position" policy at an expert's capacity), ours is
pinned: the lower expert index, the lower token index. docs/compat.md lists what matches exactly.
"""

import math

import torch

from moe_kernels.ops import _validate, capacity_positions, topk_router

__all__ = [
    "apply_router_token_dropping",
    "get_capacity",
    "topk_routing_with_score_function",
    "topk_softmax_with_capacity",
]

_DROP_POLICIES = ("probs", "position")


def get_capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int | None = None) -> int:
    """Megatron's expert capacity: ceil((num_tokens / num_experts) * capacity_factor), at least
    min_capacity.

    The float operations are Megatron's, in its order (divide, then multiply): ceil(cf * T * k / E)
    (`moe_kernels.ops.capacity_for`) rounds differently for some arguments, and a drop-in must give
    Megatron's capacity in every case. Callers pass num_tokens = T * k (apply_router_token_dropping).

    Args:
      num_tokens: int >= 0. num_experts: int >= 1.
      capacity_factor: finite real >= 0. min_capacity: None or int >= 0.
    """
    _validate.integer("num_tokens", num_tokens, low=0)
    _validate.integer("num_experts", num_experts, low=1)
    _real("capacity_factor", capacity_factor, low=0.0)
    if min_capacity is not None:
        _validate.integer("min_capacity", min_capacity, low=0)
    capacity = math.ceil((num_tokens / num_experts) * capacity_factor)
    if min_capacity is not None and capacity < min_capacity:
        capacity = min_capacity
    return capacity


def topk_routing_with_score_function(
    logits: torch.Tensor,
    topk: int,
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    fused: bool = False,
    router_replay=None,
    dense_output: bool = False,
    precomputed_indices: torch.Tensor | None = None,
):
    """Megatron-Core's top-k routing with a score function.

    Args:
      logits: [T, E] float16 / bfloat16 / float32 / float64 router logits.
      topk: experts per token, 1 <= topk <= E.
      use_pre_softmax: softmax only: True = the full-softmax probabilities of the top k; False =
        the top k logits, then a softmax over those k.
      num_groups, group_topk: group-limited routing when group_topk is set (not None or 0): the
        E experts in num_groups contiguous groups, each group scored by the sum of its
        topk // group_topk largest routing values (logits for softmax without pre-softmax,
        probabilities with it, sigmoid scores + expert_bias for sigmoid); only the group_topk best
        groups' experts are eligible.
      scaling_factor: multiplies the probabilities when truthy (None and 0 leave them unscaled).
      score_function: "softmax" or "sigmoid" (sigmoid scores divided by their sum when topk > 1).
        "sqrtsoftplus" raises NotImplementedError: topk_router has no such scores.
      expert_bias: [E] float, sigmoid only: selects by sigmoid + bias, weighs by sigmoid; no
        gradient. Megatron ignores it with softmax (its config forbids that pairing); so do we.
      fused: accepted and ignored (Transformer Engine's fused kernel in Megatron; topk_router is
        ours, with the same results).
      router_replay, precomputed_indices: must be None (NotImplementedError otherwise).
      dense_output: return [T, topk] tensors instead of [T, E] ones.

    Returns:
      dense_output False: (routing_probs [T, E] in the logits' dtype, 0 off the selection;
        routing_map [T, E] bool).
      dense_output True: (probs [T, topk] in the logits' dtype, top_indices [T, topk] int64 by
        descending routing value). Megatron returns unsorted indices when gradients are disabled.

    Differentiable in `logits`. Equal routing values go to the lower expert index (torch.topk
    leaves that unspecified).
    """
    if router_replay is not None:
        raise NotImplementedError("router_replay is not supported: it replays Megatron's own torch.topk calls")
    if precomputed_indices is not None:
        raise NotImplementedError("precomputed_indices is not supported: our routing selects with topk_router")
    _flag("fused", fused)
    _flag("dense_output", dense_output)
    weights, experts = _route(
        logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, expert_bias
    )
    probs = weights.to(logits.dtype)
    if dense_output:
        return probs, experts
    return _scatter(logits, probs, experts)


def apply_router_token_dropping(
    routing_probs: torch.Tensor,
    routing_map: torch.Tensor,
    router_topk: int,
    capacity_factor: float,
    drop_policy: str = "probs",
    pad_to_capacity: bool = False,
):
    """Megatron-Core's capacity limit on a [T, E] routing.

    Each expert keeps C = get_capacity(T * router_topk, E, capacity_factor) tokens (all of them
    when C > T): the C tokens with the highest routing_probs ("probs") or the first C routed
    tokens ("position"), equal values to the lower token index (torch.topk leaves that
    unspecified). pad_to_capacity: the map becomes those C tokens per expert, padded with
    tokens not routed to it (probability 0), so that every expert gets exactly min(C, T) rows.

    Args:
      routing_probs: [T, E] float, the probability of each (token, expert), 0 off the routing.
      routing_map: [T, E] bool, the routing.
      router_topk: int >= 1, experts per token (only enters the capacity).
      capacity_factor: finite real >= 0.
      drop_policy: "probs" or "position". pad_to_capacity: bool.

    Returns:
      (final_probs [T, E] in routing_probs' dtype, routing_probs where kept, else 0;
       final_map [T, E] bool). Differentiable in routing_probs.
    """
    _validate.tensor("routing_probs", routing_probs, dim=2, shape="[T, E]", dtypes=_validate.FLOAT_DTYPES)
    _validate.tensor("routing_map", routing_map, dim=2, shape="[T, E]", dtypes=(torch.bool,))
    if routing_map.shape != routing_probs.shape:
        raise ValueError(
            f"routing_map must have routing_probs' shape {tuple(routing_probs.shape)}, got {tuple(routing_map.shape)}"
        )
    _validate.same_device(routing_probs=routing_probs, routing_map=routing_map)
    _validate.integer("router_topk", router_topk, low=1)
    _choice("drop_policy", drop_policy, _DROP_POLICIES)
    _flag("pad_to_capacity", pad_to_capacity)
    T, E = routing_probs.shape
    if E < 1:
        raise ValueError(f"routing_probs must be [T, E] with E >= 1, got shape {tuple(routing_probs.shape)}")
    capacity = get_capacity(num_tokens=T * router_topk, num_experts=E, capacity_factor=capacity_factor)
    if capacity > T:
        capacity_mask = torch.ones_like(routing_map)
    else:
        capacity_mask = _capacity_mask(routing_probs, routing_map, capacity, drop_policy)
    final_map = capacity_mask if pad_to_capacity else routing_map & capacity_mask
    return routing_probs * final_map, final_map


def topk_softmax_with_capacity(
    logits: torch.Tensor,
    topk: int,
    capacity_factor: float | None = None,
    pad_to_capacity: bool = False,
    drop_policy: str = "probs",
    use_pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    deterministic_mode: bool = False,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
):
    """Megatron-Core's earlier one-call routing (moe_utils.py at 0d336825): top-k, then capacity.

    Arguments as topk_routing_with_score_function and apply_router_token_dropping;
    capacity_factor None = no capacity limit; deterministic_mode is deprecated and ignored (as in
    Megatron).

    Returns:
      (routing_probs [T, E] in the logits' dtype, routing_map [T, E] bool, after the capacity
       limit; tokens_per_expert [E] int64, tokens routed to each expert before dropping and
       padding).

    Where this version differs from the later two functions, ours follows the later ones, as
    documented in docs/compat.md: its scores and probabilities are rounded to the logits' dtype
    before the top-k and the normalisation (ours: float32 throughout, one rounding at the end;
    the same for float32 logits), and a capacity above T makes its torch.topk raise where ours
    keeps every token (padded: every row).
    """
    _flag("deterministic_mode", deterministic_mode)
    weights, experts = _route(
        logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, expert_bias
    )
    routing_probs, routing_map = _scatter(logits, weights.to(logits.dtype), experts)
    tokens_per_expert = routing_map.sum(dim=0)
    if capacity_factor is None:
        return routing_probs, routing_map, tokens_per_expert
    routing_probs, routing_map = apply_router_token_dropping(
        routing_probs, routing_map, topk, capacity_factor, drop_policy=drop_policy, pad_to_capacity=pad_to_capacity
    )
    return routing_probs, routing_map, tokens_per_expert


def _route(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function, expert_bias):
    """(weights [T, topk] float32 (float64 for float64 logits), experts [T, topk] int64): the
    selection and probabilities, scaled, before the cast to the logits' dtype."""
    _validate.tensor("logits", logits, dim=2, shape="[num_tokens, num_experts]", dtypes=_validate.FLOAT_DTYPES)
    E = logits.shape[1]
    if E < 1:
        raise ValueError(f"logits must be [num_tokens, num_experts] with num_experts >= 1, got {tuple(logits.shape)}")
    _validate.integer("topk", topk, low=1, high=E, what=f" (num_experts = {E})")
    _flag("use_pre_softmax", use_pre_softmax)
    if score_function == "sqrtsoftplus":
        raise NotImplementedError(
            "score_function='sqrtsoftplus' is not supported: topk_router's scores are softmax or sigmoid"
        )
    _choice("score_function", score_function, ("softmax", "sigmoid"))
    if scaling_factor is not None:
        _real("scaling_factor", scaling_factor)
    scale = float(scaling_factor) if scaling_factor else 1.0  # Megatron: `if scaling_factor:`
    per_group = _check_groups(E, topk, num_groups, group_topk)
    groups = {}
    if per_group:
        groups = {"num_groups": num_groups, "topk_groups": group_topk, "group_scoring": _GROUP_SCORING.get(per_group)}
    if score_function == "softmax":
        if per_group and not use_pre_softmax:
            # Here Megatron scores groups by sums of logits, which topk_router's group scores (of
            # probabilities) cannot express. Masking the other groups' logits to -inf is exact:
            # the softmax over the k selected logits does not see the masked ones.
            eligible = _groups_by_top_logits(logits, num_groups, group_topk, per_group)
            masked = logits.masked_fill(~eligible, float("-inf"))
            return topk_router(masked, topk, scoring="softmax", renormalize=True, scaling_factor=scale)
        if per_group and groups["group_scoring"] is None:
            raise NotImplementedError(_TOP_N_MESSAGE.format(n=per_group))
        # Without pre-softmax: the softmax over the top-k logits = the top-k probabilities
        # renormalised; topk_router ranks by the logits when there are no groups.
        return topk_router(
            logits, topk, scoring="softmax", renormalize=not use_pre_softmax, scaling_factor=scale, **groups
        )
    if per_group and groups["group_scoring"] is None:
        raise NotImplementedError(_TOP_N_MESSAGE.format(n=per_group))
    if expert_bias is not None:
        _validate.tensor("expert_bias", expert_bias, dim=1, shape="[E]", dtypes=_validate.FLOAT_DTYPES)
        if expert_bias.shape[0] != E:
            raise ValueError(f"expert_bias must be [E] = [{E}], got shape {tuple(expert_bias.shape)}")
        _validate.same_device(logits=logits, expert_bias=expert_bias)
    # Megatron divides by (sum + 1e-20) when topk > 1; ours by the sum (0 for a zero sum).
    return topk_router(
        logits, topk, scoring="sigmoid", bias=expert_bias, renormalize=topk > 1, scaling_factor=scale, **groups
    )


# A group's score is the sum of its topk // group_topk largest values; topk_router has two of those.
_GROUP_SCORING = {1: "max", 2: "top2_sum"}
_TOP_N_MESSAGE = (
    "group-limited routing with topk // group_topk = {n} is supported only for score_function='softmax' "
    "without use_pre_softmax: topk_router scores a group by its largest value or its two largest"
)


def _check_groups(E, topk, num_groups, group_topk) -> int:
    """0 without group-limited routing, else topk // group_topk (the values a group's score sums)."""
    if not group_topk:  # Megatron: `if group_topk:`
        if group_topk is not None:
            _validate.integer("group_topk", group_topk, low=0)
        return 0
    _validate.integer("group_topk", group_topk, low=1)
    if num_groups is None:
        raise ValueError("num_groups must be set when group_topk is set")
    _validate.integer("num_groups", num_groups, low=group_topk, high=E, what=f" (group_topk = {group_topk}, E = {E})")
    if E % num_groups:
        raise ValueError(f"num_groups must divide the number of experts E = {E}, got {num_groups}")
    if group_topk == num_groups:  # every group eligible: no restriction
        return 0
    if topk < group_topk:
        raise ValueError(
            f"topk must be >= group_topk = {group_topk}, got {topk}: with topk // group_topk = 0 every group "
            "scores 0 and Megatron's choice of groups is torch.topk's unspecified tie order"
        )
    eligible = group_topk * (E // num_groups)
    if topk > eligible:
        raise ValueError(f"topk must be <= group_topk * E / num_groups = {eligible}, got {topk}")
    return topk // group_topk


def _groups_by_top_logits(logits, num_groups, group_topk, per_group) -> torch.Tensor:
    """[T, E] bool: the experts of the group_topk groups whose per_group largest logits have the
    largest sum (summed in the logits' dtype, as Megatron does; equal sums: the lower group)."""
    T, E = logits.shape
    grouped = logits.detach().reshape(T, num_groups, E // num_groups)
    sums = grouped.sort(dim=-1, descending=True).values[..., :per_group].sum(dim=-1)
    best = sums.sort(dim=-1, descending=True, stable=True).indices[:, :group_topk]
    chosen = torch.zeros(T, num_groups, dtype=torch.bool, device=logits.device).scatter(1, best, True)
    return chosen.repeat_interleave(E // num_groups, dim=1)


def _scatter(logits, probs, experts):
    """[T, E] probabilities (logits' dtype) and bool map from the [T, k] selection."""
    routing_probs = torch.zeros_like(logits).scatter(1, experts, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
    return routing_probs, routing_map


def _capacity_mask(routing_probs, routing_map, capacity, drop_policy) -> torch.Tensor:
    """[T, E] bool: for each expert, the `capacity` tokens of highest priority among all T (the
    probability, or 1 if routed else 0), equal priorities to the lower token index.

    capacity_positions on a [T, E] choice table whose column e is expert e: every token competes
    for every expert, as in Megatron's torch.topk over dim 0, and the op's tie order (by choice
    column, then token) is the token index within an expert.
    """
    T, E = routing_probs.shape
    table = torch.arange(E, device=routing_probs.device).expand(T, E).contiguous()
    if drop_policy == "probs":
        priority = routing_probs.detach()
    else:
        priority = routing_map.to(torch.float32)
    positions, _ = capacity_positions(table, E, capacity, priority=priority)
    return positions >= 0


def _choice(name, value, allowed):
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {allowed}, got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def _flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _real(name, value, low=None):
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or (low is not None and value < low):
        bound = "finite" if low is None else f"finite and >= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value
