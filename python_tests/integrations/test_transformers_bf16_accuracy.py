"""bf16 accuracy of patched models: against the same model in float32, is the patched bf16 model as
close as transformers' own bf16 model? And the experts' weighted sum: float32 products of float32
router weights, rounded once, as transformers' grouped_mm computes it.

The figures (mean |logit error| per family, patched over unpatched) are in docs/routers.md,
"bf16 accuracy"."""

import copy
import types

import pytest
import torch

pytest.importorskip("transformers")
from hf_tiny import FAMILIES, keep_fp32_strict, tiny_model  # noqa: E402

from moe_kernels.integrations import transformers_experts  # noqa: E402
from moe_kernels.integrations.transformers import apply_moe_kernels  # noqa: E402

SEEDS = range(5)
# Two valid bf16 roundings. A tie broken the other way (the lower index here) routes one token
# otherwise, which moves every layer after it: one seed in five read up to 1.16x transformers'
# error (GPT-OSS). The median over the seeds is what a rounding rule changes; measured 0.98-1.01
# (docs/routers.md, "bf16 accuracy").
MEDIAN_WITHIN = 1.03


def bf16_copy(model):
    """The float32 model in bf16, keeping in float32 what from_pretrained would keep there."""
    return keep_fp32_strict(copy.deepcopy(model).to(torch.bfloat16))


def logit_errors(family, seed):
    """(mean |error| of transformers' bf16 logits, of the patched bf16 model's), against float32."""
    model = tiny_model(family, seed=seed)
    # 320 tokens: k >= 2 choices each, past the experts' few-choice path (transformers' own), and
    # few_tokens=False: our router at every size. What is measured is our code.
    ids = torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        reference = model(ids).logits.float()
        bf16 = bf16_copy(model)
        theirs = bf16(ids).logits.float()
        apply_moe_kernels(bf16, few_tokens=False)
        ours = bf16(ids).logits.float()
    return (theirs - reference).abs().mean().item(), (ours - reference).abs().mean().item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_bf16_is_as_close_to_float32_as_transformers(family):
    errors = [logit_errors(family, seed) for seed in SEEDS]
    assert all(theirs > 0 for theirs, _ in errors), f"{family}: bf16 equals float32, nothing measured"
    ratios = sorted(ours / theirs for theirs, ours in errors)
    median = ratios[len(ratios) // 2]
    assert median <= MEDIAN_WITHIN, f"{family}: patched / transformers' bf16 error per seed {ratios}"


def _linear_experts(E, d, d_ff):
    """An experts module of transformers' interface whose arithmetic is exact in bf16: integer
    weights, an identity activation, no gate or bias."""
    gen = torch.Generator().manual_seed(0)
    return types.SimpleNamespace(
        num_experts=E,
        has_gate=False,
        has_bias=False,
        is_transposed=False,
        has_post_expert_norm=False,
        up_proj=torch.randint(-2, 3, (E, d_ff, d), generator=gen).to(torch.bfloat16),
        down_proj=torch.randint(-2, 3, (E, d, d_ff), generator=gen).to(torch.bfloat16),
        act_fn=lambda t: t,
    )


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
# 320 choices: our grouped path in inference too; 1 token of 4 among 16 experts: in inference the
# chosen experts alone (transformers_experts._forward_chosen), a sum of four.
@pytest.mark.parametrize("T, E, k", [(160, 4, 2), (1, 16, 4)], ids=["grouped", "chosen"])
def test_weighted_sum_rounds_once_from_float32_weights(grad, T, E, k, monkeypatch):
    # Expert outputs are exact integers; the weights are float32 values bf16 cannot hold. The sum
    # must be the float32 sum of float32 products, rounded to bf16 once, as transformers' grouped_mm
    # computes it: a 16-bit index_add (rounding at each add) and weights rounded to bf16 first
    # missed it.
    d, d_ff = 16, 8
    experts_module = _linear_experts(E, d, d_ff)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (T, d), generator=gen).to(torch.bfloat16).requires_grad_(grad)
    index = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    chosen = []
    original = transformers_experts._forward_chosen
    monkeypatch.setattr(transformers_experts, "_forward_chosen", lambda *a: chosen.append(1) or original(*a))
    with torch.set_grad_enabled(grad):  # inference: grad mode off, as generate runs
        y = transformers_experts.experts_forward(experts_module, x, index, weights)
    assert bool(chosen) == (T == 1 and not grad), "the path this case is for"
    xf = x.detach().float()
    outputs = torch.stack(  # [T, k, d]: each choice's expert output, exact in float32
        [
            torch.einsum(
                "tf,tdf->td",
                torch.einsum("td,tfd->tf", xf, experts_module.up_proj[index[:, s]].float()),
                experts_module.down_proj[index[:, s]].float(),
            )
            for s in range(k)
        ],
        dim=1,
    )
    expected = (outputs * weights.unsqueeze(-1)).sum(1).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y.detach(), expected), (y.detach().float() - expected.float()).abs().max()
