"""Reference noisy top-k gate of Shazeer et al. 2017 from its logits (eqs 3-5 and 8-10).

Terms: T tokens, E experts, k experts per token. clean_logits = x W_g, raw_noise_stddev = x W_noise.
"""

import torch

from moe_kernels.reference.load_probabilities import load_probabilities


def noisy_topk_gate(
    clean_logits: torch.Tensor,
    raw_noise_stddev: torch.Tensor,
    noise: torch.Tensor,
    k: int,
    noise_epsilon: float = 1e-2,
    mask: torch.Tensor | None = None,
    *,
    load_probabilities_fn=load_probabilities,
):
    """(weights [T, k], experts [T, k], load [E]) of the noisy top-k gate:

        noise_stddev = Softplus(raw_noise_stddev) + noise_epsilon
        H = clean_logits + noise * noise_stddev                          (eq 4)
        experts = the top k of H (ties to the lower index, NaN first)
        weights = Softmax(H[experts]) in clean_logits' dtype (eq 3)
        load_i = sum over tokens of mask_t P(x_t, i)                     (eqs 9-10)

    with P = load_probabilities(clean_logits, H, noise_stddev, k).

    Args:
      clean_logits, raw_noise_stddev, noise: [T, E] float, one dtype; noise holds the
        StandardNormal() samples.
      k: 1 <= k <= E.
      noise_epsilon: added to the softplus (the authors' code uses 1e-2).
      mask: optional [T] bool / 0-1 token weights (padding does not count in load).
      load_probabilities_fn: the P it composes; the reference's by default (the public op's
        fallback passes moe_kernels.ops.load_probabilities, which runs on any backend).

    Computed in float32 (float64 for float64 input): load is returned in that dtype. Differentiable
    in the three [T, E] inputs. Gradients (docs/reliability.md): NaN at a NaN raw_noise_stddev
    (d noise = d H * NaN, selected or not); the limit 0 where the load term is flat (a zero or
    tiny noise_stddev: load_probabilities) and where noise * stddev = -inf (stddev = +inf).
    """
    stddev = torch.nn.functional.softplus(raw_noise_stddev) + noise_epsilon
    # noise * stddev, except where it is -inf for every large stddev (stddev = +inf, noise < 0):
    # there the constant -inf, so that noise and stddev get the limit 0 through H, not autograd's
    # d H * inf = NaN at d H = 0 (the same values).
    constant = torch.isinf(stddev) & (noise < 0)
    noisy = clean_logits + torch.where(constant, float("-inf"), noise * torch.where(constant, 1.0, stddev))
    P, top = load_probabilities_fn(clean_logits, noisy, stddev, k, return_topk=True)
    experts = top[:, :k]
    compute = torch.float64 if clean_logits.dtype == torch.float64 else torch.float32
    weights = torch.softmax(noisy.gather(1, experts).to(compute), dim=-1).to(clean_logits.dtype)
    p = P.to(compute)
    load = (p * mask.to(p.dtype)[:, None]).sum(0) if mask is not None else p.sum(0)
    return weights, experts, load
