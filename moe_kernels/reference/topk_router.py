"""Reference router of today's MoE models: the specification the topk_router kernels are tested against.

One function covers the routers of Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.5, MiniMax-M2,
Ernie 4.5, GPT-OSS, Llama 4, ...: softmax or sigmoid scores, a selection-only correction bias
(DeepSeek-V3's aux-loss-free balancing), group-limited top-k, renormalisation and a scaling factor.
docs/routers.md maps each family's router to its call.
"""

import torch

from moe_kernels.reference.ranking import descending_order

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORINGS = ("top2_sum", "max")


def router_scores(x: torch.Tensor, scoring: str) -> torch.Tensor:
    """[T, E] scores from [T, E] logits already in the compute dtype.

    softmax: a row whose logits are all -inf (a fully masked token) gets scores 0, not NaN.
    """
    if scoring == "sigmoid":
        return torch.sigmoid(x)
    if x.numel() == 0:
        return x.clone()
    masked = x.amax(dim=-1, keepdim=True) == float("-inf")
    # Masked rows go through the softmax as zeros so that their gradient is 0, not NaN.
    return torch.where(masked, 0.0, torch.softmax(torch.where(masked, 0.0, x), dim=-1))


def eligible_experts(choice: torch.Tensor, num_groups: int, topk_groups: int, group_scoring: str) -> torch.Tensor:
    """[T, E] bool: the experts of the topk_groups best groups of each row.

    The E experts split into num_groups contiguous groups; a group's score is the sum of its two
    largest choice values ("top2_sum", DeepSeek-V3) or its largest ("max", DeepSeek-V2); equal
    group scores go to the lower group index.
    """
    T, E = choice.shape
    grouped = choice.view(T, num_groups, E // num_groups)
    ranked = grouped.gather(-1, descending_order(grouped))
    group_score = ranked[..., 0] if group_scoring == "max" else ranked[..., 0] + ranked[..., 1]
    best_groups = descending_order(group_score)[:, :topk_groups]
    eligible = torch.zeros(T, num_groups, dtype=torch.bool, device=choice.device).scatter(1, best_groups, True)
    return eligible.repeat_interleave(E // num_groups, dim=1)


def topk_router(
    logits: torch.Tensor,
    k: int,
    *,
    scoring: str = "softmax",
    bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int | None = None,
    group_scoring: str = "top2_sum",
    renormalize: bool = False,
    scaling_factor: float = 1.0,
):
    """The k experts of each token and their routing weights.

    Args:
      logits: [T, E] float16 / bfloat16 / float32 / float64 router logits.
      k: experts per token, 1 <= k <= the number of eligible experts.
      scoring: "softmax" or "sigmoid": scores = softmax(logits) over the row, or sigmoid(logits).
      bias: [E] or None: the correction bias of aux-loss-free balancing. choice = scores + bias
        decides which experts are selected; it never enters the weights and gets no gradient.
      num_groups, topk_groups, group_scoring: group-limited routing (see eligible_experts); only
        experts of the topk_groups best groups are selected. num_groups must divide E.
      renormalize: divide the selected weights by their sum (a zero sum gives zeros).
      scaling_factor: multiplies the weights last (DeepSeek's routed_scaling_factor).

    Returns:
      weights: [T, k] float32 (float64 for float64 logits): scores of the selected experts.
      experts: [T, k] int64, by descending choice value, equal values by lower expert index.

    Computed in float32 whatever the logits' dtype (float64 for float64 logits).

    Selection key: with no bias and one group, the experts are ranked by their logits: the scores
    are an increasing function of the logits, and ranking the logits themselves keeps the order
    of distinct logits whose scores round to the same float (sigmoid is exactly 1.0 in float32
    above ~17, softmax underflows to 0). Otherwise by choice = scores + bias, in the compute dtype.
    NaN ranks above every number (as in torch.sort), so a NaN logit is selected and gives NaN
    weights (with softmax, the whole row's scores are NaN).
    """
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(compute)
    scores = router_scores(x, scoring)
    grouped = num_groups > 1 and (topk_groups is not None and topk_groups < num_groups)
    if bias is None and not grouped:
        order = descending_order(x)
    else:
        choice = scores.detach() if bias is None else scores.detach() + bias.detach().to(compute)
        order = descending_order(choice)
        if grouped:
            eligible = eligible_experts(choice, num_groups, topk_groups, group_scoring)
            # A stable sort by eligibility keeps the choice order within the eligible experts.
            order = order.gather(1, descending_order(eligible.gather(1, order).to(torch.int8)))
    experts = order[:, :k]
    weights = scores.gather(1, experts)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        zero = total == 0
        weights = torch.where(zero, 0.0, weights / torch.where(zero, 1.0, total))
    return weights * scaling_factor, experts
