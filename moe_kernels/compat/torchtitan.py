"""torchtitan's token-choice router with its own interface, computed with our ops.

From torchtitan/models/common/moe.py of pytorch/torchtitan at commit
b5bcd76c66d0acb1a08b176d9639425bc55e0b2a (2026-08-21): `TokenChoiceTopKRouter(config)`, its
`Config` dataclass (the same fields and defaults), `forward(x_TD, expert_bias_E=None) ->
(topk_scores_TK, topk_expert_ids_TK, scores_TE)`, and the parameter names of its state dict
(`gate.weight`). At that commit the load-balance bookkeeping (tokens per expert, the expert bias
buffer) lives in torchtitan's `MoE`, not in the router.

The selection and the top-k scores come from `topk_router`. torchtitan's `torch.topk(...,
sorted=False)` returns the experts in an unspecified order and leaves ties unspecified; ours are
by descending choice value, equal values to the lower expert index.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from moe_kernels.ops import topk_router

__all__ = ["Linear", "TokenChoiceTopKRouter"]


class Linear(nn.Linear):
    """torchtitan's configurable `Linear` (torchtitan/models/common/linear.py): an nn.Linear
    built from `Linear.Config(in_features=..., out_features=..., bias=False)`, so that router
    configs can be written without torchtitan. torchtitan's own `Linear.Config` works as well."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        in_features: int
        out_features: int
        bias: bool = False
        param_init: dict | None = None
        sharding_config: Any = None

        def build(self):
            return Linear(dataclasses.replace(self))

    def __init__(self, config: "Linear.Config"):
        super().__init__(config.in_features, config.out_features, bias=config.bias)


class TokenChoiceTopKRouter(nn.Module):
    """Token-choice top-k routing, optionally limited to the best groups of experts.

    Construct with `TokenChoiceTopKRouter(TokenChoiceTopKRouter.Config(...))` or
    `TokenChoiceTopKRouter.Config(...).build()`; torchtitan's own Config works too (read by
    attribute).

    Config fields (torchtitan's names and defaults):
      num_experts: E. gate: a config whose build() gives the [.., D] -> [.., E] gate module
        (`Linear.Config(in_features=D, out_features=E)`).
      num_expert_groups: None or the number of contiguous expert groups (divides E, >= 2 experts
        per group); num_limited_groups: the groups each token may use, by the sum of their two
        largest choice values (required with num_expert_groups).
      top_k: experts per token (1). score_func: "sigmoid" (default) or "softmax".
      route_norm: divide the top-k scores by their sum. route_scale: multiply them (1.0).
      _debug_force_load_balance: round-robin experts (token t, choice s -> (t k + s) mod E).

    forward(x_TD [T, D], expert_bias_E=None [E]) -> (
      topk_scores_TK [T, K] in the scores' dtype: the selected scores (never the bias),
        renormalised if route_norm, times route_scale;
      topk_expert_ids_TK [T, K] int64, by descending choice value (scores + bias), ties to the
        lower expert index;
      scores_TE [T, E]: sigmoid or softmax of the gate's output).
    The gate runs under torchtitan's float32 autocast (which torch disables on CPU, for
    torchtitan too). Differentiable in x and the gate's parameters; expert_bias_E
    gets no gradient.
    """

    @dataclass(kw_only=True, slots=True)
    class Config:
        num_experts: int
        gate: Any
        num_expert_groups: int | None = None
        num_limited_groups: int | None = None
        top_k: int = 1
        score_func: Literal["softmax", "sigmoid"] = "sigmoid"
        route_norm: bool = False
        route_scale: float = 1.0
        _debug_force_load_balance: bool = False
        param_init: dict | None = None
        sharding_config: Any = None

        def build(self):
            return TokenChoiceTopKRouter(dataclasses.replace(self))

    def __init__(self, config: "TokenChoiceTopKRouter.Config"):
        super().__init__()
        self.gate = config.gate.build()
        self.num_experts = config.num_experts
        self.num_expert_groups = config.num_expert_groups
        self.num_limited_groups = config.num_limited_groups
        self.top_k = config.top_k
        self.score_func = config.score_func
        self.route_norm = config.route_norm
        self.route_scale = config.route_scale
        self._debug_force_load_balance = config._debug_force_load_balance
        self._check_config()

    def _check_config(self):
        E = self.num_experts
        if isinstance(E, bool) or not isinstance(E, int) or E < 1:
            raise ValueError(f"num_experts must be an int >= 1, got {E!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 1 <= self.top_k <= E:
            raise ValueError(f"top_k must be an int in [1, num_experts = {E}], got {self.top_k!r}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise NotImplementedError(f"Unknown score function {self.score_func}")
        groups = self.num_expert_groups
        if groups is None:
            return
        # torchtitan checks these at the first forward; the same errors, at construction.
        if self.num_limited_groups is None:
            raise ValueError("num_limited_groups must be set when num_expert_groups is set")
        if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= E or E % groups:
            raise ValueError(f"num_experts ({E}) must be divisible by num_expert_groups ({groups})")
        if E // groups < 2:
            raise ValueError(f"experts_per_group ({E // groups}) must be >= 2")
        limited = self.num_limited_groups
        if isinstance(limited, bool) or not isinstance(limited, int) or not 1 <= limited <= groups:
            raise ValueError(f"num_limited_groups must be an int in [1, num_expert_groups = {groups}], got {limited!r}")
        if self.top_k > limited * (E // groups):
            raise ValueError(
                f"top_k ({self.top_k}) must be <= num_limited_groups * experts_per_group = {limited * (E // groups)}"
            )

    def forward(self, x_TD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        D = getattr(self.gate, "in_features", None)  # known for a Linear gate
        if not isinstance(x_TD, torch.Tensor) or x_TD.dim() != 2 or (D is not None and x_TD.shape[1] != D):
            shape = tuple(x_TD.shape) if isinstance(x_TD, torch.Tensor) else type(x_TD).__name__
            want = "[T, D]" if D is None else f"[T, D] with D = {D} (the gate's in_features)"
            raise ValueError(f"x_TD must be {want}, got {shape}")
        # torchtitan's float32 autocast. torch disables a float32 autocast on CPU with a warning
        # at every call; enabled=False there is the same context without the warning.
        device = x_TD.device.type
        with torch.autocast(device_type=device, dtype=torch.float32, enabled=device != "cpu"):
            logits_TE = self.gate(x_TD)
        if logits_TE.dim() != 2 or logits_TE.shape[1] != self.num_experts:
            raise ValueError(f"the gate must give [T, num_experts = {self.num_experts}], got {tuple(logits_TE.shape)}")
        if self.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
        else:
            scores_TE = F.softmax(logits_TE, dim=-1)
        if self._debug_force_load_balance:
            return (*self._round_robin(scores_TE), scores_TE)
        groups = {}
        if self.num_expert_groups is not None:
            groups = {"num_groups": self.num_expert_groups, "topk_groups": self.num_limited_groups}
        weights_TK, experts_TK = topk_router(
            logits_TE,
            self.top_k,
            scoring=self.score_func,
            bias=expert_bias_E,
            group_scoring="top2_sum",
            renormalize=self.route_norm,
            scaling_factor=float(self.route_scale),
            **groups,
        )
        return weights_TK.to(scores_TE.dtype), experts_TK, scores_TE

    def _round_robin(self, scores_TE):
        """(topk_scores_TK, topk_expert_ids_TK) of the debug override: no routing decision to make."""
        T = scores_TE.shape[0]
        ids = torch.arange(T * self.top_k, device=scores_TE.device).view(T, self.top_k) % self.num_experts
        scores = scores_TE.gather(1, ids)
        if self.route_norm:
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        return scores * self.route_scale, ids
