"""The sparsely-gated Mixture-of-Experts layer, y = sum_i G(x)_i E_i(x) (Shazeer et al. 2017,
002_01a24e7ec3602eec.txt, eq 1), on the routing ops: gate -> Routing -> dispatch -> experts ->
combine. The layer dispatches by the Routing's layout, never by the gate's type."""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels import losses
from moe_kernels.gates.noisy_topk import NoisyTopKGate
from moe_kernels.layers.experts import BatchedFFN, ModuleExperts
from moe_kernels.ops import capacity_for, capacity_positions, combine, dispatch, permute, unpermute
from moe_kernels.routing import Routing


def balance_stats(load: torch.Tensor, importance: torch.Tensor, dropped: torch.Tensor, routed: torch.Tensor) -> dict:
    """The numbers of Table 6 for one step, detached (no device sync: tensors, not floats).

    load [E]: choices routed to each expert (before any drop); importance [E]: sum of gate values
    per expert; dropped / routed: 0-dim counts.
    """
    load = load.detach().float()
    importance = importance.detach().float()
    return {
        "load": load,
        "importance": importance,
        "cv_importance": losses.cv_squared(importance).sqrt(),
        "cv_load": losses.cv_squared(load).sqrt(),
        "max_mean_load": load.max() / load.mean().clamp(min=1e-12) if load.numel() else load.new_zeros(()),
        "dropped_fraction": dropped.float() / routed.float().clamp(min=1),
    }


def run_sorted(experts_module, x_sorted: torch.Tensor, expert_offsets: torch.Tensor, num_experts: int):
    """Apply expert e to rows expert_offsets[e]:expert_offsets[e+1] of x_sorted [R, d] (permute's
    layout; rows after offsets[E] belong to empty choices and stay zero)."""
    bounds = expert_offsets.tolist()  # one host sync: the group sizes decide the matmul shapes
    pieces = [experts_module.forward_expert(e, x_sorted[bounds[e] : bounds[e + 1]]) for e in range(num_experts)]
    pieces.append(x_sorted.new_zeros(x_sorted.shape[0] - bounds[num_experts], x_sorted.shape[1]))
    return torch.cat([p.to(x_sorted.dtype) for p in pieces], dim=0)


class MoE(nn.Module):
    """A MoE layer: y = sum_i G(x)_i E_i(x) (eq 1).

    Args:
      d_model: d; num_experts: E; d_hidden: h, hidden size of the default experts.
      gate: a module mapping (x [T, d], mask=None) to a Routing; default NoisyTopKGate(d, E, k).
      k: experts per token of the default gate.
      capacity_factor: slots per expert C = ceil(capacity_factor * T * k / E) (choices beyond C
        are dropped and counted); None = dropless (permute / unpermute, no drops).
      eval_capacity_factor: capacity factor in eval mode (default: capacity_factor).
      min_capacity: lower bound of C.
      experts: None = batched FFN weights W1 [E, d, h], W2 [E, h, d] applied to the dispatch
        buffer with bmm; or a list of E modules mapping [n, d] -> [n, d].
      activation: the default experts' activation.

    forward(x [..., d], mask=None [...] bool, True = real token) -> y [..., d]. Masked tokens go
    to no expert and get y = 0. After a call, `self.aux_loss` is the gate's auxiliary loss for
    the step and `self.stats` holds load [E], importance [E], cv_importance, cv_load,
    max_mean_load and dropped_fraction (of the routed choices; for expert-choice routing, of the
    tokens no expert picked), "capacity" (None when dropless) and "gate", the gate's own stats
    (for NoisyTopKGate, "load" there is the smooth Load(X) of eq 10).
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        d_hidden: int | None = None,
        gate: nn.Module | None = None,
        k: int = 2,
        capacity_factor: float | None = 1.25,
        eval_capacity_factor: float | None = None,
        min_capacity: int = 1,
        experts=None,
        activation=torch.nn.functional.relu,
    ):
        super().__init__()
        self.d_model, self.num_experts = d_model, num_experts
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None (dropless), got {capacity_factor}")
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = capacity_factor if eval_capacity_factor is None else eval_capacity_factor
        self.min_capacity = min_capacity
        self.gate = NoisyTopKGate(d_model, num_experts, k) if gate is None else gate
        if getattr(self.gate, "num_experts", num_experts) != num_experts:
            raise ValueError(f"gate has {self.gate.num_experts} experts, the layer {num_experts}")
        if experts is None:
            if d_hidden is None:
                raise ValueError("d_hidden is required for the default experts")
            self.experts = BatchedFFN(num_experts, d_model, d_hidden, activation)
        else:
            self.experts = ModuleExperts(experts)
            if self.experts.num_experts != num_experts:
                raise ValueError(f"experts has {self.experts.num_experts} modules, num_experts is {num_experts}")
        self.aux_loss = torch.zeros(())
        self.stats: dict = {}

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.d_model:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must be [..., d_model] with d_model = {self.d_model}, got {shape}")
        lead = x.shape[:-1]
        xf = x.reshape(-1, self.d_model)
        mf = None
        if mask is not None:
            if mask.shape != lead:
                raise ValueError(f"mask must have x's leading shape {tuple(lead)}, got {tuple(mask.shape)}")
            mf = mask.reshape(-1).bool()
        routing = self.gate(xf) if mf is None else self.gate(xf, mask=mf)
        y = self.route(xf, routing, mf)
        self.aux_loss = routing.aux_loss
        return y.reshape(*lead, self.d_model)

    def route(self, xf: torch.Tensor, routing: Routing, mask: torch.Tensor | None = None) -> torch.Tensor:
        """y [T, d] for tokens xf [T, d] routed by `routing`; sets self.stats."""
        if routing.num_experts != self.num_experts:
            raise ValueError(f"routing has {routing.num_experts} experts, the layer {self.num_experts}")
        if routing.layout == "expert_choice":
            y, load, dropped, routed, capacity = self._expert_choice(xf, routing, mask)
        elif routing.layout == "topk":
            experts = routing.experts if mask is None else torch.where(mask[:, None], routing.experts, -1)
            if self.capacity_factor is None:
                y, load, dropped, routed, capacity = self._dropless(xf, experts, routing.weights)
            else:
                y, load, dropped, routed, capacity = self._capacity(xf, experts, routing.weights)
        else:
            raise ValueError(f"unknown Routing layout {routing.layout!r}; expected 'topk' or 'expert_choice'")
        importance = losses.importance(routing.experts, routing.weights, self.num_experts, mask)
        self.stats = {**balance_stats(load, importance, dropped, routed), "capacity": capacity, "gate": routing.stats}
        return y

    def _capacity(self, xf, experts, weights):
        T, k = experts.shape
        E = self.num_experts
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        C = capacity_for(T, E, k, factor, self.min_capacity)
        positions, counts = capacity_positions(experts, E, C)
        buffer = dispatch(xf, experts, positions, E, C)  # [E, C, d]
        y = combine(self.experts.forward_buffer(buffer), experts, positions, weights.to(xf.dtype))
        routed = (experts >= 0).sum()
        dropped = ((positions < 0) & (experts >= 0)).sum()
        return y, counts, dropped, routed, C

    def _dropless(self, xf, experts, weights):
        E = self.num_experts
        x_sorted, offsets, order = permute(xf, experts, E)
        y_sorted = run_sorted(self.experts, x_sorted, offsets, E)
        y = unpermute(y_sorted, order, weights.to(xf.dtype), xf.shape[0])
        routed = (experts >= 0).sum()
        return y, offsets.diff(), routed.new_zeros(()), routed, None

    def _expert_choice(self, xf, routing, mask):
        """Each expert e processes its tokens expert_tokens[e] [m] (-1 = empty slot)."""
        tokens, gate_weights = routing.expert_tokens, routing.expert_weights
        if tokens is None or gate_weights is None or tokens.dim() != 2 or tokens.shape[0] != self.num_experts:
            raise ValueError("an expert_choice Routing needs expert_tokens and expert_weights [E, m]")
        T, d = xf.shape
        valid = tokens >= 0
        safe = tokens.clamp(min=0)
        if mask is not None:
            valid = valid & mask[safe]
        buffer = torch.where(valid[..., None], xf[safe], 0.0)  # [E, m, d]
        out = self.experts.forward_buffer(buffer)
        acc = torch.float64 if xf.dtype == torch.float64 else torch.float32
        contrib = torch.where(valid[..., None], out.to(acc) * gate_weights.to(acc)[..., None], 0.0)
        y = torch.zeros(T, d, dtype=acc, device=xf.device).index_add(0, safe.reshape(-1), contrib.reshape(-1, d))
        covered = torch.zeros(T, dtype=torch.int64, device=xf.device).index_add(
            0, safe.reshape(-1), valid.reshape(-1).long()
        )
        real = torch.ones(T, dtype=torch.bool, device=xf.device) if mask is None else mask
        dropped = ((covered == 0) & real).sum()
        return y.to(xf.dtype), valid.sum(1), dropped, real.sum(), tokens.shape[1]
