"""Backends under test.

The suite runs twice (see the Makefile's `test` target):
  1. normally: the "torch" and "cpu" backends, the Triton ahead-of-time compiles, nvcc;
  2. under TRITON_INTERPRET=1 with `-m triton`: the Triton kernels on CPU tensors.
TRITON_INTERPRET must be set before triton decorates a kernel, hence a separate process.

The device axis (python_tests/support/devices.py): tests taking `backend` also run with the GPU backends
"cuda:cuda" and "cuda:triton" on CUDA tensors, skipped with the reason where no GPU is present
(`pytest -rs` lists them). `kernel_backend` tests (opcheck, torch.compile) stay on CPU backends:
they name the registered op directly; the CUDA registrations are checked by `make check-cuda-build`.

The shared helpers (devices, shapes, tolerances, ...) are in python_tests/support/, which
pyproject.toml's `pythonpath` puts on sys.path: tests import them by their bare names.
"""

import atexit
import hashlib
import os
import shutil
import sys
import tempfile

# A fresh inductor cache per run unless the caller chose one: the AOT autograd cache keyed a compiled
# backward by the forward graph, not by the Python backward an extension op registers, so a run
# replayed a backward compiled against an earlier build's schema (topk_router_backward before its
# ranked_by_logits argument) and the call failed. Set before anything imports torch: inductor's
# cache_dir() writes its default into the environment when first asked.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="moe_kernels_inductor_")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)

import interpreter_device_calls
import interpreter_dtypes
import interpreter_reductions
import poisoned_empty
import pytest
from collection import COLLECTED
from devices import Backend, gpu_params, redirect
from instafail import instafail_text

from moe_kernels import _extension, backends

INTERPRETING = backends.triton_interpreting()
if INTERPRETING:
    interpreter_device_calls.install()  # the interpreter's no-op repatching skipped (see there)
    interpreter_reductions.install()  # bitwise and max combines in numpy, not element by element (see there)
    interpreter_dtypes.install()  # numpy dtypes of Triton types from a table built once (see there)


def kernel_backends():
    """The non-reference backends that can run on CPU tensors in this process."""
    if INTERPRETING:
        return ["triton"] if backends.triton_importable() else []
    return ["cpu"] if _extension.LOADED else []


def all_backends():
    return (["torch"] if not INTERPRETING else []) + kernel_backends()


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        cpu = [pytest.param(Backend(b), id=Backend(b).id) for b in all_backends()]
        metafunc.parametrize("backend", cpu + gpu_params(INTERPRETING))
    if "kernel_backend" in metafunc.fixturenames:
        metafunc.parametrize("kernel_backend", kernel_backends())


@pytest.fixture(autouse=True)
def _restore_threads():
    """A test (or an example it runs in-process, e.g. kool_toy's set_num_threads(1)) that changes
    torch's intra-op thread count must not change it for the tests after it."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _junk_in_empty(monkeypatch):
    """In the interpreter pass, uninitialised CPU allocations hold junk (poisoned_empty.py): an
    output entry a Triton kernel leaves unwritten fails the test here, not by chance on a GPU."""
    if INTERPRETING:
        poisoned_empty.poison(monkeypatch)
    yield


@pytest.fixture(autouse=True)
def _device_axis(request, monkeypatch):
    """GPU cases of `backend`: run the test's ops on the backend's device (devices.redirect)."""
    callspec = getattr(request.node, "callspec", None)
    backend = callspec.params.get("backend") if callspec is not None else None
    if isinstance(backend, Backend):
        with redirect(backend, monkeypatch):
            yield
    else:
        yield


def pytest_collection_modifyitems(config, items):
    _mark_backends(items)
    _keep_shard(config, items)


def _keep_shard(config, items):
    """MOE_KERNELS_TEST_SHARD=i/n: keeps every n-th test from the i-th (0-based) in collection
    order, so n processes run one pass between them, each its fixed part (run_shards.py shares
    the tests out as they go instead: pytest_runtestloop below). Every collected test stays in
    config.stash[COLLECTED], for the tests of the collection itself."""
    config.stash[COLLECTED] = list(items)
    shard = os.environ.get("MOE_KERNELS_TEST_SHARD")
    if not shard or os.environ.get("MOE_KERNELS_TEST_CLAIMS"):
        return
    i, n = (int(v) for v in shard.split("/"))
    if not 0 <= i < n:
        raise pytest.UsageError(f"MOE_KERNELS_TEST_SHARD={shard}: expected i/n with 0 <= i < n")
    kept = items[i::n]
    deselected = [item for j, item in enumerate(items) if j % n != i]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = kept


def claim(claims_dir: str, start: int, count: int) -> int | None:
    """The first test index from `start` that no process has claimed yet, now claimed by this
    one (a file created exclusively in claims_dir: one process wins each index), or None."""
    for j in range(start, count):
        try:
            os.close(os.open(os.path.join(claims_dir, str(j)), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        return j
    return None


def pytest_runtestloop(session):
    """MOE_KERNELS_TEST_CLAIMS=<dir> (run_shards.py): processes that collected the same tests
    share them out as they go, each running the next test none has claimed, so the slow tests
    do not pile up in one process. A process claims its next test before running the current
    one: pytest tears a test's fixtures down by the test that follows it. Elsewhere pytest's
    own loop runs."""
    claims_dir = os.environ.get("MOE_KERNELS_TEST_CLAIMS")
    if not claims_dir or session.config.option.collectonly:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} error(s) during collection")
    items = session.items
    # run_shards.py checks that every process collected the same tests, and that each was run.
    ids = "\n".join(item.nodeid for item in items).encode()
    with open(os.path.join(claims_dir, f"collected-{hashlib.sha1(ids).hexdigest()}"), "w") as f:
        f.write(str(len(items)))
    i = claim(claims_dir, 0, len(items))
    while i is not None:
        following = claim(claims_dir, i + 1, len(items))
        items[i].config.hook.pytest_runtest_protocol(
            item=items[i], nextitem=items[following] if following is not None else None
        )
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
        i = following
    return True


def _mark_backends(items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("backend") if callspec is not None else None
        if isinstance(backend, Backend) and backend.device != "cpu":
            # The GPU cases: what `make gpu-check` runs (`pytest -m gpu`), never the interpreter pass.
            item.add_marker(pytest.mark.gpu)
        elif callspec is not None and "triton" in (backend, callspec.params.get("kernel_backend")):
            item.add_marker(pytest.mark.triton)


def pytest_configure(config):
    config.addinivalue_line("markers", "triton: runs a Triton kernel (needs TRITON_INTERPRET=1 on CPU)")
    config.addinivalue_line("markers", "gpu: runs on a CUDA device (make gpu-check runs `pytest -m gpu`)")
    config.addinivalue_line("markers", "slow: long-running (paper reproductions)")
    config.addinivalue_line("markers", "fuzz: property-based fuzzing against the reference (ops/test_fuzz.py)")
    config.addinivalue_line(
        "markers",
        "torch_free: the same on every torch (nvcc on the .cu files and g++ on the instruction-set builds, "
        "which include no torch header; not Triton's compiles: test-newest installs the newest torch's triton); "
        "make test-newest leaves these to make test",
    )


def pytest_runtest_logreport(report):
    """MOE_KERNELS_INSTAFAIL=1 (make gpu-check): a failure's traceback is printed as it happens, so a
    run stopped at its time limit still says why its failures failed (pytest prints them at the end)."""
    if report.failed and os.environ.get("MOE_KERNELS_INSTAFAIL") == "1":
        sys.stdout.write(f"\n[instafail] {report.nodeid} ({report.when})\n{instafail_text(report.longreprtext)}\n")
        sys.stdout.flush()
