"""Noisy top-k gating of Shazeer et al. 2017 (002_01a24e7ec3602eec.txt, eqs 3-5) with the
importance and load losses of Section 4 / Appendix A (001_5d5a678b212947b9.txt, eqs 7-11)."""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels import losses
from moe_kernels.gates._common import check_input, check_sizes
from moe_kernels.ops import noisy_topk_gate, topk_softmax
from moe_kernels.ops.noisy_topk_gate import check_noise_epsilon
from moe_kernels.routing import Routing


def noisy_topk_routing(clean, raw_noise_stddev, noise, k, w_importance, w_load, noise_epsilon=1e-2, mask=None):
    """The gate's math from its logits: (experts [T, k], weights [T, k], aux_loss, stats).

    clean: [T, E] x W_g; raw_noise_stddev: [T, E] x W_noise, or None for no noise (eval);
    noise: [T, E] StandardNormal() samples (None when raw_noise_stddev is None).
    """
    E = clean.shape[1]
    if raw_noise_stddev is not None:
        # H(x) of eq 4, its top k (the experts topk_softmax would pick), their softmax weights
        # (eq 3) and Load(X) = sum_x P(x, i) (eqs 9-10): one fused pass per row on CPU.
        weights, experts, load = noisy_topk_gate(clean, raw_noise_stddev, noise, k, noise_epsilon, mask)
    else:
        weights, experts = topk_softmax(clean, k)
        load = losses.importance(experts, torch.ones_like(weights), E, mask).detach()
    importance = losses.importance(experts, weights, E, mask)
    aux_loss = w_importance * losses.cv_squared(importance) + w_load * losses.cv_squared(load)
    return experts, weights, aux_loss, {"importance": importance.detach(), "load": load.detach()}


class NoisyTopKGate(nn.Module):
    """G(x) = Softmax(KeepTopK(H(x), k)),  H(x)_i = (x W_g)_i + StandardNormal() * Softplus((x W_noise)_i).

    Args:
      d_model: input size d; num_experts: E; k: experts per token (1 <= k <= E).
      noisy: add the trainable noise of eq 4 in training (never in eval: eval is deterministic).
      w_importance, w_load: weights of the importance loss (eq 7) and the load loss (eq 11).
      noise_epsilon: added to Softplus(x W_noise) so that the load estimator never divides by 0
        (the authors' code uses 1e-2).

    W_g and W_noise start at zero (Appendix A, "Initial Load Imbalance"): no signal, some noise,
    so the initial load is balanced in expectation.

    forward(x [T, d], mask=None [T] bool) -> Routing with experts [T, k], weights [T, k] (x's
    dtype), aux_loss = w_importance * CV(Importance)^2 + w_load * CV(Load)^2 over the unmasked
    tokens, and stats {"importance": [E], "load": [E]} (detached). Load is the smooth estimator
    of eq 10 when noise is on, else the count of tokens per expert (no gradient: without noise P
    is a step function).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        k: int,
        noisy: bool = True,
        w_importance: float = 0.1,
        w_load: float = 0.1,
        noise_epsilon: float = 1e-2,
    ):
        super().__init__()
        check_sizes(d_model, num_experts, k)
        self.d_model, self.num_experts, self.k = d_model, num_experts, k
        self.noisy = noisy
        self.w_importance, self.w_load = float(w_importance), float(w_load)
        self.noise_epsilon = check_noise_epsilon(noise_epsilon)
        self.w_gate = nn.Parameter(torch.zeros(d_model, num_experts))
        self.w_noise = nn.Parameter(torch.zeros(d_model, num_experts))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        check_input(x, self.d_model, mask)
        k = self.k
        clean = x @ self.w_gate.to(x.dtype)
        if self.noisy and self.training:
            raw_noise_stddev = x @ self.w_noise.to(x.dtype)
            noise = torch.randn_like(clean)
        else:
            raw_noise_stddev = noise = None
        experts, weights, aux_loss, stats = noisy_topk_routing(
            clean, raw_noise_stddev, noise, k, self.w_importance, self.w_load, self.noise_epsilon, mask
        )
        return Routing(experts=experts, weights=weights, num_experts=self.num_experts, aux_loss=aux_loss, stats=stats)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.k}, noisy={self.noisy}, "
            f"w_importance={self.w_importance}, w_load={self.w_load}"
        )
