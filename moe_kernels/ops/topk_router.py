"""moe_kernels.ops.topk_router: the router of today's MoE models in one op.

Softmax or sigmoid scores, a selection-only correction bias, group-limited top-k, renormalisation
and a scaling factor (docs/routers.md maps each transformers family to its call).

Implementations: reference (moe_kernels/reference/topk_router.py), C++ CPU
(csrc/cpu/topk_router.cpp, forward and backward fused), Triton (moe_kernels/triton/topk_router.py
and topk_router_backward.py, the backward fused too; _backward_from_logits in torch is the
backward of float64 rows), CUDA (csrc/cuda/topk_router.cu, forward
and backward fused, float64 included; its row algorithm is tested on the host by
python_tests/ops/test_topk_router_cuda_emulation.py). backends.py chooses among them.
"""

import functools
import math

import torch

from moe_kernels import backends, reference
from moe_kernels.ops import _autograd, _validate
from moe_kernels.reference.topk_router import GROUP_SCORINGS, SCORINGS, router_scores


def _kernel_call(op):
    """The extension op behind the public keyword signature."""

    def call(logits, k, *, scoring, bias, num_groups, topk_groups, group_scoring, renormalize, scaling_factor):
        return op(logits, k, scoring, bias, num_groups, topk_groups, group_scoring, renormalize, scaling_factor)

    return call


def _backward_from_logits(logits, experts, grad_weights, scoring, renormalize, scaling_factor):
    """d loss / d logits [T, E] from d loss / d weights [T, k]: the C++ backward's formulas
    (csrc/include/moe_kernels/topk_router.h) in torch, for the backends without a fused backward."""
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits_TE, grad_weights_TK = logits.to(compute), grad_weights.to(compute)
    if scoring == "sigmoid":
        softmax_TE = None
        selected_TK = torch.sigmoid(logits_TE.gather(1, experts))
    else:
        softmax_TE = router_scores(logits_TE, "softmax")
        selected_TK = softmax_TE.gather(1, experts)
    # grad_selected_TK: d loss / d the selected scores, through the renormalisation and scaling.
    if renormalize:
        total_T1 = selected_TK.sum(dim=-1, keepdim=True)
        zero_T1 = total_T1 == 0
        safe_T1 = torch.where(zero_T1, 1.0, total_T1)
        dot_T1 = (grad_weights_TK * selected_TK / safe_T1).sum(dim=-1, keepdim=True)
        grad_selected_TK = torch.where(zero_T1, 0.0, scaling_factor / safe_T1 * (grad_weights_TK - dot_T1))
    else:
        grad_selected_TK = scaling_factor * grad_weights_TK
    if softmax_TE is None:
        # 0 off the selection, but NaN at a NaN logit: the reference's sigmoid over the row
        # backpropagates 0 * sigmoid'(NaN) = NaN there (docs/reliability.md).
        off_TE = torch.where(torch.isnan(logits_TE), logits_TE, torch.zeros_like(logits_TE))
        grad_TE = off_TE.scatter_add(1, experts, grad_selected_TK * selected_TK * (1 - selected_TK))
    else:
        dot_T1 = (grad_selected_TK * selected_TK).sum(dim=-1, keepdim=True)
        grad_TE = (-softmax_TE * dot_T1).scatter_add(1, experts, grad_selected_TK * selected_TK)
    return grad_TE.to(logits.dtype)


def _backward_torch(ctx, grad_weights, grad_experts):
    logits, experts = ctx.saved_tensors
    grad = None
    if grad_weights is not None and ctx.needs_input_grad[0]:
        grad = _backward_from_logits(logits, experts, grad_weights, ctx.scoring, ctx.renormalize, ctx.scaling_factor)
    return grad, None, None, None, None, None, None, None, None


def _setup_context(ctx, inputs, output):
    logits, k, scoring, bias, num_groups, topk_groups, group_scoring, renormalize, scaling_factor = inputs
    ctx.set_materialize_grads(False)  # no zero gradient made for the int64 experts
    ctx.save_for_backward(logits, output[1])
    ctx.scoring, ctx.renormalize, ctx.scaling_factor = scoring, renormalize, scaling_factor
    # No bias and one eligible pool: the experts were ranked by the logits, so experts[:, 0] holds
    # each row's largest logit (the kernel backward's softmax shift, without a pass to find it).
    ctx.ranked_by_logits = bias is None and topk_groups >= num_groups
    ctx.from_weights = False


def _setup_context_kernel(ctx, inputs, output):
    """The extension op's: a renormalised softmax router's float32 weights (scaling * the selected
    scores over their sum) determine its gradient, so where the device has the kernel that takes
    them, a copy of the [T, k] weights is saved instead of the [T, E] logits (a copy: a caller may
    edit the returned weights in place). The backward then reads no logits, and the graph does not
    keep them alive; the price is that such a router has no second derivative (_backward says so)."""
    logits, k, scoring, bias, num_groups, topk_groups, group_scoring, renormalize, scaling_factor = inputs
    from_weights = (
        scoring == "softmax"
        and renormalize
        and scaling_factor != 0
        and output[0].dtype == torch.float32
        and backends.extension_kernel("topk_router_backward_from_weights", logits) is not None
    )
    if not from_weights:
        return _setup_context(ctx, inputs, output)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(output[0].clone(), output[1])
    ctx.scaling_factor, ctx.from_weights = scaling_factor, True
    ctx.num_experts, ctx.dtype = logits.shape[1], logits.dtype


def _backward(ctx, grad_weights, grad_experts):
    if torch.is_grad_enabled():  # create_graph: the torch formula, differentiable again
        if ctx.from_weights:
            raise RuntimeError(
                "topk_router: no second derivative (create_graph=True) through the extension's backward of a "
                "renormalised softmax router: its graph keeps the [T, k] weights, not the [T, E] logits (memory). "
                "Run the router under moe_kernels.use_backend('torch') where a double backward goes through it."
            )
        return _backward_torch(ctx, grad_weights, grad_experts)
    if ctx.from_weights:
        grad = None
        if grad_weights is not None and ctx.needs_input_grad[0]:
            weights, experts = ctx.saved_tensors
            grad = torch.ops.moe_kernels.topk_router_backward_from_weights(
                grad_weights, weights, experts, ctx.num_experts, ctx.scaling_factor, ctx.dtype
            )
        return grad, None, None, None, None, None, None, None, None
    logits, experts = ctx.saved_tensors
    grad = None
    if grad_weights is not None and ctx.needs_input_grad[0]:
        grad = torch.ops.moe_kernels.topk_router_backward(
            grad_weights, logits, experts, ctx.scoring, ctx.renormalize, ctx.scaling_factor, ctx.ranked_by_logits
        )
    return grad, None, None, None, None, None, None, None, None


_cpp = None
if backends._extension.has_kernel("topk_router", "CPU"):
    _cpp = _kernel_call(_autograd.direct(torch.ops.moe_kernels.topk_router))

    @torch.library.register_fake("moe_kernels::topk_router")
    def _fake(logits, k, scoring, bias, num_groups, topk_groups, group_scoring, renormalize, scaling_factor):
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        T = logits.shape[0]
        return logits.new_empty((T, k), dtype=dtype), logits.new_empty((T, k), dtype=torch.int64)

    @torch.library.register_fake("moe_kernels::topk_router_backward")
    def _fake_backward(grad_weights, logits, experts, scoring, renormalize, scaling_factor, ranked_by_logits):
        return torch.empty_like(logits, memory_format=torch.contiguous_format)

    if backends._extension.defines("topk_router_backward_from_weights"):

        @torch.library.register_fake("moe_kernels::topk_router_backward_from_weights")
        def _fake_backward_from_weights(grad_weights, weights, experts, num_experts, scaling_factor, dtype):
            return weights.new_empty((weights.shape[0], num_experts), dtype=dtype)

    _autograd.register_autograd("moe_kernels::topk_router", _backward, setup_context=_setup_context_kernel)

_triton = None
if backends.triton_importable():
    from moe_kernels.triton import topk_router as _triton_module
    from moe_kernels.triton import topk_router_backward as _triton_backward_module

    def _backward_triton(ctx, grad_weights, grad_experts):
        """The Triton kernel's backward: one fused pass (float64 rows, which the forward sent to
        the reference, and a backward that builds a graph for a second one take the formulas in
        torch)."""
        logits, experts = ctx.saved_tensors
        # create_graph (grad mode on in here): the torch formula, which is differentiable again.
        fused = logits.dtype != torch.float64 and _triton_backward_module.supports(logits.shape[1])
        if not fused or torch.is_grad_enabled():
            return _backward_torch(ctx, grad_weights, grad_experts)
        grad = None
        if grad_weights is not None and ctx.needs_input_grad[0]:
            # The forward's experts: distinct in each row.
            grad = _triton_backward_module.topk_router_backward(
                grad_weights, logits, experts, ctx.scoring, ctx.renormalize, ctx.scaling_factor, True
            )
        return grad, None, None, None, None, None, None, None, None

    _triton_module.topk_router.register_autograd(_backward_triton, setup_context=_setup_context)
    _triton_call = _kernel_call(_triton_module.topk_router)

    def _triton(logits, k, *, num_groups, **kwargs):
        if not _triton_module.supports(logits.shape[1], num_groups):  # past the kernel: cuda, else the reference
            return backends.fallback("topk_router", "triton", logits)(logits, k, num_groups=num_groups, **kwargs)
        return _triton_call(logits, k, num_groups=num_groups, **kwargs)


_cuda = None
if _cpp is not None:
    # Defined wherever the op is (one schema for both devices): backends.py runs it only where the
    # extension registered the CUDA kernel, as for the other ops. The CUDA kernel keeps the
    # eligible groups in a 64-bit mask (csrc/include/moe_kernels/topk_router_row.h): a grouped
    # call with more groups runs the reference on the device.
    _CUDA_MAX_GROUPS = 64

    def _cuda(logits, k, *, num_groups, topk_groups, **kwargs):
        if topk_groups < num_groups and num_groups > _CUDA_MAX_GROUPS:
            return reference.topk_router(logits, k, num_groups=num_groups, topk_groups=topk_groups, **kwargs)
        return _cpp(logits, k, num_groups=num_groups, topk_groups=topk_groups, **kwargs)


backends.register("topk_router", torch=reference.topk_router, cpu=_cpp, triton=_triton, cuda=_cuda)


def _choice(name: str, value, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, one of {allowed}, got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def check_options(
    E: int,
    k: int,
    *,
    scoring: str = "softmax",
    num_groups: int = 1,
    topk_groups: int | None = None,
    group_scoring: str = "top2_sum",
    renormalize: bool = False,
    scaling_factor: float = 1.0,
) -> int:
    """topk_router's options for E experts (everything but the tensors): a TypeError / ValueError
    naming the first bad one. Returns topk_groups (None -> num_groups). Shared with the gates
    built on topk_router (AuxLossFreeGate), which check them when they are built."""
    _choice("scoring", scoring, SCORINGS)
    _choice("group_scoring", group_scoring, GROUP_SCORINGS)
    _validate.integer("num_groups", num_groups, low=1, high=E, what=f" (E = {E} experts)")
    if E % num_groups:
        raise ValueError(f"num_groups must divide the number of experts E = {E}, got {num_groups}")
    if topk_groups is None:
        topk_groups = num_groups
    _validate.integer("topk_groups", topk_groups, low=1, high=num_groups, what=f" (num_groups = {num_groups})")
    group_size = E // num_groups
    if group_scoring == "top2_sum" and topk_groups < num_groups and group_size < 2:
        raise ValueError(
            f"group_scoring='top2_sum' needs groups of >= 2 experts, got E / num_groups = {E} / {num_groups}"
        )
    eligible = topk_groups * group_size
    _validate.integer(
        "k", k, low=1, high=eligible, what=f" (eligible experts: topk_groups * E / num_groups = {eligible})"
    )
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, int | float):
        raise TypeError(f"scaling_factor must be a float, got {type(scaling_factor).__name__}")
    if not abs(scaling_factor) < math.inf:  # math.isfinite does not trace under dynamic=True
        raise ValueError(f"scaling_factor must be finite, got {scaling_factor}")
    return topk_groups


def _options(E, k, scoring, num_groups, topk_groups, group_scoring, renormalize, scaling_factor) -> int:
    return check_options(
        E,
        k,
        scoring=scoring,
        num_groups=num_groups,
        topk_groups=topk_groups,
        group_scoring=group_scoring,
        renormalize=renormalize,
        scaling_factor=scaling_factor,
    )


# Options already checked, by value and type (True is not 1, 1 is not 1.0): checking them again
# costs 1.1 us, a fifth of the op's call at one token, and a router calls with the same options
# every time. A bad option raises, and is not kept.
_options_cached = functools.lru_cache(maxsize=1024, typed=True)(_options)


def _options_checked(*options) -> int:
    try:
        return _options_cached(*options)
    except TypeError:  # an unhashable option (a list...): its check names it
        return _options(*options)


def topk_router(
    logits: torch.Tensor,
    k: int,
    *,
    scoring: str = "softmax",
    bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int | None = None,
    group_scoring: str = "top2_sum",
    renormalize: bool = False,
    scaling_factor: float = 1.0,
):
    """The k experts of each token and their routing weights, as today's MoE routers compute them.

    scores = softmax(logits) or sigmoid(logits) in float32 (float64 for float64 logits);
    choice = scores + bias selects, among the experts of the topk_groups best groups, the k
    largest; weights = the selected scores (never the bias), divided by their sum if
    `renormalize` (a zero sum gives zeros), times `scaling_factor`.

    Args:
      logits: [T, E] float32 / float16 / bfloat16 / float64, any strides.
      k: experts per token, 1 <= k <= topk_groups * E / num_groups.
      scoring: "softmax" (Mixtral, Qwen-MoE, OLMoE, ...) or "sigmoid" (DeepSeek-V3, GLM-4.5, ...).
      bias: None or [E] floating tensor on the logits' device: the selection-only correction bias
        (DeepSeek-V3's aux-loss-free balancing). No gradient flows to it.
      num_groups: experts split into this many contiguous groups (must divide E); 1 = no groups.
      topk_groups: how many groups are eligible (None = all), 1 <= topk_groups <= num_groups.
      group_scoring: a group's score: "top2_sum" (sum of its two largest choice values,
        DeepSeek-V3; groups must hold >= 2 experts) or "max" (its largest, DeepSeek-V2).
      renormalize: divide the selected weights by their sum.
      scaling_factor: finite real number multiplying the weights (routed_scaling_factor).

    Returns:
      (weights [T, k] float32 (float64 for float64 logits),
       experts [T, k] int64, by descending choice value, ties to the lower expert index).

    Differentiable with respect to `logits`. NaN ranks above every number. With no bias and no
    groups the experts are ranked by the logits themselves (see the reference's docstring).
    """
    _validate.tensor("logits", logits, dim=2, shape="[T, E]", dtypes=_validate.FLOAT_DTYPES)
    E = logits.shape[1]
    if E < 1:
        raise ValueError(f"logits must be [T, E] with E >= 1, got shape {tuple(logits.shape)}")
    options = (E, k, scoring, num_groups, topk_groups, group_scoring, renormalize, scaling_factor)
    topk_groups = _options_checked(*options) if not torch.compiler.is_compiling() else _options(*options)
    if bias is not None:
        _validate.tensor("bias", bias, dim=1, shape="[E]", dtypes=_validate.FLOAT_DTYPES)
        if bias.shape[0] != E:
            raise ValueError(f"bias must be [E] = [{E}], got shape {tuple(bias.shape)}")
        _validate.same_device(logits=logits, bias=bias)
    return backends.implementation("topk_router", logits)(
        logits,
        k,
        scoring=scoring,
        bias=bias,
        num_groups=num_groups,
        topk_groups=topk_groups,
        group_scoring=group_scoring,
        renormalize=renormalize,
        scaling_factor=float(scaling_factor),
    )
