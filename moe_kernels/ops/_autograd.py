"""Autograd for the extension's ops (moe_kernels::*), registered as torch.library.register_autograd
registers it, without its per-call `fill_defaults`.

torch's kernel (torch/_library/autograd.py) puts back the arguments the dispatcher dropped for
equalling their defaults before it calls setup_context, and does so by reading `schema.arguments`
(a list pybind builds afresh) once per argument: the cost grows with the square of the argument
count, 24 us a call for topk_router's nine (a forward that needs a gradient took 70 us where
topk_softmax's own three-argument op took 44). The extension's schemas (csrc/cpu/<op>.cpp) declare
no defaults and no keyword-only arguments, so the dispatcher passes every argument and there is
nothing to fill: this kernel hands them to setup_context as they come. The rest is torch's: the
forward redispatches below autograd inside an autograd.Function, a call that needs no gradient
redispatches directly, and the backward gets ctx.needs_input_grad for the op's own inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _checked_schema(op) -> None:
    schema = op._schema
    for arg in schema.arguments:
        if arg.kwarg_only or arg.has_default_value():
            raise ValueError(
                f"{schema.name}: {arg.name} has a default or is keyword-only; use torch.library.register_autograd"
            )
        if isinstance(arg.type, torch.ListType):
            raise ValueError(f"{schema.name}: {arg.name} is a list; use torch.library.register_autograd")
    if schema.is_mutable:
        raise ValueError(f"{schema.name} mutates an input; use torch.library.register_autograd")


def register_autograd(qualname: str, backward: Callable, *, setup_context: Callable) -> None:
    """torch.library.register_autograd(qualname, backward, setup_context=setup_context) for an
    extension op whose schema has no defaults, keyword-only or list arguments (checked)."""
    namespace, name = qualname.split("::")
    op = getattr(getattr(torch.ops, namespace), name).default
    _checked_schema(op)
    below_autograd = torch._C._after_autograd_keyset

    def forward(ctx, keyset, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = op.redispatch(keyset & below_autograd, *args)
        setup_context(ctx=ctx, inputs=args, output=output)
        return output

    def backward_(ctx, *grads):
        needs = ctx.needs_input_grad
        try:
            ctx.needs_input_grad = needs[1:]  # the keyset is no input of the op
            result = backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (None, *result) if isinstance(result, tuple) else (None, result)

    # Named at creation: the graph's node is "<namespace>_<op>Backward" (autograd names it then).
    Function = type(
        f"{namespace}_{name}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward_)},
    )

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return Function.apply(keyset, *args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & below_autograd, *args)

    _LIBRARIES.setdefault(namespace, torch.library.Library(namespace, "IMPL")).impl(
        name, kernel, "Autograd", with_keyset=True
    )


def direct(packet) -> Callable:
    """`packet(*args)` (an extension op registered above, every argument positional), straight to
    its device kernel when no gradient can be asked of it: the call the autograd kernel above makes
    itself then, without the 4 us of entering the dispatcher's Python autograd kernel first, which
    is most of an op's cost at a few tokens. Outside torch.compile only (a traced call keeps the
    autograd kernel, which the compiler knows); the outputs are the same tensors either way."""
    op = packet.default
    below_autograd = torch._C._AutoDispatchBelowAutograd
    any_requires_grad = torch._C._any_requires_grad

    def call(*args):
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any_requires_grad(*args)):
            return op(*args)
        with below_autograd():
            return op(*args)

    call.packet = packet  # the op it calls (backends' registry holds `call`)
    return call


def through_reference(reference: Callable, args: tuple, needs_input_grad, grads: tuple) -> tuple:
    """The gradients of `reference(*args)` with respect to the args marked in `needs_input_grad`,
    for the output gradients `grads`, as a graph of torch ops (create_graph): what a kernel's
    backward returns when it is asked to build a graph (a second derivative: grad mode is on in the
    backward). The kernels' own backwards have no derivative, and a gradient without a graph would
    make every second derivative through it silently zero. `args` are the op's inputs as saved
    (they keep their history); int outputs and None gradients take no part. Returns one entry per
    arg: its gradient (zeros where the reference does not use it), or None where not asked."""
    wanted = [i for i, need in enumerate(needs_input_grad) if need]
    result = [None] * len(args)
    if not wanted:
        return tuple(result)
    with torch.enable_grad():
        outputs = reference(*args)
    outputs = outputs if isinstance(outputs, tuple | list) else (outputs,)
    pairs = [(o, g.to(o.dtype)) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    found = (
        torch.autograd.grad(
            [o for o, _ in pairs],
            [args[i] for i in wanted],
            [g for _, g in pairs],
            create_graph=True,
            allow_unused=True,
        )
        if pairs
        else [None] * len(wanted)
    )
    for i, grad in zip(wanted, found, strict=True):
        result[i] = torch.zeros_like(args[i]) if grad is None else grad
    return tuple(result)


# Registrations last as long as their Library object.
_LIBRARIES: dict[str, torch.library.Library] = {}
