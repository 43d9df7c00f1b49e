"""DSelect-k gate (Hazimeh et al. 2021, 003_a1a58754fcb6a991.txt): static (Section 3.1) and
per-example (Section 3.2), on the fused op moe_kernels.ops.dselect_k."""

from __future__ import annotations

import math

import torch
from torch import nn

from moe_kernels.ops import dselect_k
from moe_kernels.ops.smooth_step import check_gamma
from moe_kernels.reference.dselect_k import num_bits
from moe_kernels.routing import Routing


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """h(p) = -sum p log p over the last dim, 0 log 0 = 0, with a finite gradient at p = 0
    (the clamp): torch.special.entr's gradient is infinite there, and inf * S'(z) = inf * 0 = NaN
    once S(Z) is binary."""
    return -(p * p.clamp_min(1e-30).log()).sum(-1)


class DSelectKGate(nn.Module):
    """DSelect-k: gates = sum_i softmax(alpha)_i r(S(z_i)) (eq 6), at most k experts once S(Z) is
    binary.

    Args:
      num_experts: n >= 1 (any n: selectors have 2^m >= n entries, m = ceil(log2 n), Appendix B.2).
      k: number of selectors, >= 1 (the gate picks at most k experts; k > n is allowed).
      gamma: smooth-step width (Section 3.1.3).
      input_dim: None for the static gate (alpha [k] and Z [k, m] are parameters, Section 3.1);
        d for the per-example gate (alpha = G x + b, z_i = W_i x + c_i, Section 3.2).
      entropy_weight: lambda of the entropy regulariser Omega = sum_i h(r(S(z_i))) (Section 3.1.3;
        per example: averaged over the tokens).
      non_expert_weight: beta of the Appendix B.2 penalty (only when n < 2^m): beta times the
        selector mass on the 2^m - n entries that are not experts, summed over selectors (per
        example: averaged over tokens). It is the paper's "-beta sum_{i<=n} r(z)_i" plus the
        constant beta k, so it has the same gradient and is 0 when no mass is lost.
      z_init: Z is initialised uniformly in (-z_init * gamma / 2, z_init * gamma / 2) (static),
        and the per-example W so that z has about that spread for unit-variance inputs; with
        0 < z_init < 1, 0 < S(Z) < 1 at initialisation (Section 3.1.3, "Initialization").

    forward(x [T, d], mask=None [T] bool, True = real token) -> Routing with weights in x's dtype.
    Routing width: every expert with a nonzero gate value (ordered by weight, ties to the lower
    expert, padded with -1 / 0): at most k once converged, so the layer then evaluates only the
    selected experts; up to n before. stats: "converged" ([T] bool, S(z) binary for the token),
    "experts_per_token" (mean nonzeros), "non_expert_mass" (mean selector mass past n, the weight
    those tokens lose: never silently: it is reported here).
    """

    def __init__(
        self,
        num_experts: int,
        k: int,
        gamma: float = 1.0,
        input_dim: int | None = None,
        entropy_weight: float = 0.0,
        non_expert_weight: float = 1.0,
        z_init: float = 0.5,
    ):
        super().__init__()
        for name, value in (("num_experts", num_experts), ("k", k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if input_dim is not None and (isinstance(input_dim, bool) or not isinstance(input_dim, int) or input_dim < 1):
            raise ValueError(f"input_dim must be None (static gate) or an int >= 1, got {input_dim!r}")
        for name, value in (("entropy_weight", entropy_weight), ("non_expert_weight", non_expert_weight)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"{name} must be a float >= 0, got {value!r}")
        if not isinstance(z_init, (int, float)) or not 0 < z_init < 1:
            raise ValueError(f"z_init must be in (0, 1) so that 0 < S(Z) < 1 at initialisation, got {z_init!r}")
        self.num_experts, self.k, self.gamma = num_experts, k, check_gamma(gamma)
        self.input_dim, self.m = input_dim, num_bits(num_experts)
        self.entropy_weight, self.non_expert_weight = float(entropy_weight), float(non_expert_weight)
        bound = z_init * self.gamma / 2
        if input_dim is None:
            self.alpha = nn.Parameter(torch.zeros(k))
            self.z = nn.Parameter(torch.empty(k, self.m).uniform_(-bound, bound))
        else:
            self.alpha_proj = nn.Linear(input_dim, k)  # G x + b
            self.z_proj = nn.Linear(input_dim, k * self.m)  # [W_1; ...; W_k] x + c
            nn.init.normal_(self.alpha_proj.weight, std=0.02)
            nn.init.zeros_(self.alpha_proj.bias)
            # std of W x for unit-variance x: bound / sqrt(3) (that of U(-bound, bound)).
            nn.init.uniform_(self.z_proj.weight, -bound / math.sqrt(input_dim), bound / math.sqrt(input_dim))
            nn.init.zeros_(self.z_proj.bias)

    @property
    def static(self) -> bool:
        return self.input_dim is None

    def parameters_for(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha, z): [k], [k, m] for the static gate; [T, k], [T, k, m] per example."""
        if self.static:
            return self.alpha, self.z
        return self.alpha_proj(x), self.z_proj(x).view(x.shape[0], self.k, self.m)

    def _check_input(self, x, mask):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or (not self.static and x.shape[1] != self.input_dim):
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            want = "[T, d]" if self.static else f"[T, input_dim = {self.input_dim}]"
            raise ValueError(f"x must be {want}, got {shape}")
        if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (x.shape[0],)):
            raise ValueError(f"mask must be [T] = [{x.shape[0]}]")

    def gates(self, x: torch.Tensor | None = None, return_selectors: bool = False):
        """The gate values: [n] (static, x unused) or [T, n]; optionally the selectors [.., k, 2^m]."""
        alpha, z = self.parameters_for(x)
        # The fused op takes alpha and z in one dtype: the parameters' (float32 normally).
        return dselect_k(alpha, z.to(alpha.dtype), self.num_experts, self.gamma, return_selectors=return_selectors)

    def binary(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """S(Z) binary: a bool (0-dim tensor) for the static gate, [T] bool per example."""
        _, z = self.parameters_for(x)
        half = self.gamma / 2
        done = ((z <= -half) | (z >= half)).flatten(-2) if z.dim() == 3 else (z <= -half) | (z >= half)
        return done.all(-1) if z.dim() == 3 else done.all()

    def is_converged(self, x: torch.Tensor | None = None):
        """The converged flag: True when S(Z) is binary (static), so the gate selects at most k
        experts from now on (S'(Z) = 0: Z no longer moves). Per example: [T] bool for x."""
        with torch.no_grad():
            done = self.binary(x)
        return bool(done) if self.static else done

    @torch.no_grad()
    def selected_experts(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """Expert picked by each selector: argmax_l r(S(z_i))_l (ties to the lower l), -1 when it is
        one of the 2^m - n entries that are not experts. [k] (static) or [T, k] int64. Exact once
        converged (each selector is one-hot); before that, each selector's most likely expert."""
        _, selectors = self.gates(x, return_selectors=True)
        picked = selectors.argmax(-1)  # torch.argmax returns the first maximal index
        return torch.where(picked < self.num_experts, picked, -1)

    def regulariser(self, selectors: torch.Tensor) -> torch.Tensor:
        """lambda * sum_i h(r_i) + beta * sum_i (1 - sum_{l<n} r_il), per token [..] (static: 0-dim)."""
        total = self.entropy_weight * _entropy(selectors.float()).sum(-1)
        if self.num_experts < selectors.shape[-1] and self.non_expert_weight > 0:
            lost = selectors.float()[..., self.num_experts :].sum(-1)  # mass past n, = 1 - sum_{l<n} r_l
            total = total + self.non_expert_weight * lost.sum(-1)
        return total

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        self._check_input(x, mask)
        T, n = x.shape[0], self.num_experts
        gates, selectors = self.gates(None if self.static else x, return_selectors=True)
        reg = self.regulariser(selectors)
        lost = selectors.detach().float()[..., n:].sum(-1).mean(-1)
        if self.static:
            gates = gates.expand(T, n)
            aux_loss = reg
            converged = torch.full((T,), self.is_converged(), dtype=torch.bool, device=x.device)
            lost = lost.expand(T)
        else:
            aux_loss = (reg * mask).sum() / mask.sum().clamp_min(1) if mask is not None else reg.mean()
            if T == 0:
                aux_loss = reg.sum()
            converged = self.is_converged(x)
        if mask is not None:
            gates = torch.where(mask[:, None], gates, 0.0)
        # Routing width: the most nonzero gate values any token has (a host sync: the layer's
        # shapes depend on it). Stable descending sort: equal weights go to the lower expert.
        nonzero = gates.detach() != 0
        width = max(1, int(nonzero.sum(-1).max())) if T else min(self.k, n)
        order = torch.sort(gates.detach(), dim=-1, descending=True, stable=True).indices[:, :width]
        weights = gates.gather(1, order)
        keep = weights.detach() != 0
        experts = torch.where(keep, order, -1)
        weights = torch.where(keep, weights, 0.0).to(x.dtype)
        stats = {
            "converged": converged,
            "experts_per_token": nonzero.sum(-1).float().mean() if T else torch.zeros(()),
            "non_expert_mass": lost.mean() if T else torch.zeros(()),
        }
        return Routing(experts=experts, weights=weights, num_experts=n, aux_loss=aux_loss, stats=stats)

    def extra_repr(self) -> str:
        kind = "static" if self.static else f"per-example, input_dim={self.input_dim}"
        return f"num_experts={self.num_experts}, k={self.k}, gamma={self.gamma}, {kind}"
