"""`python -m moe_kernels.check [--device cuda] [--ops topk_router ...]`: what a user runs first on a
new machine. Every op on every backend this process can run on the device (the C++ kernels on CPU;
Triton and CUDA on a GPU; opt-in kernels included), against the reference on the same device, on a
few small inputs: exact indices and masks, values and gradients within float32 tolerance. Seconds.
Prints one line per (op, backend); exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import moe_kernels
from moe_kernels import backends, ops

# float32 work against the float32 reference: the kernels' exp / sigmoid may differ by an ulp or two.
ATOL, RTOL = 2e-6, 1e-5


@dataclass
class Case:
    """One call: `make(device, generator)` -> the op's positional args; `call(*args)` runs the public op."""

    op: str
    name: str
    make: Callable[[str, torch.Generator], tuple]
    call: Callable


def _randn(g, *shape, device):
    return torch.randn(*shape, generator=g).to(device)


def _routing(g, T, E, k, device):
    """[T, k] distinct experts (a random top k) and positions for capacity C = T k / E * 1.25."""
    experts = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(device)
    C = ops.capacity_for(T, E, k, 1.25)
    return experts, C


def cases() -> list[Case]:
    out = [
        Case(
            "topk_router",
            "topk_softmax T=257 E=64 k=2",
            lambda d, g: (_randn(g, 257, 64, device=d),),
            lambda x: ops.topk_softmax(x, 2),
        ),
        Case(
            "topk_router",
            "topk_softmax T=100 E=128 k=8 full softmax",
            lambda d, g: (_randn(g, 100, 128, device=d),),
            lambda x: ops.topk_softmax(x, 8, renormalize=False),
        ),
        Case(
            "topk_router",
            "Mixtral E=8 k=2",
            lambda d, g: (_randn(g, 300, 8, device=d),),
            lambda x: ops.topk_router(x, 2, renormalize=True),
        ),
        Case(
            "topk_router",
            "DeepSeek-V3 E=256 k=8 groups 8/4 bias",
            lambda d, g: (_randn(g, 64, 256, device=d), _randn(g, 256, device=d) * 0.1),
            lambda x, b: ops.topk_router(
                x, 8, scoring="sigmoid", bias=b, num_groups=8, topk_groups=4, renormalize=True, scaling_factor=2.5
            ),
        ),
        Case(
            "load_probabilities",
            "T=128 E=16 k=2",
            lambda d, g: (
                _randn(g, 128, 16, device=d),
                _randn(g, 128, 16, device=d),
                torch.rand(128, 16, generator=g).to(d) + 0.1,
            ),
            lambda c, n, s: ops.load_probabilities(c, n, s, 2),
        ),
        Case(
            "batchwise_mask",
            "T=512 E=16 m=64",
            lambda d, g: (_randn(g, 512, 16, device=d),),
            lambda s: ops.batchwise_mask(s, 64),
        ),
        Case("smooth_step", "n=1000", lambda d, g: (_randn(g, 1000, device=d),), lambda t: ops.smooth_step(t, 1.0)),
        Case(
            "dselect_k",
            "B=64 n=20 k=4",
            lambda d, g: (_randn(g, 64, 4, device=d), _randn(g, 64, 4, 5, device=d)),
            lambda a, z: ops.dselect_k(a, z, 20, 1.0),
        ),
        Case("sinkhorn", "T=64 E=8", lambda d, g: (_randn(g, 64, 8, device=d),), lambda x: ops.sinkhorn(x, 20)),
        Case(
            "balanced_assignment",
            "n=48 k=4",
            lambda d, g: (_randn(g, 48, 4, device=d).double(),),
            lambda s: ops.balanced_assignment(s),
        ),
    ]

    def make_positions(d, g, priority=False):
        experts, C = _routing(g, 200, 16, 2, d)
        p = torch.rand(200, 2, generator=g).to(d) if priority else None
        return (experts, C, p)

    out.append(
        Case("capacity_positions", "T=200 E=16 k=2", make_positions, lambda e, C, p: ops.capacity_positions(e, 16, C))
    )
    out.append(
        Case(
            "capacity_positions",
            "T=200 E=16 k=2 priority",
            lambda d, g: make_positions(d, g, priority=True),
            lambda e, C, p: ops.capacity_positions(e, 16, C, priority=p),
        )
    )

    def make_rows(d, g):
        experts, C = _routing(g, 96, 8, 2, d)
        positions, _ = moe_kernels.reference.capacity_positions(experts, 8, C)
        x = _randn(g, 96, 32, device=d)
        w = torch.rand(96, 2, generator=g).to(d)
        return (x, experts, positions, C, w)

    out.append(Case("dispatch", "T=96 d=32 E=8 k=2", make_rows, lambda x, e, p, C, w: ops.dispatch(x, e, p, 8, C)))

    def make_combine(d, g):
        x, experts, positions, C, w = make_rows(d, g)
        return (_randn(g, 8, C, 32, device=d), experts, positions, w)

    out.append(Case("combine", "T=96 d=32 E=8 k=2", make_combine, lambda b, e, p, w: ops.combine(b, e, p, w)))
    out.append(Case("permute", "T=96 d=32 E=8 k=2", make_rows, lambda x, e, p, C, w: ops.permute(x, e, 8)))

    def make_unpermute(d, g):
        x, experts, _, _, w = make_rows(d, g)
        _, _, order = moe_kernels.reference.permute(x, experts, 8)
        return (_randn(g, 96 * 2, 32, device=d), order, w)

    out.append(Case("unpermute", "T=96 d=32 E=8 k=2", make_unpermute, lambda y, o, w: ops.unpermute(y, o, w, 96)))
    return out


def _run(case: Case, backend: str, args: tuple):
    """Outputs and the gradients of a fixed random combination of the floating outputs."""
    xs = [
        a.detach().clone().requires_grad_(a.is_floating_point() and a.dtype != torch.float64)
        if isinstance(a, torch.Tensor)
        else a
        for a in args
    ]
    with moe_kernels.use_backend(backend):
        out = case.call(*xs)
    out = out if isinstance(out, tuple) else (out,)
    floats = [o for o in out if o.is_floating_point() and o.requires_grad]
    wanted = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = []
    if floats and wanted:
        g = torch.Generator().manual_seed(7)
        total = sum((o.float() * torch.randn(o.shape, generator=g).to(o.device)).sum() for o in floats)
        grads = [
            torch.zeros_like(x) if gx is None else gx
            for x, gx in zip(wanted, torch.autograd.grad(total, wanted, allow_unused=True), strict=True)
        ]
    return [o.detach() for o in out], grads


def _compare(got: list, want: list, what: str) -> str | None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{what} {i}: {tuple(a.shape)} {a.dtype}, reference {tuple(b.shape)} {b.dtype}"
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return f"{what} {i}: {int((a != b).sum())} of {a.numel()} entries differ"
        elif not torch.allclose(a.double(), b.double(), atol=ATOL, rtol=RTOL, equal_nan=True):
            return f"{what} {i}: max |difference| {float((a.double() - b.double()).abs().nan_to_num().max()):.3g}"
    return None


def run(device: str = "cpu", only: list[str] | None = None) -> list[dict]:
    """One row per (case, backend): op, case, backend, ok, detail, ms."""
    device_type = torch.device(device).type
    rows = []
    for case in cases():
        if only and case.op not in only:
            continue
        names = [b for b in ("cpu", "triton", "cuda") if backends._available(case.op, b, device_type)]
        for backend in names:
            g = torch.Generator().manual_seed(0)
            args = case.make(device, g)
            start = time.perf_counter()
            try:
                got, got_g = _run(case, backend, args)
                want, want_g = _run(case, "torch", args)
                detail = _compare(got, want, "output") or _compare(got_g, want_g, "gradient")
            except Exception as exc:  # a crash is a failed check, reported like a mismatch
                detail = f"{type(exc).__name__}: {str(exc)[:200]}"
            ms = (time.perf_counter() - start) * 1e3
            rows.append(
                {
                    "op": case.op,
                    "case": case.name,
                    "backend": backend,
                    "ok": detail is None,
                    "detail": detail or "",
                    "ms": ms,
                }
            )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_kernels.check", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ops", nargs="*", help="only these ops")
    args = parser.parse_args(argv)
    rows = run(args.device, args.ops)
    print(
        f"moe_kernels {moe_kernels.__version__ if hasattr(moe_kernels, '__version__') else ''} check on "
        f"{args.device} (torch {torch.__version__}):"
    )
    for r in rows:
        status = "ok  " if r["ok"] else "FAIL"
        print(f"  {status} {r['op']:<20} {r['backend']:<7} {r['case']:<40} {r['ms']:8.1f} ms  {r['detail']}")
    failed = sum(not r["ok"] for r in rows)
    if not rows:
        print(
            "  no kernel backend can run here (the extension did not load, or no kernels for this device):",
            "every op runs the reference; moe_kernels.backends() says which",
        )
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
