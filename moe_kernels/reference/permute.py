"""Reference dropless permute / unpermute: rows grouped by expert, no capacity.

Terms: T tokens, k choices per token, E experts, C capacity (slots per expert), d hidden size.
A "choice" is a (token t, slot s) pair of `experts` [T, k]; -1 marks an empty choice.
"""

import torch


def permute(x: torch.Tensor, experts: torch.Tensor, num_experts: int):
    """Dropless grouping of the rows by expert.

    Returns:
      x_sorted: [T*k, d], the rows of all non-empty choices grouped by expert (expert 0 first),
        stable by token within an expert; the rows of empty choices come last and are zero.
      expert_offsets: [E+1] int64, rows of expert e are x_sorted[offsets[e]:offsets[e+1]];
        offsets[E] is the number of non-empty choices.
      order: [T*k] int64, order[r] = t*k + s, the choice whose row is r; -1 for the trailing
        rows of empty choices.
    """
    T, k = experts.shape
    flat = experts.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)
    sorted_key, order = torch.sort(key, stable=True)
    valid = sorted_key < num_experts
    order = torch.where(valid, order, -1)
    x_sorted = torch.where(valid.unsqueeze(1), x[order.clamp(min=0) // k], 0.0) if k else x.new_zeros(0, x.shape[1])
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return x_sorted, offsets, order


def unpermute(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int):
    """y [T, d] = sum over rows r with order[r] = t*k + s of weights[t, s] * y_sorted[r].

    y_sorted: [T*k, d]; order: [T*k] from permute; weights: [T, k]. Rows with order -1 are
    ignored. Accumulates in float32 (float64 for float64); y has y_sorted's dtype.
    """
    acc = torch.float64 if y_sorted.dtype == torch.float64 else torch.float32
    k = weights.shape[1]
    # Static shapes (no boolean-mask indexing: the op's double backward differentiates this on the
    # device without a host read): an ignored row adds an exact zero to token 0. Both factors are
    # zeroed, so a NaN in an ignored row reaches neither the sum nor a gradient.
    valid = order >= 0
    choice = order.clamp(min=0)
    row_weights = torch.where(valid, weights.reshape(-1)[choice].to(acc), 0.0)
    rows = torch.where(valid.unsqueeze(1), y_sorted.to(acc), 0.0) * row_weights.unsqueeze(1)
    y = torch.zeros(num_tokens, y_sorted.shape[1], dtype=acc, device=y_sorted.device)
    y = y.index_add(0, choice // max(k, 1), rows)
    return y.to(y_sorted.dtype)
