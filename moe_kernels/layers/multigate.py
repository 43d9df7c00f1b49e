"""Multi-gate MoE (Hazimeh et al. 2021, 003_a1a58754fcb6a991.txt, Figure 1 right; Ma et al. 2018):
experts shared by every task, one gate per task, one output per task,
y_t = sum_i G_t(x)_i E_i(x). Each task's routing goes through MoE.route on the shared experts."""

from __future__ import annotations

import torch
from torch import nn

from moe_kernels.layers.moe import MoE, flatten_tokens


class _TaskGates(nn.Module):
    """Stands in MoE.gate for the shared-experts MoE: a MultiGateMoE routes with its task gates."""

    def forward(self, x, mask=None):
        raise RuntimeError("the shared experts of a MultiGateMoE are routed by its task gates: call the MultiGateMoE")


class MultiGateMoE(nn.Module):
    """y_t = sum_i G_t(x)_i E_i(x) for tasks t = 0..len(gates)-1, experts E_i shared.

    Args:
      d_model: d; num_experts: E; d_hidden: hidden size of the default experts.
      gates: one module per task, each mapping (x [T, d], mask=None) to a Routing over E experts:
        any gate type (TopKGate, NoisyTopKGate, DSelectKGate, ...), mixed freely.
      capacity_factor, eval_capacity_factor, min_capacity, experts, activation: as in MoE
        (the capacity is per task: each task's routing is dispatched on its own).

    forward(x [..., d], mask=None [...] bool) -> list of len(gates) tensors [..., d], task order.
    After a call, `aux_loss` is the sum of the task gates' auxiliary losses and `stats` is
    {"tasks": [MoE.stats of each task's routing], "load": [E] choices routed to each shared expert
    (before any capacity drop), summed over tasks}.

    Cost: each task's routing is dispatched separately, so a (token, expert) pair chosen by two
    tasks is evaluated twice (same FLOPs as one MoE per task with tied experts; the experts'
    parameters and gradients are shared). Evaluating each pair once is not done here.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        gates,
        d_hidden: int | None = None,
        capacity_factor: float | None = 1.25,
        eval_capacity_factor: float | None = None,
        min_capacity: int = 1,
        experts=None,
        activation=torch.nn.functional.relu,
    ):
        super().__init__()
        # A single gate module (not a ModuleList) is a mistake, not one task.
        gates = None if isinstance(gates, nn.Module) and not isinstance(gates, nn.ModuleList) else list(gates)
        if not gates or not all(isinstance(g, nn.Module) for g in gates):
            raise ValueError("gates must be a non-empty list of gate modules, one per task")
        for t, g in enumerate(gates):
            if getattr(g, "num_experts", num_experts) != num_experts:
                raise ValueError(f"gates[{t}] has {g.num_experts} experts, the layer {num_experts}")
        self.d_model, self.num_experts = d_model, num_experts
        self.gates = nn.ModuleList(gates)
        # The shared experts and the routing code (capacity / dropless / expert-choice) of MoE;
        # its own gate slot is unused.
        self.shared = MoE(
            d_model,
            num_experts,
            d_hidden,
            gate=_TaskGates(),
            capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor,
            min_capacity=min_capacity,
            experts=experts,
            activation=activation,
        )
        self.aux_loss = torch.zeros(())
        self.stats: dict = {}

    @property
    def num_tasks(self) -> int:
        return len(self.gates)

    @property
    def experts(self) -> nn.Module:
        """The shared experts (BatchedFFN or ModuleExperts)."""
        return self.shared.experts

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        lead, xf, mf = flatten_tokens(x, mask, self.d_model)
        outputs, task_stats, aux = [], [], []
        for gate in self.gates:
            routing = gate(xf) if mf is None else gate(xf, mask=mf)
            outputs.append(self.shared.route(xf, routing, mf).reshape(*lead, self.d_model))
            task_stats.append(self.shared.stats)
            aux.append(routing.aux_loss)
        self.aux_loss = sum(aux[1:], aux[0])
        self.stats = {"tasks": task_stats, "load": torch.stack([s["load"] for s in task_stats]).sum(0)}
        return outputs

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, num_tasks={self.num_tasks}"
