"""Reference dispatch: scatter the tokens into the [E, C, d] expert buffers.

Terms: T tokens, k choices per token, E experts, C capacity (slots per expert), d hidden size.
A "choice" is a (token t, slot s) pair of `experts` [T, k]; -1 marks an empty choice.
"""

import torch


def dispatch(x: torch.Tensor, experts: torch.Tensor, positions: torch.Tensor, num_experts: int, capacity: int):
    """buffer [E, C, d]: buffer[experts[t, s], positions[t, s]] = x[t] for every kept choice;
    slots nobody fills are zero. x: [T, d]; experts, positions: [T, k] int64."""
    T, k = experts.shape
    # Static shapes (no boolean-mask indexing: the op's double backward differentiates this on the
    # device without a host read): a dropped choice writes into a spare slot (E, C), cut off after.
    # positions must be below capacity (the ops check it).
    buffer = x.new_zeros(num_experts + 1, capacity + 1, x.shape[1])
    kept = positions >= 0
    token = torch.arange(T, device=x.device).unsqueeze(1).expand(T, k)
    index = (torch.where(kept, experts, num_experts), torch.where(kept, positions, capacity))
    return buffer.index_put(index, x[token])[:num_experts, :capacity].contiguous()
