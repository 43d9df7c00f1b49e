"""The sparsely-gated Mixture-of-Experts layer, y = sum_i G(x)_i E_i(x) (Shazeer et al. 2017,
002_01a24e7ec3602eec.txt, eq 1), on the routing ops: gate -> Routing -> dispatch -> experts ->
combine. The layer dispatches by the Routing's layout, never by the gate's type.

With a torch.distributed process group (`group=`, or `MoE.shard(group)`), the experts are spread
over the group's ranks and tokens reach them by all-to-all (moe_kernels.parallel,
docs/expert_parallel.md); the gate is replicated."""

from __future__ import annotations

import copy
import math
import re

import torch
from torch import nn

from moe_kernels import losses
from moe_kernels.gates.noisy_topk import NoisyTopKGate
from moe_kernels.layers.experts import BatchedFFN, ModuleExperts
from moe_kernels.ops import _validate, capacity_for, capacity_positions, combine, dispatch, permute, unpermute
from moe_kernels.parallel import expert_parallel_route, gather_state_dict, local_experts, shard_experts
from moe_kernels.parallel.exchange import rank_and_world
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


def flatten_tokens(x: torch.Tensor, mask: torch.Tensor | None, d_model: int):
    """Check x [..., d_model] and mask [...] (bool, True = real token) and flatten them.

    Returns (leading shape, x as [T, d_model], mask as [T] bool or None). Shared by every layer.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != d_model:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be [..., d_model] with d_model = {d_model}, got {shape}")
    lead = x.shape[:-1]
    mf = None
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.shape != lead:
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask must have x's leading shape {tuple(lead)}, got {shape}")
        _validate.same_device(x=x, mask=mask)
        if mask.dtype != torch.bool and mask.numel() and _validate.on_host(mask):
            # A 0.5 would become True below. A host read, so only where the mask is a real CPU
            # tensor outside torch.compile; on the GPU any nonzero value is a real token.
            if not bool(((mask == 0) | (mask == 1)).all()):
                raise ValueError("mask must be bool or hold only 0 and 1 (1 = a real token)")
        mf = mask.reshape(-1).bool()
    return lead, x.reshape(-1, d_model), mf


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
      group: None = one process (all E experts here). A torch.distributed process group of W
        ranks = expert parallelism: E must be divisible by W (else ValueError) and this rank
        holds experts r*E/W .. (r+1)*E/W - 1 (a BatchedFFN of E/W experts; of a list `experts`,
        either all E modules, of which it keeps its E/W, or just its E/W). Every rank calls
        forward with its own tokens (their number may differ, may be 0) and runs the same
        backward. Capacity mode: C is agreed over the ranks (the max of each rank's
        capacity_for(T_r, ...)) and counts slots per expert per source rank, so with equal T_r
        a rank computes what this layer computes alone on its batch; dropless and expert-choice
        layouts exchange exactly the routed rows. The gate is replicated: initialise it
        identically on every rank (or build the model in one process and call `shard`) and sum
        its gradients over the ranks (moe_kernels.parallel.sync_replicated_grads).

    forward(x [..., d], mask=None [...] bool, True = real token) -> y [..., d]. Masked tokens go
    to no expert and get y = 0. A non-bool mask must hold only 0 and 1 (a ValueError otherwise,
    checked where it is a CPU tensor; on a GPU any nonzero value is a real token). After a call,
    `self.aux_loss` is the gate's auxiliary loss for the step and `self.stats` holds load [E],
    importance [E], cv_importance, cv_load, max_mean_load and dropped_fraction (of the routed
    choices; for expert-choice routing, of the tokens no expert picked), "capacity" (None when
    dropless) and "gate", the gate's own stats (for NoisyTopKGate, "load" there is the smooth
    Load(X) of eq 10). With a group, stats and aux_loss are this rank's (its tokens), capacity the
    agreed C.

    Expert parallelism from a single-process layer: `moe.shard(group)` (a sharded copy);
    checkpoints: `full_state_dict()` (every rank, the single-process layer's state dict) and
    `load_full_state_dict(sd)`.
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
        group=None,
    ):
        super().__init__()
        self.d_model, self.num_experts = d_model, num_experts
        self.group = group
        rank, world = (0, 1) if group is None else rank_and_world(group)
        num_local = local_experts(num_experts, world) if group is not None else num_experts
        for name, factor in (("capacity_factor", capacity_factor), ("eval_capacity_factor", eval_capacity_factor)):
            if factor is not None and not (math.isfinite(factor) and factor > 0):
                raise ValueError(f"{name} must be a finite number > 0 or None (dropless), got {factor}")
        _validate.integer("min_capacity", min_capacity, low=0)
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = capacity_factor if eval_capacity_factor is None else eval_capacity_factor
        self.min_capacity = min_capacity
        self.gate = NoisyTopKGate(d_model, num_experts, k) if gate is None else gate
        if getattr(self.gate, "num_experts", num_experts) != num_experts:
            raise ValueError(f"gate has {self.gate.num_experts} experts, the layer {num_experts}")
        if experts is None:
            if d_hidden is None:
                raise ValueError("d_hidden is required for the default experts")
            self.experts = BatchedFFN(num_local, d_model, d_hidden, activation)
        else:
            experts = list(experts)
            if group is not None and len(experts) == num_experts:  # all E given: keep this rank's
                experts = experts[rank * num_local : (rank + 1) * num_local]
            self.experts = ModuleExperts(experts)
            if self.experts.num_experts != num_local:
                local = "" if group is None else f" (or this rank's E/W = {num_local})"
                raise ValueError(f"experts has {self.experts.num_experts} modules, num_experts is {num_experts}{local}")
        self.aux_loss = torch.zeros(())
        self.stats: dict = {}

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        lead, xf, mf = flatten_tokens(x, mask, self.d_model)
        routing = self.gate(xf) if mf is None else self.gate(xf, mask=mf)
        y = self.route(xf, routing, mf)
        self.aux_loss = routing.aux_loss
        return y.reshape(*lead, self.d_model)

    def route(self, xf: torch.Tensor, routing: Routing, mask: torch.Tensor | None = None) -> torch.Tensor:
        """y [T, d] for tokens xf [T, d] routed by `routing`; sets self.stats."""
        if routing.num_experts != self.num_experts:
            raise ValueError(f"routing has {routing.num_experts} experts, the layer {self.num_experts}")
        if self.group is not None and routing.layout in ("topk", "expert_choice"):
            y, load, dropped, routed, capacity = self._expert_parallel(xf, routing, mask)
        elif routing.layout == "expert_choice":
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

    def _expert_parallel(self, xf, routing, mask):
        """The step over the group (expert_parallel_route): a "topk" layout in capacity or dropless
        mode as the layer is configured; an "expert_choice" layout through its token view
        (experts / weights [T, k]), dropless: the same y as the expert view, nothing to drop."""
        experts = routing.experts if mask is None else torch.where(mask[:, None], routing.experts, -1)
        token_view = Routing(experts, routing.weights.to(xf.dtype), self.num_experts, routing.aux_loss)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if routing.layout == "topk" and self.capacity_factor is not None:
            opts = {"capacity_factor": factor, "min_capacity": self.min_capacity}
        else:
            opts = {"dropless": True}
        y, st = expert_parallel_route(xf, token_view, self.experts, self.group, **opts)
        if routing.layout == "expert_choice":  # as _expert_choice: dropped = real tokens no expert picked
            real = torch.ones(xf.shape[0], dtype=torch.bool, device=xf.device) if mask is None else mask
            routed = real.sum()
            dropped = (((experts >= 0).sum(1) == 0) & real).sum()
            return y, st["counts"], dropped, routed, routing.expert_tokens.shape[1]
        return y, st["counts"], st["dropped"], (experts >= 0).sum(), st.get("capacity")

    # ------------------------------------------------------------ expert parallelism: build, save
    def shard(self, group) -> MoE:
        """An expert-parallel copy of this single-process layer for this rank of `group`: the gate
        and everything else replicated, the experts this rank owns (experts r*E/W .. (r+1)*E/W - 1).
        Every rank calls it on the same layer (same seed or same checkpoint); no collective."""
        if self.group is not None:
            raise ValueError("shard() takes a single-process MoE (group=None); this one is already sharded")
        if group is None:
            raise ValueError("shard() needs a torch.distributed process group")
        rank, world = rank_and_world(group)
        num_local = local_experts(self.num_experts, world)
        # The last step's aux_loss / stats may hold autograd graphs (not deep-copyable): fresh ones.
        sharded = copy.deepcopy(self, {id(self.aux_loss): torch.zeros(()), id(self.stats): {}})
        if isinstance(sharded.experts, BatchedFFN):
            for p in sharded.experts.parameters():
                p.data = shard_experts(p.data, group)
            sharded.experts.num_experts = num_local
        else:
            sharded.experts = ModuleExperts(list(sharded.experts.experts)[rank * num_local : (rank + 1) * num_local])
        sharded.group = group
        return sharded

    _MODULE_EXPERT_KEY = re.compile(r"^experts\.experts\.(\d+)\.(.*)$")

    def full_state_dict(self) -> dict:
        """The single-process layer's state dict, on every rank (every rank must call it: the
        experts are gathered with collectives). Save it on one rank; resume with
        `MoE(...).load_state_dict(sd)` then `shard(group)`, or `load_full_state_dict(sd)`.
        Module experts' entries come back on this rank's expert device."""
        sd = self.state_dict()
        if self.group is None:
            return sd
        if isinstance(self.experts, BatchedFFN):
            return gather_state_dict(sd, self.group, lambda name: name.startswith("experts."))
        rank, world = rank_and_world(self.group)
        num_local = self.experts.num_experts
        local = {n: t.detach().cpu() for n, t in sd.items() if self._MODULE_EXPERT_KEY.match(n)}
        every = [None] * world
        torch.distributed.all_gather_object(every, local, group=self.group)  # modules may differ in shape
        device = next(self.experts.parameters(), torch.zeros(())).device
        full = {n: t for n, t in sd.items() if not self._MODULE_EXPERT_KEY.match(n)}
        for q, entries in enumerate(every):
            for n, t in entries.items():
                i, rest = self._MODULE_EXPERT_KEY.match(n).groups()
                full[f"experts.experts.{q * num_local + int(i)}.{rest}"] = t.to(device)
        return full

    def load_full_state_dict(self, state_dict: dict, strict: bool = True):
        """Load a single-process (full) state dict into this layer, keeping this rank's experts."""
        if self.group is None:
            return self.load_state_dict(state_dict, strict=strict)
        rank, world = rank_and_world(self.group)
        num_local = local_experts(self.num_experts, world)
        local = {}
        for n, t in state_dict.items():
            m = self._MODULE_EXPERT_KEY.match(n)
            if isinstance(self.experts, ModuleExperts) and m:
                i = int(m.group(1)) - rank * num_local
                if 0 <= i < num_local:
                    local[f"experts.experts.{i}.{m.group(2)}"] = t
            elif isinstance(self.experts, BatchedFFN) and n.startswith("experts."):
                local[n] = t[rank * num_local : (rank + 1) * num_local]
            else:
                local[n] = t
        return self.load_state_dict(local, strict=strict)

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
