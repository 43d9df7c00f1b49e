"""Our experts forward (moe_kernels.integrations.transformers_experts) against transformers' eager
experts loop on one experts module: its paths (torch's grouped matmul, the padded batched matmul
it falls back to, and for CPU inference at a few choices the chosen experts alone or transformers'
own grouped_mm forward), every layout of the covered families (gate or not, bias, transposed),
empty experts in the backward, and the dtypes the grouped matmul refuses."""

import pytest
import torch

pytest.importorskip("transformers")
from hf_tiny import tiny_model  # noqa: E402

from moe_kernels.integrations import transformers_experts  # noqa: E402

# gate_up + bias + transposed (gpt_oss), gate_up (mixtral, qwen3_moe), up_proj without gate (granitemoe).
LAYOUTS = ["gpt_oss", "mixtral", "qwen3_moe", "granitemoe"]


def experts_of(family, dtype=torch.float32):
    model = tiny_model(family, dtype=dtype)
    layer = model.model.layers[0]
    moe = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
    return moe.experts


def routing(T, E, k, seed=0, skip_experts=()):
    """[T, k] distinct expert ids (never those in skip_experts) and positive weights."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    for e in skip_experts:
        scores[:, e] = -1.0
    w, idx = torch.topk(scores, k)
    return idx, w.softmax(-1)


def eager(experts, x, idx, w):
    experts.config._experts_implementation = "eager"
    try:
        return experts(x, idx, w)
    finally:
        experts.config._experts_implementation = "grouped_mm"


def run_both(experts, x, idx, w, force_padded, monkeypatch):
    if force_padded:
        monkeypatch.setattr(transformers_experts, "_grouped_mm_takes", lambda *a: False)
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outs = [transformers_experts.experts_forward(experts, xs[0], idx, w), eager(experts, xs[1], idx, w)]
    grads = []
    g = torch.randn_like(outs[0])
    for out, xi in zip(outs, xs):
        experts.zero_grad(set_to_none=True)
        out.backward(g)
        grads.append({"x": xi.grad.clone(), **{n: p.grad.clone() for n, p in experts.named_parameters()}})
    return outs, grads


@pytest.mark.parametrize("family", LAYOUTS)
@pytest.mark.parametrize("force_padded", [False, True], ids=["grouped", "padded"])
def test_matches_eager_with_empty_experts(family, force_padded, monkeypatch):
    experts = experts_of(family)
    E = experts.num_experts
    x = torch.randn(13, experts.hidden_dim if hasattr(experts, "hidden_dim") else 64)
    idx, w = routing(13, E, 2, skip_experts=(1, E - 1))  # two experts get no token
    (ours, ref), (g_ours, g_ref) = run_both(experts, x, idx, w, force_padded, monkeypatch)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert g_ours.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g_ours[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    for name, p in experts.named_parameters():  # the empty experts get exactly zero gradient
        if p.dim() >= 2 and p.shape[0] == E:
            assert g_ours[name][1].abs().max() == 0 and g_ours[name][E - 1].abs().max() == 0, name
    # An expanded output gradient (.sum()): torch._grouped_mm's own backward raises on stride-0
    # gradients; unpermute's backward hands it a dense one.
    transformers_experts.experts_forward(experts, x.requires_grad_(), idx, w).sum().backward()


def test_path_choice():
    takes = transformers_experts._grouped_mm_takes
    w = torch.empty(4, 64, 32)
    assert takes(torch.empty(3, 32), w)
    assert takes(torch.empty(3, 32, dtype=torch.bfloat16), w.bfloat16())
    assert not takes(torch.empty(3, 30, dtype=torch.bfloat16), torch.empty(4, 64, 30, dtype=torch.bfloat16))
    assert not takes(torch.empty(3, 32, dtype=torch.float64), w.double())


@pytest.mark.parametrize("T", [13, 100], ids=["transformers_path", "grouped_path"])  # 39, 300 choices
@pytest.mark.parametrize("family", LAYOUTS)
def test_inference_path_matches_eager(family, T):
    experts = experts_of(family)
    E = experts.num_experts
    x = torch.randn(T, 64)
    idx, w = routing(T, E, 3, skip_experts=(0,))
    with torch.no_grad():
        ours = transformers_experts.experts_forward(experts, x, idx, w)
        ref = eager(experts, x, idx, w)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    # transformers' path: our check (its histc would drop them); ours: permute's check.
    few = T * 3 < transformers_experts.FEW_CHOICES
    out_of_range = r"top_k_index must hold expert ids in \[0, 8\)" if few else r"experts values must be in \[-1, 8\)"
    with torch.no_grad(), pytest.raises(ValueError, match=out_of_range):
        transformers_experts.experts_forward(experts, x, idx.masked_fill(idx == 2, E), w)


@pytest.mark.parametrize(
    "dtype, grad, T, path",
    [
        (torch.float64, True, 9, "_forward_padded"),
        (torch.bfloat16, True, 9, "_forward_grouped"),
        (torch.float64, False, 9, "_forward_padded"),
        (torch.bfloat16, False, 9, "_forward_chosen"),
        (torch.bfloat16, False, 160, "_forward_grouped"),
    ],
)
def test_path_by_dtype_and_grad_mode(dtype, grad, T, path, monkeypatch):
    # float64 runs on the padded path, bf16 with 16-byte rows on the grouped one; inference on CPU
    # below FEW_CHOICES (T k = 18 here) is the chosen experts' path (with chosen_linear; else, with
    # more than max(k, E / CHOSEN_SHARE) distinct experts, transformers' own grouped_mm forward),
    # from it and past FEW_ROWS_PER_EXPERT choices an expert (320) ours; each equals eager.
    experts = experts_of("qwen3_moe", dtype=dtype)
    if path == "_forward_chosen" and not transformers_experts._takes_chosen_linear(experts.gate_up_proj, dtype):
        path = "_forward_transformers"
    assert 2 * 160 > transformers_experts.FEW_ROWS_PER_EXPERT * experts.num_experts
    calls = []
    for name in ("_forward_grouped", "_forward_padded", "_forward_transformers", "_forward_chosen"):
        original = getattr(transformers_experts, name)
        monkeypatch.setattr(
            transformers_experts, name, lambda *a, _o=original, _n=name, **kw: calls.append(_n) or _o(*a, **kw)
        )
    x = torch.randn(T, 64, dtype=dtype, requires_grad=grad)
    idx, w = routing(T, experts.num_experts, 2)
    with torch.set_grad_enabled(grad):
        ours = transformers_experts.experts_forward(experts, x, idx, w.to(dtype))
        ref = eager(experts, x, idx, w.to(dtype))
    assert calls == [path]
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours, ref, **tol)


def spy_paths(monkeypatch):
    calls = []
    for name in ("_forward_grouped", "_forward_padded", "_forward_transformers", "_forward_chosen"):
        original = getattr(transformers_experts, name)
        monkeypatch.setattr(
            transformers_experts, name, lambda *a, _o=original, _n=name, **kw: calls.append(_n) or _o(*a, **kw)
        )
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# one token (k distinct experts; one expert twice), three tokens on the same two experts
@pytest.mark.parametrize("index", [[[3, 6]], [[4]], [[7, 0, 5]], [[3, 3]], [[5, 2], [2, 5], [5, 2]]], ids=str)
@pytest.mark.parametrize("family", LAYOUTS)
def test_chosen_experts_path_matches_eager(family, index, dtype, monkeypatch):
    """CPU inference with at most k or E / CHOSEN_SHARE distinct experts (decode): each chosen
    expert's rows through its own weights, equal to eager (the bias, the transposed layout, the gate)."""
    experts = experts_of(family, dtype=dtype)
    idx = torch.tensor(index)
    T, k = idx.shape
    w = torch.rand(T, k, generator=torch.Generator().manual_seed(T)).softmax(-1)
    x = torch.randn(T, 64, dtype=dtype)
    calls = spy_paths(monkeypatch)
    with torch.no_grad():
        ours = transformers_experts.experts_forward(experts, x, idx, w)
        ref = eager(experts, x, idx, w.to(dtype))
    assert calls == ["_forward_chosen"]
    assert ours.dtype == dtype and ours.shape == (T, 64)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours, ref, **tol)


@pytest.mark.parametrize("permute_kernel", [True, False], ids=["permute_kernel", "torch_permute"])
def test_few_choices_path_by_distinct_experts(permute_kernel, monkeypatch):
    """Below FEW_CHOICES without chosen_linear: the chosen experts alone while at most
    max(k, E / CHOSEN_SHARE) distinct ones are chosen; from one more our grouped path where the
    permute kernel runs, else transformers' grouped_mm forward; an out-of-range id is an error on
    all (transformers' histc would drop it), and an empty batch gives an empty result."""
    monkeypatch.setattr(transformers_experts, "_takes_chosen_linear", lambda *a: False)
    kernel = transformers_experts.backends.choose_for("permute", torch.empty(1)) != "torch"
    if permute_kernel and not kernel:
        pytest.skip("no permute kernel (extension not built)")
    if not permute_kernel:
        monkeypatch.setenv("MOE_KERNELS_BACKEND", "torch")
    experts = experts_of("mixtral")
    E = experts.num_experts
    limit = max(2, E // transformers_experts.CHOSEN_SHARE)  # k = 2
    x = torch.randn(4, 64)
    calls = spy_paths(monkeypatch)
    few = torch.tensor([[0, 1], [1, 0], [1, 0], [0, 1]])
    many = torch.tensor([[0, 1], [1, 0], [1, 2], [0, 1]])
    assert few.unique().numel() <= limit < many.unique().numel()
    w = torch.full((4, 2), 0.5)
    with torch.no_grad():
        fallback = "_forward_grouped" if permute_kernel else "_forward_transformers"
        for index, path in ((few, "_forward_chosen"), (many, fallback)):
            calls.clear()
            torch.testing.assert_close(
                transformers_experts.experts_forward(experts, x, index, w), eager(experts, x, index, w)
            )
            assert calls == [path]
            for bad in (-1, E):
                with pytest.raises(ValueError, match=r"top_k_index must hold expert ids in \[0, 8\)"):
                    transformers_experts.experts_forward(experts, x, index.clone().fill_(bad), w)
        empty = transformers_experts.experts_forward(experts, x[:0], few[:0], w[:0])
    assert empty.shape == (0, 64)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_many_distinct_experts_take_chosen_linear(family, monkeypatch):
    """Below FEW_CHOICES with more distinct experts than the torch.mm path takes: the chosen
    experts' path with both projections through chosen_linear, for [E, out, in] weights (Mixtral)
    and transposed [E, in, out] ones (GPT-OSS); equal to eager."""
    if not transformers_experts._extension.has_kernel("chosen_linear", "CPU"):
        pytest.skip("extension not built")
    experts = experts_of(family)
    E = experts.num_experts
    index = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]) % E  # 8 distinct experts, one row each
    assert index.unique().numel() > max(2, E // transformers_experts.CHOSEN_SHARE)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    w = torch.full((4, 2), 0.5)
    calls = spy_paths(monkeypatch)
    takes = []
    original = transformers_experts._takes_chosen_linear
    monkeypatch.setattr(
        transformers_experts, "_takes_chosen_linear", lambda *a: takes.append(original(*a)) or takes[-1]
    )
    kernel = spy_chosen_linear(monkeypatch)
    with torch.no_grad():
        ours = transformers_experts.experts_forward(experts, x, index, w)
        ref = eager(experts, x, index, w)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    assert calls == ["_forward_chosen"]
    # the path test of each weight, then each of the two projections through the kernel
    assert takes == [True] * 2
    assert kernel == [experts.is_transposed] * 2


def spy_chosen_linear(monkeypatch):
    """The `transposed` flag of every chosen_linear call."""
    flags = []
    op = torch.ops.moe_kernels.chosen_linear

    def spy(rows, weight, spans, transposed=False):
        flags.append(transposed)
        return op(rows, weight, spans, transposed)

    monkeypatch.setattr(torch.ops.moe_kernels, "chosen_linear", spy)
    return flags


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_few_rows_per_expert_take_the_chosen_path(family, monkeypatch):
    """From FEW_CHOICES up to FEW_ROWS_PER_EXPERT choices an expert on average, inference takes the
    chosen experts' path where chosen_linear takes the weights (spans longer than
    CHOSEN_LINEAR_ROWS through a torch.mm each), and ours past it; both equal to eager."""
    if not transformers_experts._extension.has_kernel("chosen_linear", "CPU"):
        pytest.skip("extension not built")
    experts = experts_of(family)
    E = experts.num_experts
    monkeypatch.setattr(transformers_experts, "FEW_CHOICES", 4)  # the tiny models have a few experts
    calls = spy_paths(monkeypatch)
    kernel = spy_chosen_linear(monkeypatch)
    per_expert = transformers_experts.FEW_ROWS_PER_EXPERT
    for T, path in ((per_expert * E // 2, "_forward_chosen"), (per_expert * E, "_forward_grouped")):
        calls.clear()
        x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T))
        idx, w = routing(T, E, 2, seed=T)
        idx[:, 0] = 0  # expert 0 on every token: a torch.mm; the others fewer rows: the kernel
        idx[:, 1] = torch.arange(T) % (E - 1) + 1
        limit = T // (E - 1) + 1
        monkeypatch.setattr(transformers_experts, "CHOSEN_LINEAR_ROWS", {torch.float32: limit})
        assert idx[:, 1].bincount().max() <= limit < T
        with torch.no_grad():
            ours = transformers_experts.experts_forward(experts, x, idx, w)
            ref = eager(experts, x, idx, w)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
        assert calls == [path]
    assert kernel == [experts.is_transposed] * 2


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("long_share", ["half", "all"])
def test_chosen_path_groups_its_long_experts(family, long_share, monkeypatch):
    """With at least E / LONG_SHARE experts past CHOSEN_LINEAR_ROWS, the chosen experts' path takes their
    rows (sorted first) through one torch._grouped_mm and the short experts' through chosen_linear;
    with fewer than 1 in KERNEL_SHARE choices left to chosen_linear (all long here), our grouped
    path. Both equal to eager."""
    if not transformers_experts._extension.has_kernel("chosen_linear", "CPU"):
        pytest.skip("extension not built")
    experts = experts_of(family)
    E = experts.num_experts
    T = 4 * E
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(5))
    idx, w = routing(T, E, 2, seed=5)
    counts = idx.reshape(-1).bincount(minlength=E)
    assert (counts > 0).all()

    def split(limit):  # (experts past the limit, share of the choices within it)
        return int((counts > limit).sum()), float(counts[counts <= limit].sum() / counts.sum())

    if long_share == "half":  # the largest limit that leaves enough long experts for the grouped matmul
        limit = max(n for n in counts.tolist() if transformers_experts.LONG_SHARE * split(n)[0] >= E)
        long, short_share = split(limit)
        assert 0 < long < E and short_share * transformers_experts.KERNEL_SHARE >= 1
    else:
        limit = 0
        long, short_share = split(limit)
        assert long == E and short_share == 0
    monkeypatch.setattr(transformers_experts, "CHOSEN_LINEAR_ROWS", {torch.float32: limit})
    calls = spy_paths(monkeypatch)
    kernel = spy_chosen_linear(monkeypatch)
    grouped = []
    original = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: grouped.append(a[0].shape[0]) or original(*a, **kw))
    with torch.no_grad():
        ours = transformers_experts.experts_forward(experts, x, idx, w)
        ref = eager(experts, x, idx, w)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    if long_share == "half":
        assert calls == ["_forward_chosen"]
        assert grouped == [int(counts[counts > limit].sum())] * 2  # the long block's rows, each projection
        assert kernel == [experts.is_transposed] * 2
    else:
        assert calls == ["_forward_grouped"] and kernel == []
