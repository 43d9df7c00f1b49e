"""Drop moe_kernels into a transformers MoE model: build a tiny model from its config (random
weights; nothing is downloaded), patch it, check it computes the same thing, and time it.

    .venv/bin/python examples/transformers_drop_in.py [--family mixtral] [--tokens 2048]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests" / "support"))
from hf_tiny import GENERATES, tiny_model  # noqa: E402  (the test suite's tiny configs)

from moe_kernels.integrations.transformers import apply_moe_kernels  # noqa: E402


def seconds(fn, repeats):
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="mixtral", choices=sorted(GENERATES))
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per forward (one sequence)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model = tiny_model(args.family)
    ids = torch.randint(0, 128, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits
        before = seconds(lambda: model(ids), args.repeats)
        prompt = ids[:, :8]
        greedy = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)

        report = apply_moe_kernels(model)
        print(f"patched: {report['patched']}")
        print(f"skipped: {report['skipped']}")
        print(f"experts implementation: {report['experts']}")

        patched = model(ids).logits
        after = seconds(lambda: model(ids), args.repeats)
        error = ((patched - reference).abs().max() / reference.abs().max()).item()
        assert error < 1e-5, error
        print(f"same logits: max relative difference {error:.1e}")
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0), greedy)
        print("same greedy tokens")
    print(f"forward of the whole tiny model, {args.tokens} tokens: {before * 1e3:.1f} ms -> {after * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
