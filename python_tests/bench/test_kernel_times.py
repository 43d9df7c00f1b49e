"""moe_kernels.bench.kernel_times (gpu_bench's `kernels` column): the names it shortens, the summary
it writes, and a profile on CPU tensors (the CPU's operators: the same code as a GPU run's)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from moe_kernels.bench import kernel_times as kt
from moe_kernels.bench.kernel_times import KernelTime, kernel_times, short_name, summary
from python_tests.bench.test_gpu_check import load

GATHER = "void moe_kernels::(anonymous namespace)::gather_rows<__nv_bfloat16, 8>(__nv_bfloat16 const*, long*)"
SCAN = "void cub::CUB_NS::DeviceScanKernel<cub::Policy<long, std::plus<long> >::P900, long*>(long const*, int)"
FILL = (
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
    "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)"
)
# A lambda's parameter list inside the template arguments, and a parameter list inside them.
COPY = (
    "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
    "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
    "{lambda(float)#1}>(at::TensorIteratorBase&, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
    "::{lambda()#3} const&)::{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<float>::{lambda(int)#1})"
)


@pytest.mark.parametrize(
    "name, short",
    [
        (GATHER, "gather_rows"),
        (FILL, "vectorized_elementwise_kernel"),
        (COPY, "elementwise_kernel"),
        (SCAN, "DeviceScanKernel"),
        ("moe_kernels::topk_router_kernel(float const*, int)", "topk_router_kernel"),
        ("topk_router_kernel", "topk_router_kernel"),  # Triton's: as it is
        ("aten::mm", "aten::mm"),
        ("Memset (Device)", "Memset (Device)"),  # a label in parentheses, not parameters
        ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD (Device -> Device)"),
        ("void ns::apply<ns::F<a->b>, 2>(int)", "apply"),  # an arrow closes no template bracket
    ],
)
def test_short_name(name, short):
    assert short_name(name) == short


def test_summary_shares_launches_and_the_rest():
    times = [KernelTime("a", 3.0, 1), KernelTime("b", 1.0, 2), KernelTime("c", 0.5, 1), KernelTime("d", 0.5, 1)]
    assert summary(times, top=2) == "5.0000 ms: a 3.0000 (60%), b 1.0000 (20%) x2, 2 other 1.0000 (20%)"
    assert summary(times) == "5.0000 ms: a 3.0000 (60%), b 1.0000 (20%) x2, c 0.5000 (10%), d 0.5000 (10%)"
    assert summary([]) == "no kernels recorded"


def test_cpu_profile_finds_the_operators_of_a_call():
    x = torch.randn(128, 128)
    times = kernel_times(lambda: (x @ x).relu_(), device="cpu", calls=3)
    names = [t.name for t in times]
    assert "aten::mm" in names and "aten::relu_" in names, names
    assert [t.ms for t in times] == sorted((t.ms for t in times), reverse=True)
    mm = next(t for t in times if t.name == "aten::mm")
    assert mm.launches == 1  # averaged over the profiled calls, the unprofiled first one left out
    assert summary(times).endswith(")") and "aten::mm" in summary(times)


def test_gpu_profile_counts_device_events_once(monkeypatch):
    """The CUDA branch on a recorded profile (no GPU here): only device events count (a launch on
    the host carries its kernel's time again), kernels of one short name add up, times and
    launches are a call's (three calls profiled)."""

    def event(key, device_us, count, device_type=DeviceType.CUDA):
        return SimpleNamespace(
            key=key, self_device_time_total=device_us, self_cpu_time_total=5.0, count=count, device_type=device_type
        )

    events = [
        event(FILL, 30.0, 3),
        event(FILL.replace("FillFunctor<float>", "FillFunctor<double>"), 60.0, 3),  # the same short name
        event(COPY, 15.0, 3),
        event("topk_router_kernel", 300.0, 3),
        event("Memset (Device)", 3.0, 3),
        event("cudaLaunchKernel", 408.0, 15, DeviceType.CPU),
        event("cudaDeviceSynchronize", 0.0, 1, DeviceType.CPU),
    ]
    asked = []

    @contextlib.contextmanager
    def recorded(activities):
        asked.append(activities)
        yield SimpleNamespace(key_averages=lambda: events)

    monkeypatch.setattr(kt, "profile", recorded)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    times = kernel_times(lambda: calls.append(1), device="cuda", calls=3)
    assert asked == [[kt.ProfilerActivity.CUDA]] and len(calls) == 4  # one unprofiled call first
    assert [(t.name, round(t.ms, 9), t.launches) for t in times] == [
        ("topk_router_kernel", 0.1, 1),
        ("vectorized_elementwise_kernel", 0.03, 2),
        ("elementwise_kernel", 0.005, 1),
        ("Memset (Device)", 0.001, 1),
    ]


def test_gpu_bench_markdown_lists_where_the_time_goes():
    gpu_bench = load("gpu_bench")
    row = dict.fromkeys(gpu_bench.COLUMNS, "")
    row.update(op="dispatch", config="fwd T=8", backend="triton", ms="0.0100", gbps="1.0", copy_gbps="2.0")
    row.update(vs_torch="3.00", method="graph", kernels="0.0100 ms: scatter_rows_kernel 0.0100 (100%)")
    text = gpu_bench.markdown([row, dict(row, backend="cuda", kernels="")], "test")
    assert "### Where the time goes" in text
    assert "- dispatch fwd T=8 [triton]: 0.0100 ms: scatter_rows_kernel 0.0100 (100%)" in text
    assert "[cuda]" not in text  # a row without a profile lists nothing
    assert "### Where" not in gpu_bench.markdown([dict(row, kernels="")], "test")
