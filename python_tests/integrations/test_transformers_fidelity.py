"""Patched routers against transformers' own, router by router, where the arithmetic is not float32:
a bf16 model, a float32 model under CPU bf16 autocast, and a float64 model (where transformers
scores some routers' logits in float32: Mixtral, MiniMax-M2, MiniMax-M3-VL, Step3p7). Each router
is called with the hidden states it received in a forward of the model, once patched and once
through its class's method.

The outputs must have transformers' dtypes and shapes, pick transformers' experts on every row
except where the experts in question tie on their logits (ties go to the lower index here, by
design: docs/routers.md), and give the same weights on the rows that pick the same experts.
"""

import contextlib

import pytest
import torch

pytest.importorskip("transformers")
from hf_tiny import FAMILIES, tiny_model  # noqa: E402

from moe_kernels.integrations.transformers import apply_moe_kernels  # noqa: E402

SETTINGS = {
    "bf16": (torch.bfloat16, contextlib.nullcontext),
    "autocast": (torch.float32, lambda: torch.autocast("cpu", torch.bfloat16)),
    "float64": (torch.float64, contextlib.nullcontext),
}


def routed_calls(model, ids, context):
    """{router name: (method, args, kwargs)}: the first call of each patched router's method in a
    forward of `model` on `ids` (the method is forward, or DBRX's block routing)."""
    calls, patched = {}, []
    for name, module in model.named_modules():
        if "_moe_kernels_code" not in vars(module):
            continue
        method = "forward" if "forward" in vars(module) else "route_tokens_to_experts"
        ours = vars(module)[method]

        def record(*args, _name=name, _method=method, _ours=ours, **kwargs):
            calls.setdefault(_name, (_method, args, kwargs))
            return _ours(*args, **kwargs)

        setattr(module, method, record)
        patched.append((module, method, ours))
    try:
        with context(), torch.no_grad():
            model(ids)
    finally:
        for module, method, ours in patched:
            setattr(module, method, ours)
    return calls


def _is_logits(t, T, k) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 2 and t.shape[0] == T and t.shape[1] > k


def tensors(out):
    return [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]


def untied_differences(ours, theirs, logits):
    """Rows whose expert sets differ, except rows where the experts in the symmetric difference
    all have the same logit (a tie, broken to the lower index here)."""
    rows = (ours.sort(-1).values != theirs.sort(-1).values).any(-1).nonzero().flatten().tolist()
    untied = []
    for r in rows:
        differing = set(ours[r].tolist()) ^ set(theirs[r].tolist())
        if logits is None or len({float(logits[r, e]) for e in differing}) != 1:
            untied.append(r)
    return untied


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_routers_match_transformers_beyond_float32(family, setting):
    if (family, setting) == ("dbrx", "autocast"):
        pytest.skip("transformers' DBRX fails under CPU bf16 autocast unpatched (index_add_ of bf16 into float32)")
    dtype, context = SETTINGS[setting]
    model = tiny_model(family, dtype, seed=1)
    if dtype == torch.float64:
        model.set_experts_implementation("eager")  # transformers' grouped_mm refuses float64
    apply_moe_kernels(model, experts=False, few_tokens=False)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (2, 256), generator=torch.Generator().manual_seed(0))
    calls = routed_calls(model, ids, context)
    assert calls, f"{family}: no patched router was called"
    for name, (method, args, kwargs) in calls.items():
        module = model.get_submodule(name)
        with context(), torch.no_grad():
            ours = tensors(getattr(module, method)(*args, **kwargs))
            theirs = tensors(getattr(type(module), method)(module, *args, **kwargs))
        assert len(ours) == len(theirs), f"{family} {name}: {len(ours)} tensors returned, transformers {len(theirs)}"
        index = next((i for i, t in enumerate(theirs) if not t.is_floating_point() and t.dim() == 2), None)
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{family} {name} output {i}: {a.dtype} {tuple(a.shape)}"
        if index is None:  # Llama 4: dense scores; its experts are where they are nonzero
            continue
        experts, expected = ours[index], theirs[index]
        # The router logits [T, E]: returned, or (DBRX's block routing) the argument.
        T, k = expected.shape
        candidates = [*theirs, *args]
        logits = next((t for t in candidates if _is_logits(t, T, k)), None)
        untied = untied_differences(experts, expected, logits)
        assert not untied, f"{family} {name}: other experts on {len(untied)} untied rows, e.g. {untied[:4]}"
        # The weights of rows with the same experts, matched by expert.
        same = (experts.sort(-1).values == expected.sort(-1).values).all(-1)
        weights = [i for i, t in enumerate(theirs) if t.is_floating_point() and t.shape == expected.shape]
        for i in weights:
            a = ours[i].gather(1, experts.argsort(-1))[same].float()
            b = theirs[i].gather(1, expected.argsort(-1))[same].float()
            tol = 1e-5 if theirs[i].dtype == torch.float32 else 1e-2
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{family} {name} weights (output {i})")
