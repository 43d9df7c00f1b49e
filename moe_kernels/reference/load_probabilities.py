"""Reference smooth load estimator P(x, i) of Shazeer et al. 2017, Appendix A (eqs 8-9).

Terms: T tokens, E experts, k experts per token. H = noisy_logits is H(x) of eq 4, clean_logits is
x W_g and noise_stddev is Softplus(x W_noise).
"""

import torch

from moe_kernels.reference.ranking import descending_order


def load_probabilities(
    clean_logits: torch.Tensor, noisy_logits: torch.Tensor, noise_stddev: torch.Tensor, k: int, *, return_topk=False
):
    """P [T, E]: the probability that expert i is in the top k of H(x) when only element i's noise
    is drawn again (eq 9):

        P(x, i) = Phi((clean_i - kth_excluding(H, k, i)) / noise_stddev_i)

    kth_excluding(H, k, i), the k-th largest element of H without element i, is the (k+1)-th
    largest of the whole row when i itself is among the top k, and the k-th largest otherwise.
    "Largest" follows the ranking every op uses (larger value, then lower index; NaN first).

    Args:
      clean_logits, noisy_logits, noise_stddev: [T, E] float, same shape; noise_stddev > 0.
      k: 1 <= k <= E.
      return_topk: also return `top` [T, k+1] int64, the indices of the k+1 largest noisy logits
        in rank order (the first k are the experts topk_softmax(noisy_logits, k) selects); the
        last column is -1 when k = E.

    Conventions:
      - k = E: a top-k element has no threshold (nothing is left to beat it): P = 1.
      - clean = -inf (a masked expert) gives P = 0, +inf gives 1.
      - Where Phi is flat at z (phi(z) = 0 in the compute dtype: z infinite, or |z| beyond ~13.2
        in float32, ~38.5 in float64, e.g. a zero or tiny noise_stddev) the gradient is the
        limit, exactly 0, never 0 * inf = NaN.
      - NaN anywhere in the computation of z gives P = NaN (and a NaN gradient).
    Computed in float32 (float64 for float64 input), returned in clean_logits' dtype.
    Differentiable with respect to all three inputs; noisy_logits receives the gradient at the
    threshold elements (the k-th and (k+1)-th of its row).
    """
    compute = torch.float64 if clean_logits.dtype == torch.float64 else torch.float32
    clean = clean_logits.to(compute)
    noisy = noisy_logits.to(compute)
    stddev = noise_stddev.to(compute)
    T, E = noisy.shape

    # The ranking: a stable descending sort (NaN first, ties to the lower index).
    order = descending_order(noisy)
    top = order[:, : k + 1]
    selected = torch.zeros(T, E, dtype=torch.bool, device=noisy.device)
    selected.scatter_(1, order[:, :k], True)

    kth = noisy.gather(1, order[:, k - 1 : k])  # [T, 1] the k-th largest: threshold of the others
    if k < E:
        k1th = noisy.gather(1, order[:, k : k + 1])  # [T, 1] the (k+1)-th: threshold of the top k
    else:
        k1th = torch.full_like(kth, float("-inf"))
    threshold = torch.where(selected, k1th, kth)  # kth_excluding(H, k, i), [T, E]

    # z = (clean - threshold) / stddev. Where Phi is flat at z (its density phi(z) is 0 in the
    # compute dtype: z infinite, or |z| past ~13.2 in float32, ~38.5 in float64; a threshold of
    # -inf, an infinite difference, a zero or tiny stddev) z is a constant to autograd, so the
    # gradient there is the limit 0, not 0 * inf = NaN (d z / d stddev = -z / stddev overflows,
    # 1 / stddev is inf at stddev = 0). The values are those of the division either way.
    no_threshold = threshold == float("-inf")
    diff = clean - torch.where(no_threshold, 0.0, threshold)
    with torch.no_grad():
        infinite = no_threshold | torch.isinf(diff)
        z_inf = torch.where(no_threshold | (diff > 0), float("inf"), float("-inf"))
        z_value = torch.where(infinite, z_inf, diff / stddev)
        flat = torch.isinf(z_value) | (torch.exp(-0.5 * z_value * z_value) == 0)
    z = torch.where(flat, z_value, torch.where(flat, 0.0, diff) / torch.where(flat, 1.0, stddev))
    P = torch.special.ndtr(z)  # Phi, the standard normal CDF
    if k < E:
        top_out = top
    else:
        top_out = torch.cat([top, torch.full_like(top[:, :1], -1)], dim=1)
    P = P.to(clean_logits.dtype)
    return (P, top_out) if return_topk else P
