"""bench/gpu_report.py's report writer on fake timings and fake device properties (the report
itself needs a GPU: `make gpu-report`)."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_report():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "bench" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# An H100 SXM as torch reports it: 2619 MHz HBM3 clock, 5120-bit bus -> 3352 GB/s.
H100 = SimpleNamespace(
    name="NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=85 * 2**30,
    memory_clock_rate=2_619_000,
    memory_bus_width=5120,
)


def test_peak_bandwidth_from_properties(gpu_report):
    assert gpu_report.peak_bandwidth(H100) == pytest.approx(3352.32e9)
    assert gpu_report.peak_bandwidth(SimpleNamespace(name="x")) is None


def test_report_on_fake_timings(gpu_report, tmp_path):
    rows = [
        {
            "op": "topk_softmax",
            "provider": "moe_kernels",
            "mode": "forward",
            "config": "T=65536 E=64 k=2",
            "median_ms": "0.02",
            "gb_per_s": "1676.16",
        },
        {
            "op": "topk_softmax",
            "provider": "torch sequence",
            "mode": "forward",
            "config": "T=65536 E=64 k=2",
            "median_ms": "0.05",
            "gb_per_s": "670.4",
        },
        {
            "op": "topk_softmax",
            "provider": "moe_kernels",
            "mode": "fwd+bwd",
            "config": "T=65536 E=64 k=2",
            "median_ms": "0.06",
            "gb_per_s": "",
        },  # no byte count: not in the bandwidth table
    ]
    tables = {"topk_softmax": "# topk_softmax\n\n| mode | config | speed-up of moe_kernels vs torch sequence |\n"}
    path = gpu_report.write_report(H100, rows, tables, "1100 passed, 3 skipped", ["bench_x.py"], tmp_path)
    assert path == tmp_path / "gpu-nvidia-h100-80gb-hbm3.md"
    text = path.read_text()
    assert "peak memory bandwidth 3352 GB/s" in text and "1100 passed" in text
    assert "| topk_softmax | moe_kernels | forward | T=65536 E=64 k=2 | 0.0200 | 1676.2 | 50.0% |" in text
    assert "| 670.4 | 20.0% |" in text and "fwd+bwd" not in text.split("## topk_softmax")[0]
    assert "speed-up of moe_kernels vs torch sequence" in text and "bench_x.py" in text


def test_unknown_bandwidth_is_said(gpu_report, tmp_path):
    props = SimpleNamespace(name="Some GPU", major=12, minor=0, multi_processor_count=1, total_memory=2**30)
    text = gpu_report.write_report(props, [], {}, "ok", [], tmp_path).read_text()
    assert "unknown" in text and (tmp_path / "gpu-some-gpu.md").exists()
