"""Reference combine: gather the expert outputs back to the tokens, weighted.

Terms: T tokens, k choices per token, E experts, C capacity (slots per expert), d hidden size.
A "choice" is a (token t, slot s) pair of `experts` [T, k]; -1 marks an empty choice.
"""

import torch


def combine(buffer: torch.Tensor, experts: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor):
    """y [T, d] = sum over kept choices s of weights[t, s] * buffer[experts[t, s], positions[t, s]].

    Dropped and empty choices add nothing: a token all of whose choices were dropped gets y = 0
    (its residual connection carries it). buffer: [E, C, d]; weights: [T, k]. Accumulates in
    float32 (float64 for float64 input); y has the buffer's dtype.
    """
    acc = torch.float64 if buffer.dtype == torch.float64 else torch.float32
    kept = positions >= 0
    if buffer.shape[1] == 0:  # capacity 0: every choice is dropped, but reading slot 0 below must be legal
        buffer = torch.nn.functional.pad(buffer, (0, 0, 0, 1))
    gathered = buffer[experts.clamp(min=0), positions.clamp(min=0)].to(acc)  # [T, k, d]
    gathered = torch.where(kept.unsqueeze(-1), gathered, 0.0)
    w = torch.where(kept, weights.to(acc), 0.0)
    return (gathered * w.unsqueeze(-1)).sum(1).to(buffer.dtype)
