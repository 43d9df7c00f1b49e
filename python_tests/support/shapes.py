"""Shared edge-case shapes for the routing ops (each line says why it is here)."""

import torch

# (T, E, k)
TOPK_SHAPES = [
    (1, 1, 1),  # one token, one expert
    (7, 8, 2),  # tokens < any block, the common k = 2
    (33, 13, 3),  # prime E, odd T
    (64, 64, 8),  # one full Triton tile
    (16, 5, 5),  # k = E
    (130, 256, 1),  # k = 1, multi-tile T, E a power of two
    (150, 40, 2),  # k = 2 (and k + 1 = 3) over blocks of 16 and 64 rows and a partial last; E not a multiple of 16
    (9, 300, 20),  # E not a power of two, k above the C++ insertion limit (16)
    (6, 512, 8),  # the C++ rounds selection at its largest E (k * E = 4096)
    (5, 600, 8),  # beyond it: the C++ insertion list with its floor prefilter
    (0, 8, 2),  # empty batch
]

# A few (T, E, k) for slow paths (Triton interpreter, gradcheck).
SMALL_TOPK_SHAPES = [(1, 1, 1), (7, 8, 2), (16, 5, 5), (9, 37, 20), (0, 4, 1)]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def adversarial_logits(kind: str, T: int, E: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    """[T, E] logits of a named adversarial kind."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, E, generator=g)
    if kind == "random":
        pass
    elif kind == "ties":  # few distinct values: many ties, broken by lower index
        x = torch.randint(0, 3, (T, E), generator=g).float()
    elif kind == "all_equal":
        x = torch.zeros(T, E)
    elif kind == "neg_inf":  # some experts masked
        x[torch.rand(T, E, generator=g) < 0.4] = float("-inf")
    elif kind == "all_neg_inf":  # fully masked tokens
        x[::2] = float("-inf")
    elif kind == "signed_zero":  # -0.0 ties with +0.0
        x = torch.where(torch.rand(T, E, generator=g) < 0.5, -0.0, 0.0)
    elif kind == "large":  # softmax overflow without the max shift
        x = x * 1e4
    else:
        raise ValueError(kind)
    return x.to(dtype)


ADVERSARIAL_KINDS = ["random", "ties", "all_equal", "neg_inf", "all_neg_inf", "signed_zero", "large"]


def subnormal_values(dtype, seed: int = 0) -> torch.Tensor:
    """[n] denormals of `dtype` (a spread of them, both signs), +-0 and the smallest normals,
    shuffled: scores and logits that rank by their last bits (issue 34: the Triton interpreter read
    bfloat16 denormals wrongly, so they ranked unlike the reference)."""
    tiny = torch.finfo(dtype).tiny
    steps = torch.tensor([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 100, 120, 127], dtype=torch.float64) / 128
    if dtype == torch.float32:
        steps = torch.cat([steps, torch.tensor([2.0**-23, 2.0**-20])])
    magnitudes = torch.cat([steps * tiny, torch.tensor([tiny, 2 * tiny, 0.0])])
    values = torch.cat([magnitudes, -magnitudes]).to(dtype)
    return values[torch.randperm(values.numel(), generator=torch.Generator().manual_seed(seed))]


# Capacity routing (issue 3): (T, E, k, d).
DISPATCH_SHAPES = [
    (1, 1, 1, 4),  # one token, one expert
    (7, 8, 2, 5),  # odd d, the common k = 2
    (33, 13, 3, 16),  # prime E, odd T
    (16, 4, 4, 3),  # k = E
    (40, 1, 1, 8),  # E = 1: every token to one expert
    (0, 8, 2, 4),  # empty batch
]
SMALL_DISPATCH_SHAPES = [(1, 1, 1, 4), (7, 8, 2, 5), (16, 4, 4, 3), (0, 4, 1, 2)]


def routing_choices(kind: str, T: int, E: int, k: int, seed: int = 0) -> torch.Tensor:
    """[T, k] int64 expert choices of a named kind (-1 = empty choice)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "random":  # distinct experts per token, as top-k gives
        return torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].contiguous()
    if kind == "empties":  # some empty choices (dropped upstream, or padding tokens)
        e = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].contiguous()
        return torch.where(torch.rand(T, k, generator=g) < 0.3, -1, e)
    if kind == "one_expert":  # every token's first choice to expert 0: maximal overflow
        e = torch.rand(T, E, generator=g).argsort(dim=1)[:, :k].contiguous()
        if E > 1:
            e = torch.where(e == 0, e[:, :1], e)  # keep choices distinct: swap 0 into slot 0
        e[:, 0] = 0
        return e
    if kind == "all_empty":
        return torch.full((T, k), -1, dtype=torch.int64)
    raise ValueError(kind)


ROUTING_KINDS = ["random", "empties", "one_expert", "all_empty"]

# DSelect-k (B, k, n): B = 0 (empty batch), one expert (m = 0), n a power of two and not (B.2
# entries past n), k > n (more selectors than experts), n = 256 (8 bits).
DSELECT_SHAPES = [(5, 2, 4), (7, 4, 6), (3, 1, 1), (0, 3, 5), (4, 3, 2), (2, 5, 3), (6, 4, 37), (2, 2, 256)]
# A few for slow paths (Triton interpreter).
SMALL_DSELECT_SHAPES = [(5, 2, 4), (3, 3, 6), (2, 1, 1), (0, 2, 3), (3, 2, 9)]

# Balanced assignment (n tokens, k experts, capacity; None = ceil(n / k)).
ASSIGNMENT_SHAPES = [
    (12, 3, None),  # k divides n: exactly n / k per expert, no free slot
    (13, 4, None),  # n not divisible by k: free slots (the F node)
    (20, 4, 7),  # capacity > n / k
    (9, 1, None),  # k = 1: everything to expert 0
    (6, 6, None),  # k = n: a permutation
    (5, 8, 1),  # k > n: more slots than tokens
    (0, 3, None),  # empty batch
]

# (T, E, m) for batchwise_mask (eq 18 of Appendix F): m tokens kept per expert.
BATCHWISE_SHAPES = [
    (1, 1, 1),  # one token, one expert, m = T
    (7, 8, 2),  # T < any tile, more experts than tokens
    (33, 13, 5),  # prime E, odd T
    (300, 1, 17),  # one expert, T over one Triton tile (256)
    (64, 4, 64),  # m = T: every token everywhere
    (40, 6, 0),  # m = 0: an empty mask
    (0, 5, 0),  # empty batch
    (520, 3, 519),  # m = T - 1 over three tiles
]

# A few (T, E, m) for the Triton interpreter.
SMALL_BATCHWISE_SHAPES = [(1, 1, 1), (7, 8, 2), (300, 2, 17), (9, 3, 9), (6, 2, 0), (0, 3, 0)]
