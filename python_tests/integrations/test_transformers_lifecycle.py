"""A patched transformers model through its lifecycle: torch.save / torch.load, pickle and deepcopy
(in this process and in a fresh one), .to(dtype) after patching, the meta device, and padded
batches through generate."""

import copy
import io
import pickle
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
from hf_tiny import GENERATES, tiny_config, tiny_model  # noqa: E402

from moe_kernels.integrations.transformers import apply_moe_kernels, remove_moe_kernels  # noqa: E402

FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"]


def tokens(seed=0, shape=(2, 12)):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def patched_routers(model):
    return [m for m in model.modules() if "_moe_kernels_code" in vars(m)]


def torch_save_load(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # a whole module is not weights-only


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "how",
    [torch_save_load, lambda m: pickle.loads(pickle.dumps(m)), copy.deepcopy],
    ids=["torch.save", "pickle", "deepcopy"],
)
def test_saved_whole_model_stays_patched(family, how):
    model = tiny_model(family)
    before = model.get_experts_implementation()
    apply_moe_kernels(model, few_tokens=False)
    ids = tokens()
    with torch.no_grad():
        ref = model(ids).logits
    loaded = how(model)
    assert len(patched_routers(loaded)) == len(patched_routers(model)) > 0
    assert loaded.config._experts_implementation == "moe_kernels"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    remove_moe_kernels(loaded)
    assert not patched_routers(loaded) and loaded.get_experts_implementation() == before
    assert len(patched_routers(model)) > 0  # the original is untouched


def test_torch_load_in_a_fresh_process(tmp_path):
    # The process that loads never patched a model: unpickling registers the experts implementation.
    model = tiny_model("qwen3_moe")
    apply_moe_kernels(model, few_tokens=False)
    ids = tokens()
    with torch.no_grad():
        torch.save((ids, model(ids).logits), tmp_path / "reference.pt")
    torch.save(model, tmp_path / "model.pt")
    # The same intra-op thread count as this process: the logits are compared bit for bit, and a
    # matmul's reduction order follows the thread count.
    code = f"""
import torch
torch.set_num_threads({torch.get_num_threads()})
model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
ids, ref = torch.load({str(tmp_path / "reference.pt")!r})
assert model.config._experts_implementation == "moe_kernels"
with torch.no_grad():
    assert torch.equal(model(ids).logits, ref)
print("same logits")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0 and "same logits" in run.stdout, run.stdout + run.stderr[-3000:]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float64, 1e-6), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)],
    ids=["float64", "bf16", "fp16"],
)
def test_to_dtype_after_patching(family, dtype, tol):
    # Against the unpatched model cast alike, on transformers' eager experts loop (its default
    # grouped_mm refuses float64). float64: transformers routes some families in float32, hence 1e-6.
    ref_model, model = tiny_model(family), tiny_model(family)
    apply_moe_kernels(model, few_tokens=False)
    ref_model.to(dtype).set_experts_implementation("eager")
    model.to(dtype)
    ids = tokens()
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            out, ref = model(ids).logits, ref_model(ids).logits
        assert out.dtype == dtype
        assert relative_error(out.double(), ref.double()) < tol, grad
    if dtype == torch.float64:
        out.square().mean().backward()
        ref.square().mean().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                assert relative_error(p.grad, q.grad) < 1e-5, name


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_device(family):
    # Moved to meta after patching, and built on meta then patched: forward (and backward) give
    # meta tensors of the right shape; nothing reads a value.
    import transformers

    model = tiny_model(family)
    apply_moe_kernels(model, few_tokens=False)
    model.to("meta")
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(tiny_config(family))
    apply_moe_kernels(built, few_tokens=False)
    ids = tokens().to("meta")
    for m in (model, built):
        with torch.no_grad():
            logits = m(ids).logits
        assert logits.device.type == "meta" and logits.shape == (2, 12, 128)
        m(ids).logits.sum().backward()
        assert all(p.grad is None or p.grad.device.type == "meta" for p in m.parameters())


@pytest.mark.parametrize("family", GENERATES)
def test_padded_batch_generate(family):
    # A left-padded batch with its attention mask: the same greedy tokens as the unpatched model.
    model = tiny_model(family, seed=1)
    ids = torch.randint(1, 128, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, pad in ((0, 3), (2, 1)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        apply_moe_kernels(model, few_tokens=False)
        out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
