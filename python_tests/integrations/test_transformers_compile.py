"""Patched transformers models under torch.compile: one graph and no break per forward, with and
without gradients, fullgraph=True on CPU matching eager (logits and every gradient); our experts
forward compiled alone for every layout and dtype; the grouped matmul op it adds (opcheck)."""

import pytest
import torch

pytest.importorskip("transformers")
from hf_tiny import tiny_model  # noqa: E402

from moe_kernels.integrations import transformers_experts  # noqa: E402
from moe_kernels.integrations.transformers import apply_moe_kernels  # noqa: E402

from .test_transformers_experts import LAYOUTS, eager, experts_of, routing  # noqa: E402

COMPILED = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]


def tokens(seed=0, shape=(2, 12)):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def patched(family, dtype=torch.float32, layers=2):
    model = tiny_model(family, dtype=dtype, layers=layers)
    report = apply_moe_kernels(model)
    assert report["experts"] == "moe_kernels" and not report["skipped"], report
    return model


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("family", COMPILED)
def test_one_graph_no_breaks(family, grad):
    model = patched(family)
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        explanation = torch._dynamo.explain(lambda ids: model(ids).logits)(tokens())
    reasons = [b.reason.splitlines()[0] for b in explanation.break_reasons]
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), reasons


def forward_and_grads(fn, model, ids):
    logits = fn(ids)
    logits.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


@pytest.mark.parametrize("family", COMPILED)
def test_fullgraph_compile_matches_eager(family):
    # inductor, the default backend: an inference forward and a training step (float32, where
    # torch._grouped_mm's fake refuses the dtype and our grouped matmul op runs instead). One decoder
    # layer: inductor generates and compiles each layer's kernels anew (about 14 s a layer on 2 cores,
    # twice a CI run); test_one_graph_no_breaks traces the two-layer model as one graph.
    model = patched(family, layers=1)
    ids = tokens()
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids: model(ids).logits, fullgraph=True)
    with torch.no_grad():
        assert relative_error(compiled(ids), model(ids).logits) < 1e-5
    ref, ref_grads = forward_and_grads(lambda ids: model(ids).logits, model, ids)
    out, grads = forward_and_grads(compiled, model, ids)
    assert relative_error(out, ref) < 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert relative_error(g, ref_grads[name]) < 1e-4, name


@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.bfloat16, 2e-2), (torch.float16, 2e-3), (torch.float64, 1e-12)],
    ids=["bf16", "fp16", "float64"],
)
def test_compiled_training_step_in_each_dtype(dtype, tol):
    # bf16 traces torch._grouped_mm itself; fp16 and float64 run our op (float64: a matmul per expert).
    model = patched("qwen3_moe", dtype=dtype)
    ids = tokens()
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids: model(ids).logits, fullgraph=True, backend="aot_eager")
    ref, ref_grads = forward_and_grads(lambda ids: model(ids).logits, model, ids)
    out, grads = forward_and_grads(compiled, model, ids)
    assert relative_error(out.double(), ref.double()) < tol
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert relative_error(g.double(), ref_grads[name].double()) < tol * 10, name


@pytest.mark.parametrize("family", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["float32", "bf16", "float64"])
def test_compiled_experts_forward_every_layout(family, dtype):
    # The experts forward alone, fullgraph, forward and backward, against transformers' eager loop;
    # two experts get no token (their gradients must be exactly zero).
    experts = experts_of(family, dtype=dtype)
    E = experts.num_experts
    x = torch.randn(13, 64, dtype=dtype)
    idx, w = routing(13, E, 2, skip_experts=(1, E - 1))
    w = w.to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(transformers_experts.experts_forward, fullgraph=True, backend="aot_eager")
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    if dtype == torch.bfloat16:
        tol = dict(rtol=2e-2, atol=2e-2)
    outs, grads = [], []
    for fn in (lambda *a: compiled(experts, *a), lambda *a: eager(experts, *a)):
        xi = x.clone().requires_grad_()
        out = fn(xi, idx, w)
        out.backward(torch.ones_like(out))
        outs.append(out.detach())
        grads.append({"x": xi.grad, **{n: p.grad.clone() for n, p in experts.named_parameters()}})
        experts.zero_grad(set_to_none=True)
    torch.testing.assert_close(outs[0], outs[1], **tol)
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], **tol, msg=name)
        if name != "x" and grads[0][name].shape[0] == E:
            assert grads[0][name][1].abs().max() == 0 and grads[0][name][E - 1].abs().max() == 0, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["float32", "bf16", "float64"])
def test_grouped_mm_op(dtype):
    # The op torch.compile sees for the dtypes torch._grouped_mm's fake refuses: schema, fake,
    # autograd registration; and the per-expert product, 0 for an expert without rows.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 16, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(4, 16, 24, generator=g).to(dtype).requires_grad_()
    offsets = torch.tensor([0, 3, 3, 7, 10])
    torch.library.opcheck(transformers_experts._grouped_mm_op, (x, weight, offsets))
    torch.library.opcheck(transformers_experts._grouped_mm_weight_grad, (x, torch.randn(10, 24).to(dtype), offsets))
    out = transformers_experts._grouped_mm_op(x, weight, offsets)
    bounds = offsets.tolist()
    ref = torch.cat([x[bounds[e] : bounds[e + 1]] @ weight[e] for e in range(4)])
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, ref, **tol)
    out.sum().backward()  # an expanded (stride-0) gradient
    assert weight.grad[1].abs().max() == 0


@pytest.mark.parametrize("family", COMPILED)
def test_dynamic_shapes_one_compile(family):
    # dynamic=True: one graph serves every batch and sequence length (no recompile), as in decoding.
    from torch._dynamo.testing import CompileCounterWithBackend

    model = patched(family, layers=1)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda ids: model(ids).logits, fullgraph=True, dynamic=True, backend=counter)
    compiles = []
    with torch.no_grad():
        for seed, shape in enumerate([(2, 12), (3, 7), (4, 5), (2, 100)]):
            ids = tokens(seed, shape)
            assert relative_error(compiled(ids), model(ids).logits) < 1e-5
            compiles.append(counter.frame_count)
    assert compiles[1:] == compiles[:1] * 3, compiles  # (2, 100): 200 tokens, past the few-choice path
