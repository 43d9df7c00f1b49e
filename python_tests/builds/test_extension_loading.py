"""No silent fallback: an extension that exists but does not load is announced, and can be an error.

A copy of the package in a temporary directory stands for each state, imported by a fresh Python
(the extension is loaded once per process): without the .so ("not built": quiet, the reference
runs), and with a .so that does not load (a file that is no shared object, as dlopen sees a build
for another torch: "broken": `import moe_kernels` warns once with the loader's reason). With
MOE_KERNELS_REQUIRE_EXTENSION=1 both are an ImportError at import. backends() says why the ops run
the reference.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import moe_kernels
from moe_kernels import _extension, backends

ROOT = Path(__file__).resolve().parents[2]

# An editable install of the package (make build: pip install -e .) adds a finder after the path
# finder that maps every moe_kernels.* name to the tree it was installed from: it would find that
# tree's _C for the copy. The copy must be the only moe_kernels the subprocess sees.
ONLY_THE_COPY = "import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in repr(f)]; "
SHOW = (
    "import moe_kernels, moe_kernels.ops, moe_kernels._extension as e; import moe_kernels.backends; "
    "print('LOADED', e.LOADED, 'BUILT', e.BUILT); print('WHY', moe_kernels.backends()['load_probabilities']['why'])"
)


def package_copy(tmp_path: Path, so: bytes | None) -> Path:
    """moe_kernels copied under tmp_path without its build; `so`: the bytes of a _C.abi3.so to put
    there (None: no build at all)."""
    shutil.copytree(
        ROOT / "moe_kernels", tmp_path / "moe_kernels", ignore=shutil.ignore_patterns("_C*.so", "__pycache__")
    )
    if so is not None:
        (tmp_path / "moe_kernels" / "_C.abi3.so").write_bytes(so)
    return tmp_path


def run(where: Path, code: str, require: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_KERNELS_REQUIRE_EXTENSION", "MOE_KERNELS_BACKEND")}
    env["PYTHONPATH"] = str(where)
    env.pop("TRITON_INTERPRET", None)
    if require:
        env["MOE_KERNELS_REQUIRE_EXTENSION"] = "1"
    # -W default: every warning shown (as in a script), so "once" is what the package does.
    return subprocess.run(
        [sys.executable, "-W", "default", "-c", ONLY_THE_COPY + code],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_broken_extension_warns_once_with_the_reason(tmp_path):
    where = package_copy(tmp_path, b"not a shared object")
    out = run(where, SHOW, require=False)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("ExtensionWarning") == 1, out.stderr
    warning = out.stderr
    assert f"{where / 'moe_kernels' / '_C.abi3.so'} did not load" in warning
    assert "invalid ELF header" in warning or "too short" in warning, warning  # the loader's own reason
    assert "pure-PyTorch reference" in warning and "pip install --no-build-isolation ." in warning
    assert "MOE_KERNELS_REQUIRE_EXTENSION=1" in warning
    assert "LOADED False BUILT True" in out.stdout
    why = out.stdout.split("WHY ", 1)[1]
    assert why.startswith("cpu: the extension moe_kernels._C did not load (") and "_C.abi3.so" in why, why


def test_broken_extension_is_an_import_error_when_required(tmp_path):
    where = package_copy(tmp_path, b"not a shared object")
    out = run(where, "import moe_kernels", require=True)
    assert out.returncode != 0
    assert "ImportError: moe_kernels: the compiled extension" in out.stderr and "did not load" in out.stderr


def test_unbuilt_tree_runs_the_reference_quietly(tmp_path):
    """A source tree without a build: no warning (nothing is broken), the ops run the reference,
    and backends() says the extension is not built."""
    where = package_copy(tmp_path, None)
    out = run(where, SHOW + "; import torch; moe_kernels.ops.topk_softmax(torch.randn(3, 4), 2)", require=False)
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr
    assert "LOADED False BUILT False" in out.stdout
    assert "cpu: the extension moe_kernels._C did not load (not built: no moe_kernels/_C*.so" in out.stdout


def test_unbuilt_tree_is_an_import_error_when_required(tmp_path):
    where = package_copy(tmp_path, None)
    out = run(where, "import moe_kernels", require=True)
    assert out.returncode != 0
    assert "ImportError: moe_kernels: MOE_KERNELS_REQUIRE_EXTENSION=1 but the extension is not built" in out.stderr


def test_backends_say_why_the_reference_runs(monkeypatch):
    """In this process: every row has "why"; it names each column that runs the reference."""
    summary = moe_kernels.backends()
    for op, row in summary.items():
        columns = [c for c in ("cpu", "cuda", "cpu float64", "cuda float64") if row[c] == "torch"]
        assert bool(row["why"]) == bool(columns), (op, row)
        for column in columns:
            # a float64 column that runs the reference because its device's column does is covered by that one
            covered = column.endswith("float64") and row[column.split()[0]] == "torch"
            assert f"{column}: " in row["why"] or covered, (op, row)
    assert summary["skip_sample"]["why"].startswith("cpu: the op has no kernel")
    if _extension.LOADED and backends.forced() is None:
        assert summary["load_probabilities"]["why"] == "cpu float64: the cpu kernel has no float64 path"
        assert summary["dispatch"]["why"] == ""
    with moe_kernels.use_backend("torch"):
        assert moe_kernels.backends()["dispatch"]["why"].startswith("cpu: forced (use_backend / MOE_KERNELS_BACKEND)")


@pytest.mark.parametrize("loaded, defined, expected", [(False, False, "did not load (boom)"), (True, False, "rebuild")])
def test_why_names_the_extension_state(monkeypatch, loaded, defined, expected):
    """The reasons for the extension's states, without breaking this process's extension."""
    monkeypatch.delenv("MOE_KERNELS_BACKEND", raising=False)
    monkeypatch.setattr(_extension, "LOADED", loaded)
    monkeypatch.setattr(_extension, "LOAD_ERROR", "boom")
    monkeypatch.setattr(_extension, "defines", lambda op: defined)
    assert expected in backends.why_reference("dispatch", "cpu")


def test_extension_flag_matches_the_build():
    """register(..., extension=False) is the only way "why" can tell an op without a kernel from
    one whose kernel is missing: with the extension loaded, every other op defines its kernel."""
    if not _extension.LOADED:
        pytest.skip(f"extension not built: {_extension.LOAD_ERROR}")
    for op, entry in backends._REGISTRY.items():
        assert entry.extension == _extension.defines(op), f"{op}: register(..., extension={_extension.defines(op)})"
