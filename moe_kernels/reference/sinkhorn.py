"""Reference Sinkhorn balancing for n x k routing matrices (Kool et al., 004_62bca7777c830867.txt,
Section 2.3): rows sum to 1, columns to n / k, in the log domain.

    P_ij = exp(x_ij + u_i + v_j),  u_i = -logsumexp_j(x_ij + v_j)  (rows -> 1),
                                   v_j = log(n / k) - logsumexp_i(x_ij + u_i)  (columns -> n / k).

Each iteration sets u (rows exact), measures the column error err = max_j |colsum_j / (n/k) - 1|,
stops if err <= tol, else sets v. The result therefore always has exact row sums and column sums
within tol (or the last error, after num_iters). Adding a constant to a row changes nothing, so
logits and log-probabilities give the same result.
"""

import math

import torch


def sinkhorn(logits: torch.Tensor, num_iters: int, tol: float):
    """logits [n, k] -> (probs [n, k] in the logits' dtype, info [2] float64 = (iterations used,
    final column error)). Computed in float64 for float64 input, else float32."""
    n, k = logits.shape
    x = logits.double() if logits.dtype == torch.float64 else logits.float()
    v = x.new_zeros(k)
    u = x.new_zeros(n)
    err = 0.0
    iters = 0
    if n == 0:
        return logits.new_empty(0, k), torch.zeros(2, dtype=torch.float64, device=logits.device)
    log_target = math.log(n / k)
    for it in range(num_iters):
        iters = it + 1
        u = -torch.logsumexp(x + v[None, :], dim=1)
        log_col = torch.logsumexp(x + u[:, None], dim=0)  # log column sums without v
        err = float((torch.exp(v + log_col - log_target) - 1).abs().max())
        if err <= tol:
            break
        v = log_target - log_col
    info = torch.tensor([float(iters), err], dtype=torch.float64, device=logits.device)
    return torch.exp(x + u[:, None] + v[None, :]).to(logits.dtype), info
