"""apply_moe_kernels on tiny transformers models of every covered family: same logits, gradients,
greedy tokens and state_dict as the unpatched model; bf16 routing differs only on tied scores."""

import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
from hf_tiny import FAMILIES, GENERATES, num_routers, tiny_model  # noqa: E402

from moe_kernels.integrations import transformers_experts  # noqa: E402
from moe_kernels.integrations.transformers import apply_moe_kernels, remove_moe_kernels  # noqa: E402

# Families whose experts module is not pluggable through transformers' experts interface in 5.23 and 5.24
# (their own expert loops stay; the router is still ours).
OWN_EXPERTS = {"llama4_text", "dbrx", "step3p7", "jetmoe", "longcat_flash"}


def tokens(seed=0, shape=(2, 12)):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_gradients_and_state_dict(family):
    model = tiny_model(family)
    ids = tokens()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ref = model(ids).logits
    ref.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    report = apply_moe_kernels(model, few_tokens=False)
    assert len(report["patched"]) == num_routers(model, family), report
    assert not report["skipped"], report["skipped"]
    assert report["experts"] == ("moe_kernels" if family not in OWN_EXPERTS else report["experts"])
    if family in OWN_EXPERTS:
        assert report["experts"].startswith("unchanged")

    out = model(ids).logits
    assert relative_error(out, ref) < 1e-5
    out.square().mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert relative_error(g, ref_grads[name]) < 1e-4, name

    after = model.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[k], v) for k, v in state.items())


@pytest.mark.parametrize("family", GENERATES)
def test_greedy_generate_same_tokens(family):
    model = tiny_model(family, seed=1)
    ids = tokens(seed=1, shape=(1, 6))
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        apply_moe_kernels(model, few_tokens=False)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)


def record_router_calls(model):
    """Wrap every patched router method so that each call is recorded with transformers' own method."""
    calls = []
    for module in model.modules():
        if "_moe_kernels_code" not in vars(module):
            continue
        for method in ("forward", "route_tokens_to_experts"):
            ours = vars(module).get(method)
            if ours is None:
                continue
            theirs = getattr(type(module), method).__get__(module)

            def record(*args, _ours=ours, _theirs=theirs, **kwargs):
                calls.append((_ours, _theirs, args, kwargs))
                return _ours(*args, **kwargs)

            setattr(module, method, record)
    return calls


def canonical(outputs):
    """The outputs in an order-free form: transformers' topk(sorted=False) leaves the order of a
    token's k experts open (sorted here by expert index); JetMoE's dispatch plan (the pairs grouped
    by expert, any order within an expert) becomes dense [T, E] gates."""
    if len(outputs) == 5 and isinstance(
        outputs[3], list
    ):  # JetMoE: index_sorted_experts, batch_index, batch_gates, expert_size, logits
        index_sorted_experts, batch_index, batch_gates, expert_size, logits = outputs
        k = index_sorted_experts.numel() // logits.shape[0]
        assert torch.equal(index_sorted_experts.sort()[0], torch.arange(index_sorted_experts.numel()))
        assert torch.equal(batch_index, index_sorted_experts // k)
        experts = torch.repeat_interleave(torch.arange(len(expert_size)), torch.tensor(expert_size))
        dense = torch.zeros(logits.shape, dtype=batch_gates.dtype).index_put_((batch_index, experts), batch_gates)
        return [dense, logits]
    index = next((o for o in outputs if not o.is_floating_point()), None)
    if index is None:
        return list(outputs)
    order = index.argsort(dim=-1)
    return [o.gather(-1, order) if o.shape == index.shape else o for o in outputs]


def structure(outputs):
    return [(t.dtype, t.shape) if isinstance(t, torch.Tensor) else (type(t), len(t)) for t in outputs]


def assert_routers_match(family, dtype, settings=None):
    """Router by router, called as the model calls it but on random hidden states (the model's own
    can tie, e.g. a token whose hidden state is 0): the same outputs as transformers' code (values
    in float32; structure, shapes and dtypes in any dtype). `settings`: router attributes to set."""
    generator = torch.Generator().manual_seed(4)
    model = tiny_model(family, dtype=dtype, seed=3)
    report = apply_moe_kernels(model, experts=False, few_tokens=False)
    assert len(report["patched"]) == num_routers(model, family), report
    for module in model.modules():
        if "_moe_kernels_code" in vars(module):
            for name, value in (settings or {}).items():
                assert hasattr(module, name), name
                setattr(module, name, value)
    calls = record_router_calls(model)
    with torch.no_grad():
        model(tokens(seed=3))
        assert len(calls) == len(report["patched"])
        for ours, theirs, args, kwargs in calls:
            hidden = 0.5 * torch.randn(args[0].shape, generator=generator).to(args[0].dtype)
            args = (hidden, *args[1:])
            a, b = ours(*args, **kwargs), theirs(*args, **kwargs)
            assert type(a) is type(b) and len(a) == len(b)
            assert structure(a) == structure(b)
            if dtype == torch.float32:
                for x, y in zip(canonical(a), canonical(b), strict=True):
                    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_router_outputs_match_transformers(family):
    for dtype in (torch.float32, torch.bfloat16):
        assert_routers_match(family, dtype)


# Router settings the tiny configs leave on one side of a branch in the router's code.
VARIANTS = [
    ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": False}),
    ("cohere2_moe", {"expert_selection_fn": "sigmoid", "norm_topk_prob": True}),
    ("flint", {"norm_topk_prob": False}),
    ("laguna", {"router_logit_softcapping": 0.0}),
    ("mistral4", {"norm_topk_prob": False, "num_group": 1, "topk_group": 1}),
    ("axk2", {"num_group": None, "topk_group": None, "norm_topk_prob": False}),
    ("beam", {"norm_topk_prob": False}),
]


@pytest.mark.parametrize("family, settings", VARIANTS)
def test_router_variants_match_transformers(family, settings):
    assert_routers_match(family, torch.float32, settings)


def first_router(model):
    for module in model.modules():
        if "_moe_kernels_code" in vars(module):
            return module
    raise AssertionError("no patched router")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "granitemoe"])
def test_bf16_routing_differs_only_on_ties(family):
    model = tiny_model(family, dtype=torch.bfloat16, seed=2)
    apply_moe_kernels(model, experts=False, few_tokens=False)
    router = first_router(model)
    d = model.config.hidden_size
    # Hidden states on a coarse grid: bf16 router logits tie often.
    hidden = (torch.randint(-2, 3, (512, d), generator=torch.Generator().manual_seed(3)) * 0.25).to(torch.bfloat16)
    ours = router(hidden)
    patched_forward = vars(router).pop("forward")
    theirs = router(hidden)
    router.forward = patched_forward
    experts, ref_experts = ours[2], theirs[2]
    k = experts.shape[1]
    # The key each family ranks: its scores (or logits) in float32; a tie at the k-th place
    # makes the choice depend on the tie rule (ours: lower index; CPU torch.topk: not specified).
    key = theirs[0].float()
    if family == "deepseek_v3":
        key = key.sigmoid() + router.e_score_correction_bias
    top = key.sort(dim=1, descending=True)[0]
    tied = (top[:, k - 1] == top[:, k]) | (top[:, :k].diff(dim=1) == 0).any(dim=1)
    differ = (experts.sort(dim=1)[0] != ref_experts.sort(dim=1)[0]).any(dim=1)
    assert bool((differ <= tied).all()), f"{int((differ & ~tied).sum())} untied rows differ"
    same = ~differ
    torch.testing.assert_close(
        ours[1].float().gather(1, experts.argsort(1))[same],
        theirs[1].float().gather(1, ref_experts.argsort(1))[same],
        rtol=1.6e-2,
        atol=1e-3,
    )
    print(f"{family}: {int(tied.sum())} of {len(tied)} tokens tie in bf16, {int(differ.sum())} routed differently")


def test_unknown_router_is_left_alone_and_reported():
    class WeirdTopKRouter(torch.nn.Module):
        def forward(self, x):
            return x

    model = torch.nn.Sequential(WeirdTopKRouter())
    report = apply_moe_kernels(model, few_tokens=False)
    assert report["patched"] == {}
    assert "unknown router code" in report["skipped"]["0"]
    assert report["experts"].startswith("unchanged")


@pytest.mark.parametrize(
    "family, attribute, value, reason",
    [
        ("deepseek_v2", "topk_method", "noaux_tc", "topk_method"),
        ("cohere2_moe", "expert_selection_fn", "relu", "expert_selection_fn"),
        ("inkling2_text", "score_fn", torch.nn.Softplus(), "scoring function Softplus"),
        ("mistral4", "topk_group", 0, "top_k 2 > the 0 experts"),
        ("beam", "num_group", 3, "does not divide"),
    ],
)
def test_inapplicable_config_is_reported(family, attribute, value, reason):
    model = tiny_model(family)
    for module in model.modules():
        if hasattr(module, attribute):
            setattr(module, attribute, value)
    before = getattr(model, "get_experts_implementation", lambda: None)()
    report = apply_moe_kernels(model, few_tokens=False)
    assert not report["patched"] and report["skipped"]
    assert all(reason in r for r in report["skipped"].values()), report["skipped"]
    # A skipped router's experts stay transformers' (the implementation is one per model).
    assert report["experts"].startswith("unchanged"), report["experts"]
    assert getattr(model, "get_experts_implementation", lambda: None)() == before


def test_remove_restores_the_original_code():
    model = tiny_model("mixtral")
    before = model.get_experts_implementation()
    apply_moe_kernels(model, few_tokens=False)
    assert model.config._experts_implementation == "moe_kernels"
    remove_moe_kernels(model)
    assert not any("_moe_kernels_code" in vars(m) for m in model.modules())
    assert model.get_experts_implementation() == before


def test_experts_implementation_via_transformers_interface():
    # set_experts_implementation alone (no router patch) runs our experts forward.
    model = tiny_model("qwen3_moe")
    ids = tokens()
    with torch.no_grad():
        ref = model(ids).logits
        transformers_experts.register()
        model.set_experts_implementation("moe_kernels")
        out = model(ids).logits
    assert relative_error(out, ref) < 1e-5


def test_import_moe_kernels_does_not_import_transformers():
    code = "import sys, moe_kernels, moe_kernels.ops; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_readme_section_runs():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = text.index("```python", text.index("## Use with Hugging Face transformers")) + len("```python")
    namespace = {"model": tiny_model("qwen3_moe")}
    exec(compile(text[start : text.index("```", start)], "README.md", "exec"), namespace)
    assert len(namespace["report"]["patched"]) == 2 and namespace["report"]["experts"] == "moe_kernels"


def test_example_runs():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "transformers_drop_in.py"
    out = subprocess.run(
        [sys.executable, str(example), "--family", "mixtral", "--tokens", "64", "--repeats", "1"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "same logits" in out and "same greedy tokens" in out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_tokens_take_the_few_forward_in_inference(family, dtype, monkeypatch):
    # Below the measured token count, inference runs the code's few_forward (two torch ops, cheaper
    # there than the op's call); from it, and with gradients at any size, the op. Both give
    # transformers' experts (no ties here) and its weights within rounding; GPT-OSS's few_forward
    # is transformers' own sequence, bit for bit.
    from moe_kernels.integrations import transformers as integration

    model = tiny_model(family, dtype=dtype, seed=3)
    apply_moe_kernels(model, experts=False)
    router = first_router(model)
    few = router._moe_kernels_few_tokens
    assert few > 0
    forward = router.forward.args[0]
    calls = []
    few_forward = integration._FEW_FORWARDS[forward]
    monkeypatch.setitem(
        integration._FEW_FORWARDS, forward, lambda self, h: calls.append(len(h)) or few_forward(self, h)
    )
    d = router.weight.shape[-1]
    h = torch.randn(few, d, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        theirs = type(router).forward(router, h[:-1])
        ours_few = router(h[:-1])
        assert calls == [few - 1]
        ours_op = forward(router, h[:-1])
        router(h)
    assert calls == [few - 1], "the op must run from the threshold on"
    router(h[:-1])
    assert calls == [few - 1], "and with gradients"
    for few_out, op_out, ref in zip(ours_few, ours_op, theirs, strict=True):
        assert few_out.dtype == ref.dtype and few_out.shape == ref.shape
        if family == "gpt_oss":
            assert torch.equal(few_out, ref)
        elif ref.is_floating_point():
            torch.testing.assert_close(few_out, ref, rtol=2e-6 if dtype == torch.float32 else 8e-3, atol=1e-7)
            torch.testing.assert_close(few_out, op_out, rtol=2e-6 if dtype == torch.float32 else 8e-3, atol=1e-7)
        else:
            assert torch.equal(few_out, ref) and torch.equal(few_out, op_out)
    apply_moe_kernels(model, few_tokens=False)  # already patched: the first setting stays
    assert router._moe_kernels_few_tokens == few
    remove_moe_kernels(model)
    assert "_moe_kernels_few_tokens" not in vars(router)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_forward_of_qwen2_moe_code(norm, dtype):
    # norm_topk_prob=False: the softmax over every expert at the top k, transformers' own ops (the
    # same bits); True (Qwen3-MoE's checkpoints): the softmax of the k chosen logits, the same
    # experts and weights within rounding.
    from moe_kernels.integrations import transformers as integration

    model = tiny_model("qwen3_moe", dtype=dtype, seed=5)
    router = next(m for m in model.modules() if type(m).__name__.endswith("Router"))
    router.norm_topk_prob = norm
    h = torch.randn(7, router.weight.shape[-1], generator=torch.Generator().manual_seed(6)).to(dtype)
    with torch.no_grad():
        theirs = type(router).forward(router, h)
        ours = integration._qwen2_moe_few(router, h)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):  # logits, weights, experts
        assert a.dtype == b.dtype and a.shape == b.shape
        if norm and i == 1:
            torch.testing.assert_close(a, b, rtol=2e-6 if dtype == torch.float32 else 8e-3, atol=1e-7)
        else:
            assert torch.equal(a, b)
