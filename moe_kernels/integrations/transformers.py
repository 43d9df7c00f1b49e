"""Run the MoE blocks of Hugging Face transformers models on moe_kernels.

    from moe_kernels.integrations.transformers import apply_moe_kernels
    report = apply_moe_kernels(model)   # in place; report["patched"], report["skipped"]

Each router whose code is one of the router codes verified here (on transformers 5.23 to 5.24:
VERIFIED) gets a forward computing the same thing through `moe_kernels.ops.topk_router`, with the
same outputs, dtypes and return structure; the experts of the model switch to our experts
implementation ("moe_kernels", transformers_experts.py) through transformers' own experts
interface. Nothing is added, removed or renamed: parameters, buffers and `state_dict()` are
untouched, so saving, loading and `from_pretrained` keep working. `remove_moe_kernels(model)`
undoes it. A patched model pickles whole (torch.save, pickle, deepcopy) and loads still patched,
in a fresh process too: each router's method is a functools.partial of a module-level forward,
and the model holds a marker whose unpickling registers the experts implementation.

Recognition is by the router's code, not its name: a router class is patched only when the code of
its forward is exactly one of the codes below (several families share each code), compared by
code_key.py's key (its syntax tree without docstrings: a release that only reformats a router
keeps its key, any other change loses it). Anything else is left alone and reported with the
reason. docs/routers.md lists the families; `python -m moe_kernels.integrations.router_codes`
prints the key and the code of every router class in the installed transformers (router_codes.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_kernels.integrations import transformers_experts
from moe_kernels.integrations.code_key import code_key
from moe_kernels.ops import topk_router


@dataclass(frozen=True)
class RouterCode:
    """One verified router code: what it computes, and our forward for it."""

    name: str  # the family it was first written for
    families: str  # the model folders (transformers 5.23 and 5.24) with a router of exactly this code
    forward: Callable  # our forward, bound to the router (or block) instance
    method: str = "forward"  # the method replaced (DBRX routes in its block)
    applicable: Callable = lambda module: None  # None, or why this instance cannot be patched
    # CPU inference at fewer tokens than this runs few_forward, the routing in two torch ops,
    # cheaper than our op's call there (bench/bench_decode.py; docs/routers.md, "At a few
    # tokens"). 0: the op at every size (measured faster from T = 1, or not measured).
    few_tokens: int = 0
    few_forward: Callable | None = None


# The transformers releases whose router classes were checked against _CODES (every router class
# of every model folder, router_codes.py) and whose tiny models pass python_tests/integrations.
VERIFIED = "5.23 to 5.24"


def token_rows(hidden_states, module):
    """[..., hidden] hidden states as [T, hidden] token rows (T: every token of the batch)."""
    return hidden_states.reshape(-1, module.hidden_dim)


def tensor_of(module, name: str):
    """module.<name> for a parameter or buffer, read where nn.Module keeps it: its __getattr__,
    which such a read goes through, costs 0.6 us, a tenth of a router's call at one token. Anything
    else (a parametrized weight, a plain attribute, None) through getattr."""
    value = module._parameters.get(name)
    if value is None:
        value = module._buffers.get(name)
    return getattr(module, name) if value is None else value


def float32_weights(weights):
    """The weights of the routers that score `router_logits.float()` in transformers (Mixtral,
    MiniMax-M2, the MiniMax-M3-VL code): float32 in a float64 model too. The op ranks the float64
    logits, where transformers' float32 scores can only tie (a tie, broken to the lower index:
    docs/routers.md); ranking float32 scores would merge keys that a float64 bias separates in
    transformers."""
    return weights.float() if weights.dtype == torch.float64 else weights


def autocast_lowers(hidden_states) -> bool:
    """True under an autocast to a 16-bit type on hidden_states' device.

    F.linear then returns 16-bit logits even from float32 inputs. The float32-cast routers below
    (DeepSeek-V3's and its kin) then take transformers' own arithmetic: a sigmoid rounded to 16
    bits, a float32 bias added to it, 16-bit weights. That is not the op's (float32 throughout),
    so under such an autocast they call transformers' forward and stay exact (docs/routers.md,
    Fidelity)."""
    device = hidden_states.device.type
    return autocast_on(device) and torch.get_autocast_dtype(device) != torch.float32


def autocast_on(device: str) -> bool:
    """Whether autocast is enabled on `device` (a device type); False where autocast does not
    exist (meta tensors: no autocast to ask about)."""
    # torch 2.11's dynamo cannot trace torch.amp.is_autocast_available (a graph break, and
    # fullgraph fails); traced tensors are on real devices, whose autocast state it can read.
    if not torch.compiler.is_compiling() and not torch.amp.is_autocast_available(device):
        return False
    return torch.is_autocast_enabled(device)


# Softmax routers. With no bias the op ranks by the logits: the same experts as ranking the
# probabilities, except where distinct logits round to equal probabilities (docs/routers.md).


def _mixtral(self, hidden_states):
    router_logits = F.linear(token_rows(hidden_states, self), tensor_of(self, "weight"))
    weights, experts = topk_router(router_logits, self.top_k, renormalize=True)
    return router_logits, float32_weights(weights), experts


def _qwen2_moe(self, hidden_states):
    router_logits = F.linear(token_rows(hidden_states, self), tensor_of(self, "weight"))
    weights, experts = topk_router(router_logits, self.top_k, renormalize=bool(self.norm_topk_prob))
    return router_logits, weights.to(router_logits.dtype), experts


def _qwen3_5_moe(self, hidden_states):
    router_logits = F.linear(token_rows(hidden_states, self), tensor_of(self, "weight"))
    weights, experts = topk_router(router_logits, self.top_k, renormalize=True)
    return router_logits, weights.to(router_logits.dtype), experts


# At a few tokens (RouterCode.few_forward): each op's call costs more than its work there, so the
# cheapest torch sequence of the same routing runs instead, two ops after the linear where
# transformers' own takes four or five. Ties at the k-th place break as torch.topk breaks them.


def _mixtral_few(self, hidden_states):
    """The op's arithmetic (ranked by the logits; the softmax of the k chosen logits is the
    renormalised softmax at the top k) in torch.topk and a float32 softmax."""
    router_logits = F.linear(token_rows(hidden_states, self), tensor_of(self, "weight"))
    top, experts = torch.topk(router_logits, self.top_k, dim=-1)
    return router_logits, torch.softmax(top, dim=-1, dtype=torch.float32), experts


def _qwen2_moe_few(self, hidden_states):
    """As _mixtral_few with norm_topk_prob; without it, transformers' own sequence (the softmax
    over all experts, then its top k), less the division it skips."""
    router_logits = F.linear(token_rows(hidden_states, self), tensor_of(self, "weight"))
    if self.norm_topk_prob:
        top, experts = torch.topk(router_logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1, dtype=torch.float32)
    else:
        weights, experts = torch.topk(torch.softmax(router_logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
    return router_logits, weights.to(router_logits.dtype), experts


def _gpt_oss_few(self, hidden_states):
    """transformers' own GPT-OSS routing, already two ops after the linear (the same ops: the same
    bits), with its parameters read as tensor_of reads them."""
    router_logits = F.linear(hidden_states, tensor_of(self, "weight"), tensor_of(self, "bias"))
    top, experts = torch.topk(router_logits, self.top_k, dim=-1)
    return router_logits, F.softmax(top, dim=1, dtype=top.dtype), experts


def _granitemoe(self, hidden_states):
    router_logits = F.linear(hidden_states, tensor_of(self, "weight")).float()
    # softmax over the top-k logits == the renormalised full softmax at the top k
    weights, experts = topk_router(router_logits, self.top_k, renormalize=True)
    return router_logits, weights.type_as(hidden_states), experts


def _gemma4(self, hidden_states):
    hidden_states = self.norm(hidden_states) * self.scale * self.scalar_root_size
    router_logits = self.proj(hidden_states)
    # The full float32 probabilities are part of the router's output (transformers returns them);
    # the selection and the renormalised weights are topk_router's, then the per-expert scale.
    probabilities = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = topk_router(router_logits, self.config.top_k_experts, renormalize=True)
    return probabilities, weights * self.per_expert_scale[experts], experts


def _jamba(self, hidden_states):
    router_logits = F.linear(hidden_states, tensor_of(self, "weight"))
    weights, experts = topk_router(router_logits, self.top_k)
    return router_logits, weights.to(hidden_states.dtype), experts


def _gpt_oss(self, hidden_states):
    router_logits = F.linear(hidden_states, tensor_of(self, "weight"), tensor_of(self, "bias"))
    weights, experts = topk_router(router_logits, self.top_k, renormalize=True)
    return router_logits, weights.to(router_logits.dtype), experts


def _deepseek_v2(self, hidden_states):
    router_logits = F.linear(
        token_rows(hidden_states, self).type(torch.float32), tensor_of(self, "weight").type(torch.float32)
    )
    groups = {}
    if self.topk_method == "group_limited_greedy":
        groups = dict(num_groups=self.num_group, topk_groups=self.topk_group, group_scoring="max")
    weights, experts = topk_router(
        router_logits, self.top_k, scaling_factor=float(self.routed_scaling_factor), **groups
    )
    return router_logits, weights, experts


def _deepseek_v2_applicable(module):
    if module.topk_method not in ("greedy", "group_limited_greedy"):
        return f"topk_method {module.topk_method!r} is neither 'greedy' nor 'group_limited_greedy'"
    return None


def _ernie4_5_moe(self, hidden_states):
    device = hidden_states.device.type
    off = autocast_on(device)
    # float32, as transformers (its maybe_autocast: no context on meta, or with autocast off)
    with torch.autocast(device_type=device, enabled=False) if off else contextlib.nullcontext():
        router_logits = F.linear(hidden_states.float(), tensor_of(self, "weight").float())
        bias = self.moe_statics.e_score_correction_bias.reshape(-1)
        weights, experts = topk_router(router_logits, self.top_k, bias=bias, renormalize=True)
    return router_logits, weights.to(hidden_states.dtype), experts


def _ernie_applicable(module):
    if module.moe_statics.e_score_correction_bias.numel() != module.weight.shape[0]:
        return "more than one group of correction biases"
    return None


def _dbrx_route(self, router_logits):
    # softmax in the logits' dtype, top k, L1 normalisation (p = 1) or none
    weights, experts = topk_router(router_logits, self.top_k, renormalize=self.moe_normalize_expert_weights is not None)
    return weights.to(router_logits.dtype), experts


def _dbrx_applicable(module):
    if module.moe_normalize_expert_weights not in (None, 1, 1.0):
        return f"moe_normalize_expert_weights = {module.moe_normalize_expert_weights} (only the L1 norm, p = 1, maps)"
    return None


def _aria(self, hidden_states):
    router_logits = F.linear(hidden_states, tensor_of(self, "weight"))
    # softmax over the top-k logits == the renormalised full softmax at the top k
    weights, experts = topk_router(router_logits, self.top_k, renormalize=True)
    return router_logits, weights.to(router_logits.dtype), experts


def _cohere2_moe(self, hidden_states):
    router_logits = F.linear(hidden_states, tensor_of(self, "weight"))
    # Cohere ranks the logits for both scorings; softmax is taken over the top k only (renormalised).
    renormalize = self.expert_selection_fn == "softmax" or bool(self.norm_topk_prob)
    weights, experts = topk_router(router_logits, self.top_k, scoring=self.expert_selection_fn, renormalize=renormalize)
    return router_logits, weights.to(hidden_states.dtype), experts


def _cohere2_moe_applicable(module):
    if module.expert_selection_fn not in ("softmax", "sigmoid"):
        return f"expert_selection_fn {module.expert_selection_fn!r} is neither 'softmax' nor 'sigmoid'"
    return None


def _hunyuan_v1_moe(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])
    if self.wg.weight.dtype == torch.float32:
        hidden_states = hidden_states.float()
    router_logits = self.wg(hidden_states)
    weights, experts = topk_router(router_logits, self.top_k, renormalize=True)
    return router_logits, weights.to(router_logits.dtype), experts


def _mistral4(self, hidden_states):
    # transformers takes this softmax in the logits' dtype; the op's is float32 (same in float32)
    router_logits = F.linear(hidden_states.view(-1, self.hidden_dim), tensor_of(self, "weight"))
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        num_groups=self.num_group,
        topk_groups=self.topk_group,
        renormalize=bool(self.norm_topk_prob),
        scaling_factor=float(self.routed_scaling_factor),
    )
    return router_logits, weights.to(router_logits.dtype), experts


def _mistral_large4(self, hidden_states):
    if autocast_lowers(hidden_states):
        return type(self).forward(self, hidden_states)
    router_logits = F.linear(hidden_states.view(-1, self.hidden_dim).float(), tensor_of(self, "weight").float())
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        num_groups=self.num_group,
        topk_groups=self.topk_group,
        renormalize=True,
        scaling_factor=float(self.routed_scaling_factor),
    )
    return router_logits, weights, experts


def _groups_applicable(module):
    # With fewer than k eligible experts transformers picks masked ones (filled with 0.0 or -inf);
    # topk_router never selects an ineligible expert and refuses such a k.
    if module.num_group is None or module.topk_group is None:
        return "n_group or topk_group is None"
    if module.num_experts % module.num_group:
        return f"n_group {module.num_group} does not divide the {module.num_experts} experts"
    eligible = module.topk_group * (module.num_experts // module.num_group)
    if module.top_k > eligible:
        return f"top_k {module.top_k} > the {eligible} experts of topk_group {module.topk_group} groups"
    return None


def _openai_privacy_filter(self, hidden_states):
    if autocast_lowers(hidden_states):
        return type(self).forward(self, hidden_states)
    router_logits = F.linear(hidden_states.float(), tensor_of(self, "weight").float(), tensor_of(self, "bias").float())
    weights, experts = topk_router(router_logits, self.top_k, renormalize=True, scaling_factor=1.0 / self.top_k)
    return router_logits, weights, experts


def _zaya(self, hidden_states, router_states=None):
    seq_length = hidden_states.shape[1]
    router_hidden_states = self.down_proj(hidden_states)
    if self.use_eda and router_states is not None:  # the previous layer's router state
        router_hidden_states = router_hidden_states + router_states * self.router_states_scale
    router_hidden_states_next = router_hidden_states[:, -seq_length:].clone()
    router_logits = self.router_mlp(router_hidden_states).reshape(-1, self.num_router_classes)
    weights, experts = topk_router(router_logits, self.top_k, bias=self.balancing_biases)
    # The last class is the skip expert (no compute): transformers gives it weight 0 on expert 0.
    skip = experts == self.num_experts
    weights = weights.to(router_logits.dtype).masked_fill(skip, 0)
    return router_logits, weights, experts.masked_fill(skip, 0), router_hidden_states_next


def _jetmoe(self, hidden_states):
    logits = self.layer(hidden_states).float()
    # softmax over the top-k logits == the renormalised full softmax at the top k
    weights, experts = topk_router(logits, self.top_k, renormalize=True)
    # JetMoE's dispatch plan: the T k (token, expert) pairs grouped by expert, with the count per
    # expert. Within an expert any order is valid (transformers' unstable sort leaves it open).
    pairs = experts.flatten()
    index_sorted_experts = pairs.argsort(stable=True)
    batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
    batch_gates = weights.type_as(hidden_states).flatten()[index_sorted_experts]
    expert_size = torch.bincount(pairs, minlength=self.num_experts).tolist()
    return index_sorted_experts, batch_index, batch_gates, expert_size, logits


def _longcat_flash(self, hidden_states):
    if autocast_lowers(hidden_states):
        return type(self).forward(self, hidden_states)
    # the classifier's weight only (transformers ignores its bias here too)
    router_logits = F.linear(token_rows(hidden_states, self).float(), self.classifier.weight.float())
    # The indices past n_routed_experts are its zero-computation experts, handled by its block.
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        bias=tensor_of(self, "e_score_correction_bias"),
        scaling_factor=float(self.routed_scaling_factor),
    )
    return router_logits, weights.to(router_logits.dtype), experts


# Sigmoid routers.


def _deepseek_v3(self, hidden_states):
    if autocast_lowers(hidden_states):
        return type(self).forward(self, hidden_states)
    router_logits = F.linear(
        hidden_states.view(-1, self.hidden_dim).type(torch.float32), tensor_of(self, "weight").type(torch.float32)
    )
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        scoring="sigmoid",
        bias=tensor_of(self, "e_score_correction_bias"),
        num_groups=self.num_group,
        topk_groups=self.topk_group,
        renormalize=bool(self.norm_topk_prob),
        scaling_factor=float(self.routed_scaling_factor),
    )
    return router_logits, weights, experts


def _minimax_m2(self, hidden_states, e_score_correction_bias):
    weight = tensor_of(self, "weight")
    router_logits = F.linear(token_rows(hidden_states, self).to(weight.dtype), weight)
    weights, experts = topk_router(
        router_logits, self.top_k, scoring="sigmoid", bias=e_score_correction_bias, renormalize=True
    )
    return router_logits, float32_weights(weights), experts


def _hy_v3(self, hidden_states, e_score_correction_bias):
    router_logits = F.linear(token_rows(hidden_states, self).float(), tensor_of(self, "weight").float())
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        scoring="sigmoid",
        bias=e_score_correction_bias,
        renormalize=True,
        scaling_factor=float(self.router_scaling_factor),
    )
    return router_logits, weights, experts


def _afmoe(self, hidden_states, expert_bias):
    router_logits = self.gate(hidden_states.view(-1, hidden_states.shape[-1])).to(torch.float32)
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        scoring="sigmoid",
        bias=expert_bias,
        renormalize=True,
        scaling_factor=float(self.route_scale),
    )
    return router_logits, weights, experts


def _lfm2_moe(self, hidden_states, expert_bias=None):
    router_logits = F.linear(hidden_states, tensor_of(self, "weight"))
    bias = expert_bias if self.use_expert_bias else None
    if bias is not None and router_logits.dtype != torch.float32:
        # LFM2 rounds the sigmoid to the logits' 16-bit type before it adds the (float32) bias;
        # the op would add to the float32 sigmoid and pick other experts on ~1% of rows. So the
        # key is transformers' own; with no bias and no groups the op ranks its input exactly.
        scores = router_logits.sigmoid()
        _, experts = topk_router(scores + bias, self.top_k, scoring="sigmoid")
        weights = scores.gather(1, experts)
    else:
        weights, experts = topk_router(router_logits, self.top_k, scoring="sigmoid", bias=bias)
        weights = weights.to(router_logits.dtype)
    if self.norm_topk_prob:  # its own epsilon, kept exactly
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-6)
    return router_logits, weights * self.routed_scaling_factor, experts


def _llama4(self, hidden_states):
    router_logits = F.linear(hidden_states, tensor_of(self, "weight"), tensor_of(self, "bias"))
    weights, experts = topk_router(router_logits, self.top_k, scoring="sigmoid")
    # Llama 4 returns dense scores: sigmoid of the selected logits, sigmoid(-inf) = 0 elsewhere.
    router_scores = torch.zeros_like(router_logits).scatter_(1, experts, weights.to(router_logits.dtype))
    return router_scores, router_logits


def _flint(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):  # float32, as transformers
        router_logits = F.linear(hidden_states.float(), tensor_of(self, "weight").float())
    weights, experts = topk_router(router_logits, self.top_k, scoring="sigmoid", renormalize=bool(self.norm_topk_prob))
    return router_logits, weights, experts


def _laguna(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, tensor_of(self, "weight")).float()
    if self.router_logit_softcapping > 0.0:  # the capped logits are the router's logits
        cap = self.router_logit_softcapping
        router_logits = torch.tanh(router_logits / cap) * cap
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        scoring="sigmoid",
        bias=tensor_of(self, "e_score_correction_bias").float(),
        renormalize=True,
    )
    return router_logits, weights.to(hidden_states.dtype), experts


def _minimax_m3_vl(self, hidden_states):
    weight = tensor_of(self, "weight")
    router_logits = F.linear(token_rows(hidden_states, self).to(weight.dtype), weight)
    weights, experts = topk_router(
        router_logits, self.top_k, scoring="sigmoid", bias=tensor_of(self, "e_score_correction_bias"), renormalize=True
    )
    return router_logits, float32_weights(weights), experts


def _axk2(self, hidden_states):
    if autocast_lowers(hidden_states):
        return type(self).forward(self, hidden_states)
    router_logits = F.linear(token_rows(hidden_states, self).float(), tensor_of(self, "weight").float())
    groups = {}
    if self.num_group is not None:  # the light checkpoints route without groups
        groups = dict(num_groups=self.num_group, topk_groups=self.topk_group)
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        scoring="sigmoid",
        bias=tensor_of(self, "e_score_correction_bias"),
        renormalize=bool(self.norm_topk_prob),
        scaling_factor=float(self.routed_scaling_factor),
        **groups,
    )
    return router_logits, weights, experts


def _axk2_applicable(module):
    return None if module.num_group is None else _groups_applicable(module)


def _beam(self, hidden_states):
    if autocast_lowers(hidden_states):
        return type(self).forward(self, hidden_states)
    router_logits = F.linear(token_rows(hidden_states, self).float(), tensor_of(self, "weight").float())
    # Beam scales by routed_scaling_factor after the experts, in its block.
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        scoring="sigmoid",
        bias=tensor_of(self, "e_score_correction_bias"),
        num_groups=self.num_group,
        topk_groups=self.topk_group,
        renormalize=bool(self.norm_topk_prob),
    )
    return router_logits, weights, experts


def _inkling2(self, hidden_states):
    if autocast_lowers(hidden_states):
        return type(self).forward(self, hidden_states)
    router_logits = F.linear(token_rows(hidden_states.float(), self), tensor_of(self, "weight"))
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        scoring="sigmoid",
        bias=tensor_of(self, "e_score_correction_bias"),
        renormalize=True,
        scaling_factor=float(self.routed_scaling_factor),
    )
    return router_logits, weights, experts


def _inkling2_applicable(module):
    if type(module.score_fn) is not torch.nn.Sigmoid:
        return f"scoring function {type(module.score_fn).__name__} (only sigmoid maps)"
    return None


def _muse_spark(self, hidden_states):
    if autocast_lowers(hidden_states):
        return type(self).forward(self, hidden_states)
    router_logits = (
        F.linear(token_rows(hidden_states, self).float(), tensor_of(self, "weight").float()) * self.output_multiplier
    )
    weights, experts = topk_router(
        router_logits,
        self.top_k,
        scoring="sigmoid",
        bias=tensor_of(self, "e_score_correction_bias"),
        renormalize=True,
        scaling_factor=float(self.routed_scaling_factor),
    )
    return router_logits, weights, experts


def _inkling(self, hidden_states):
    flat = hidden_states.reshape(-1, self.hidden_dim)
    with torch.autocast(device_type=hidden_states.device.type, enabled=False):  # float32, as transformers
        router_logits = F.linear(flat.float(), tensor_of(self, "weight").float())
        routed_logits = router_logits[..., : -self.n_shared_experts]
        shared = router_logits[..., -self.n_shared_experts :].sigmoid()
        bias = tensor_of(self, "e_score_correction_bias").float()
        scores, experts = topk_router(routed_logits, self.top_k, scoring="sigmoid", bias=bias)
        # The selected and the shared experts' sigmoids normalised together (transformers: a softmax
        # of their log-sigmoids), then scaled.
        weights = torch.cat([scores, shared], dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.route_scale * self.global_scale.float()
    weights = weights.to(hidden_states.dtype)
    return routed_logits, weights[..., : self.top_k].contiguous(), experts, weights[..., self.top_k :].contiguous()


# The verified codes: the code_key of the router's forward (DBRX: its block's
# route_tokens_to_experts), the same in transformers 5.23 and 5.24, with the model folders whose
# classes have exactly that code in either release (hy_v4_vl and inkling2_loop are new in 5.24).
# The family forwards above reproduce each one.
_CODES: dict[str, RouterCode] = {
    "e522519b94efb45a": RouterCode("mixtral", "minimax, mixtral", _mixtral, few_tokens=96, few_forward=_mixtral_few),
    "9b0053e488a15363": RouterCode(
        "qwen2_moe",
        "flex_olmo, mellum, olmoe, qwen2_moe, qwen3_moe, qwen3_next, qwen3_omni_moe, qwen4_exp",
        _qwen2_moe,
        few_tokens=16,
        few_forward=_qwen2_moe_few,
    ),
    "c1bdd995f91ae637": RouterCode("qwen3_5_moe", "qwen3_5_moe, qwen3_omni_moe, qwen3_vl_moe", _qwen3_5_moe),
    "8e541ed261f65fa3": RouterCode(
        "granitemoe", "granitemoe, granitemoe_swa, granitemoehybrid, granitemoeshared", _granitemoe
    ),
    "21778f711f1820c8": RouterCode("jamba", "jamba", _jamba),
    "93da2dd7247f880e": RouterCode("gemma4", "diffusion_gemma, gemma4", _gemma4),
    "e6850402800fcd94": RouterCode("gpt_oss", "gpt_oss", _gpt_oss, few_tokens=48, few_forward=_gpt_oss_few),
    "d7bab485fab93575": RouterCode(
        "deepseek_v2", "deepseek_ocr2, deepseek_v2, unlimited_ocr", _deepseek_v2, applicable=_deepseek_v2_applicable
    ),
    "efb421a3094fa060": RouterCode(
        "ernie4_5_moe", "ernie4_5_moe, ernie4_5_vl_moe", _ernie4_5_moe, applicable=_ernie_applicable
    ),
    "4c31bc3fd46dbaec": RouterCode(
        "deepseek_v3",
        "axk1, bailing_hybrid, deepseek_v3, deepseek_v32, dots1, dots3_note, exaone_moe, glm4_moe, glm4_moe_lite, "
        "glm4v_moe, glm5_next, glm_moe_dsa, hy_v4, hy_v4_vl, kimi_linear, mimo_v2_flash, nemotron_h, solar_open",
        _deepseek_v3,
    ),
    "7273bcf86ff8fece": RouterCode("minimax_m2", "minimax_m2", _minimax_m2),
    "e4a1f4b5507ef539": RouterCode("hy_v3", "dots3_note, hy_v3", _hy_v3),
    "64503fb0c2967621": RouterCode("afmoe", "afmoe", _afmoe),
    "8eb7856ee421f3d7": RouterCode("lfm2_moe", "lfm2_moe", _lfm2_moe),
    "1c62b0e563a4b0f8": RouterCode("llama4", "llama4", _llama4),
    "acb6dfb2e18589ce": RouterCode(
        "dbrx", "dbrx", _dbrx_route, method="route_tokens_to_experts", applicable=_dbrx_applicable
    ),
    "e637b753d8cd78b5": RouterCode("aria", "aria", _aria),
    "9d5c3fa627575cb9": RouterCode("cohere2_moe", "cohere2_moe", _cohere2_moe, applicable=_cohere2_moe_applicable),
    "8234e2e9340d95c5": RouterCode("hunyuan_v1_moe", "hunyuan_v1_moe", _hunyuan_v1_moe),
    "a66c04d1a0d0c30b": RouterCode("mistral4", "mistral4", _mistral4, applicable=_groups_applicable),
    "333cc15fb2c28497": RouterCode("mistral_large4", "mistral_large4", _mistral_large4, applicable=_groups_applicable),
    "ad6960bbb03079da": RouterCode("openai_privacy_filter", "openai_privacy_filter", _openai_privacy_filter),
    "761819edb054a0fd": RouterCode("zaya", "zaya", _zaya),
    "98f93bc5bf7d5291": RouterCode("jetmoe", "jetmoe", _jetmoe),
    "0cbbac69393f518c": RouterCode("longcat_flash", "longcat_flash", _longcat_flash),
    "f3a3ddf21b98ba06": RouterCode("flint", "flint", _flint),
    "87ddbf53e2e0d900": RouterCode("laguna", "laguna", _laguna),
    "dba30464d6a78915": RouterCode("minimax_m3_vl", "minimax_m3_vl, step3p7", _minimax_m3_vl),
    "e9da1422cbec5388": RouterCode("axk2", "axk2", _axk2, applicable=_axk2_applicable),
    "46a865b4fc6b4c9b": RouterCode("beam", "beam", _beam, applicable=_groups_applicable),
    "5acb28c70cc90331": RouterCode("inkling", "inkling", _inkling),
    "fb82af56ba0d8d89": RouterCode("inkling2", "inkling2, inkling2_loop", _inkling2, applicable=_inkling2_applicable),
    "d625b90ee2a5d9ec": RouterCode("muse_spark", "muse_spark", _muse_spark),
}


def _router_methods(cls: type):
    """(method name, function) candidates of a router class: its own forward (not an inherited
    one), and DBRX's block routing."""
    if "forward" in vars(cls):
        yield "forward", cls.forward
    if "route_tokens_to_experts" in vars(cls) and cls.__name__ == "DbrxFFN":
        yield "route_tokens_to_experts", cls.route_tokens_to_experts


# Routers that only compute logits: the routing is in their block (patched through the block).
_LOGITS_ONLY = {"DbrxRouter"}
# Routers (or routing blocks) whose class name does not end in Router.
_OTHER_ROUTERS = {"DbrxFFN", "HunYuanMoEV1Gate", "JetMoeTopKGating"}


def _looks_like_router(cls: type) -> bool:
    name = cls.__name__
    return (
        name.endswith(("Router", "TopkRouter", "TopKRouter")) and name not in _LOGITS_ONLY
    ) or name in _OTHER_ROUTERS


def _recognise(cls: type):
    """(method name, function, key, RouterCode or None) for each router method of a router class:
    the code whose key the method has, where that code replaces that method."""
    for method, original in _router_methods(cls):
        key = code_key(original)
        code = _CODES.get(key)
        yield method, original, key, code if code is not None and code.method == method else None


# The few-token forward of each router forward that has one.
_FEW_FORWARDS = {code.forward: code.few_forward for code in _CODES.values() if code.few_forward is not None}
assert all(code.few_forward is not None for code in _CODES.values() if code.few_tokens), (
    "few_tokens needs a few_forward"
)


def _route(forward, module, few, hidden_states, *args, **kwargs):
    """A patched router's forward: ours through the op, or its few_forward for CPU inference at
    fewer than `few` tokens (RouterCode.few_tokens; 0: never), where two torch ops cost less than
    the op's call. Traced (torch.compile), with gradients or on another device: always the op.
    Codes that patch another method (DBRX's block routing) have few_tokens = 0. The cheap tests
    first: at a few tokens they are all that this wrapper adds."""
    if (
        few
        and not torch.is_grad_enabled()
        and hidden_states.is_cpu  # measured on CPU only
        and not torch.compiler.is_compiling()  # before the size test, which would guard on T
        and hidden_states.numel() < few * hidden_states.shape[-1]
    ):
        return _FEW_FORWARDS[forward](module, hidden_states, *args, **kwargs)
    return forward(module, hidden_states, *args, **kwargs)


def apply_moe_kernels(model: torch.nn.Module, *, experts: bool = True, few_tokens: bool = True) -> dict:
    """Patch, in place, every supported MoE router of `model` and its experts implementation.

    Args:
      model: a transformers model (or any module holding transformers MoE blocks).
      experts: also switch the model's experts implementation to "moe_kernels" (where the
        model supports transformers' experts interface).
      few_tokens: CPU inference calls at fewer tokens than measured per router code (decode) run
        its routing in two torch ops, faster there than the op's call (Mixtral below 96 tokens,
        the Qwen2-MoE code below 16, GPT-OSS below 48; docs/routers.md). False: the op at every
        size.

    Returns:
      {"patched": {module name: family code}, "skipped": {module name: reason},
       "experts": the experts implementation now set, or why it was not}.
    """
    patched, skipped = {}, {}
    for name, module in model.named_modules():
        if not _looks_like_router(type(module)):
            continue
        if any(m in vars(module) for m in ("forward", "route_tokens_to_experts")):
            patched[name] = module.__dict__.get("_moe_kernels_code", "already patched")
            continue
        reason = (
            f"unknown router code ({type(module).__name__}): not one of the routers verified on transformers "
            f"{VERIFIED} (python -m moe_kernels.integrations.router_codes prints its key)"
        )
        for method, _, _, code in _recognise(type(module)):
            if code is None:
                continue
            why = code.applicable(module)
            if why is not None:
                reason = f"{type(module).__name__}: {why}"
                break
            # A partial of the module-level family forward, not a bound method: a bound method
            # pickles as getattr(module, "_mixtral"), which fails on load; this pickles by name.
            few = code.few_tokens if few_tokens else 0
            setattr(module, method, functools.partial(_route, code.forward, module, few))
            module._moe_kernels_code = code.name
            module._moe_kernels_few_tokens = few
            patched[name] = code.name
            reason = None
            break
        if reason is not None:
            skipped[name] = reason
    if not experts:
        how = "not requested"
    elif skipped:
        # The experts implementation is one per model (its config): switching it would run our
        # experts behind a router left to transformers. A skipped router leaves its experts alone.
        how = f"unchanged: {len(skipped)} router(s) skipped, and the experts implementation is one per model"
    else:
        how = _set_experts(model)
    return {"patched": patched, "skipped": skipped, "experts": how}


def _set_experts(model) -> str:
    setter = getattr(model, "set_experts_implementation", None)
    if setter is None or not getattr(type(model), "_can_set_experts_implementation", lambda: False)():
        return "unchanged: the model does not use transformers' experts interface"
    transformers_experts.register()
    if "_moe_kernels_previous_experts" not in vars(model):
        model._moe_kernels_previous_experts = model.get_experts_implementation()
    # Loading a pickled model (torch.load) registers "moe_kernels" again, in a fresh process too.
    model._moe_kernels_registration = transformers_experts.Registration()
    setter(transformers_experts.NAME)
    return transformers_experts.NAME


def remove_moe_kernels(model: torch.nn.Module) -> None:
    """Undo apply_moe_kernels: the routers' own methods and the experts implementation(s) again."""
    for module in model.modules():
        if "_moe_kernels_code" in vars(module):
            for method in ("forward", "route_tokens_to_experts"):
                module.__dict__.pop(method, None)
            del module._moe_kernels_code
            vars(module).pop("_moe_kernels_few_tokens", None)
    vars(model).pop("_moe_kernels_registration", None)
    previous = vars(model).pop("_moe_kernels_previous_experts", None)
    if previous is not None:
        model.set_experts_implementation(previous)
