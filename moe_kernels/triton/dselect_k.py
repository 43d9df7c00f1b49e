"""Fused DSelect-k gate in Triton (003_a1a58754fcb6a991.txt, eq 6): a tile of BLOCK_B rows x all
2^m selector entries per program; softmax(alpha), the k selectors r(S(z_i)) and their weighted
sum stay in registers. The backward recomputes them (no activations saved)."""

import torch
import triton
import triton.language as tl

from moe_kernels.triton.common import on_tensor_device, row_tile_config, to_float32
from moe_kernels.triton.smooth_step import _params, smooth_step_chain, smooth_step_value

# 2^m selector entries of BLOCK_B rows in registers: at most 1024 per program and 8 per thread in
# the forward; 512 and 4 in the backward, which holds more tiles (grad_gates, the selector, u and
# u at the flipped entries): 1024 entries per program spilled under ptxas for n = 256 on sm_80 or
# sm_90 whatever the warp count (the AOT test checks).
MAX_EXPERTS = 1024
_TILE = 1024
_PER_THREAD = 8
_TILE_BACKWARD = 512
_PER_THREAD_BACKWARD = 4


@triton.jit
def _softmax_rows(alpha_ptr, rows, row_ok, ks, K):
    """softmax(alpha_b) [BLOCK_B, BLOCK_K] in float32 (padding columns 0)."""
    a = to_float32(
        tl.load(
            alpha_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
            mask=row_ok[:, None] & (ks[None, :] < K),
            other=float("-inf"),
        )
    )
    e = tl.exp(a - tl.max(a, axis=1)[:, None])
    return e / tl.sum(e, axis=1)[:, None]


@triton.jit
def _column(x, ks, i):
    """Column i of a [BLOCK_B, BLOCK_K] tile, as [BLOCK_B]."""
    return tl.sum(tl.where(ks[None, :] == i, x, 0.0), axis=1)


@triton.jit
def _factor(z_ptr, base, row_ok, ls, j, half, c1, c3):
    """Factor of bit j in every selector entry: S(z_bij) where bit j of l is set, else 1 - S(z_bij)."""
    s = smooth_step_value(to_float32(tl.load(z_ptr + base + j, mask=row_ok, other=0.0)), half, c1, c3)
    return tl.where((((ls >> j) & 1) == 1)[None, :], s[:, None], 1.0 - s[:, None])


@triton.jit
def _selector(z_ptr, rows, row_ok, ls, i, K, M: tl.constexpr, half, c1, c3):
    """r(S(z_bi)) [BLOCK_B, BLOCK_L] of eq 4 (M = log2(BLOCK_L) is constant: the loop unrolls)."""
    r = tl.full((rows.shape[0], ls.shape[0]), 1.0, tl.float32)
    base = (rows.to(tl.int64) * K + i) * M
    for j in tl.static_range(M):
        r = r * _factor(z_ptr, base, row_ok, ls, j, half, c1, c3)
    return r


@triton.jit
def dselect_k_kernel(
    alpha_ptr,  # [B, K] contiguous fp32/fp16/bf16
    z_ptr,  # [B, K, M] contiguous, alpha's dtype
    gates_ptr,  # [B, N] contiguous, alpha's dtype
    sel_ptr,  # [B, K, BLOCK_L] contiguous (written only if RETURN_SELECTORS)
    B,  # rows
    K,  # selectors
    M: tl.constexpr,  # bits, BLOCK_L = 2^M
    N,  # experts, 2^(M-1) < N <= 2^M
    half,  # gamma / 2
    c1,  # 3 / (2 gamma)
    c3,  # 2 / gamma^3
    RETURN_SELECTORS: tl.constexpr,
    BLOCK_B: tl.constexpr,  # rows per program
    BLOCK_K: tl.constexpr,  # next power of two >= K
    BLOCK_L: tl.constexpr,  # 2^M
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    ks = tl.arange(0, BLOCK_K)
    ls = tl.arange(0, BLOCK_L)
    p = _softmax_rows(alpha_ptr, rows, row_ok, ks, K)
    acc = tl.zeros((BLOCK_B, BLOCK_L), tl.float32)
    for i in range(0, K):
        r = _selector(z_ptr, rows, row_ok, ls, i, K, M, half, c1, c3)
        acc += _column(p, ks, i)[:, None] * r
        if RETURN_SELECTORS:
            out = (rows[:, None].to(tl.int64) * K + i) * BLOCK_L + ls[None, :]
            tl.store(sel_ptr + out, r.to(sel_ptr.dtype.element_ty), mask=row_ok[:, None])
    out = rows[:, None].to(tl.int64) * N + ls[None, :]
    tl.store(gates_ptr + out, acc.to(gates_ptr.dtype.element_ty), mask=row_ok[:, None] & (ls[None, :] < N))


@triton.jit
def dselect_k_backward_kernel(
    grad_gates_ptr,  # [B, N] contiguous float32
    grad_sel_ptr,  # [B, K, BLOCK_L] contiguous float32 (read only if HAS_GRAD_SELECTORS)
    alpha_ptr,  # [B, K] contiguous
    z_ptr,  # [B, K, M] contiguous
    grad_alpha_ptr,  # [B, K] contiguous, alpha's dtype
    grad_z_ptr,  # [B, K, M] contiguous, alpha's dtype
    B,
    K,
    M: tl.constexpr,
    N,
    half,
    c1,
    c3,
    HAS_GRAD_SELECTORS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_ok = rows < B
    ks = tl.arange(0, BLOCK_K)
    ls = tl.arange(0, BLOCK_L)
    p = _softmax_rows(alpha_ptr, rows, row_ok, ks, K)
    g = tl.load(
        grad_gates_ptr + rows[:, None].to(tl.int64) * N + ls[None, :],
        mask=row_ok[:, None] & (ls[None, :] < N),
        other=0.0,
    )
    # d alpha_i = p_i (c_i - sum p c), c_i = <grad_gates, r_i>.
    c = tl.zeros((BLOCK_B, BLOCK_K), tl.float32)
    for i in range(0, K):
        r = _selector(z_ptr, rows, row_ok, ls, i, K, M, half, c1, c3)
        c = tl.where(ks[None, :] == i, tl.sum(g * r, axis=1)[:, None], c)
    grad_alpha = p * (c - tl.sum(p * c, axis=1)[:, None])
    out = rows[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(
        grad_alpha_ptr + out, grad_alpha.to(grad_alpha_ptr.dtype.element_ty), mask=row_ok[:, None] & (ks[None, :] < K)
    )
    # d z_ij = S'(z_ij) sum_l u_il (+1 if bit j of l else -1) prod_{j' != j} factor_j'(l),
    # u_il = d loss / d r_il = p_i grad_gates_l + grad_selectors_il.
    # Entries l and l ^ 2^j differ only in bit j, whose factors (s, 1 - s) sum to 1, so
    # prod_{j' != j} factor_j'(l) = r_il + r_i(l ^ 2^j); re-indexing the second sum gives
    #   sum_l sign_j(l) r_il (u_il - u_i(l ^ 2^j)),
    # one selector per i and u reloaded at the flipped entries: O(M) tiles per selector instead of
    # the M^2 products of a factor-by-factor product (which made ptxas spill under triton 3.7.1).
    for i in range(0, K):
        p_i = _column(p, ks, i)[:, None]
        r = _selector(z_ptr, rows, row_ok, ls, i, K, M, half, c1, c3)
        u = _upstream(grad_gates_ptr, grad_sel_ptr, rows, row_ok, ls, p_i, i, K, N, HAS_GRAD_SELECTORS, BLOCK_L)
        base = (rows.to(tl.int64) * K + i) * M
        for j in tl.static_range(M):
            flipped = ls ^ (1 << j)
            u_flipped = _upstream(
                grad_gates_ptr, grad_sel_ptr, rows, row_ok, flipped, p_i, i, K, N, HAS_GRAD_SELECTORS, BLOCK_L
            )
            sign = tl.where(((ls >> j) & 1) == 1, 1.0, -1.0)
            ds = tl.sum(sign[None, :] * r * (u - u_flipped), axis=1)
            zj = to_float32(tl.load(z_ptr + base + j, mask=row_ok, other=0.0))
            dz = smooth_step_chain(ds, zj, half, c1, c3)
            tl.store(grad_z_ptr + base + j, dz.to(grad_z_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _upstream(grad_gates_ptr, grad_sel_ptr, rows, row_ok, ls, p_i, i, K, N, HAS_GRAD_SELECTORS: tl.constexpr, BLOCK_L):
    """u_il = p_i grad_gates_l + grad_selectors_il [BLOCK_B, BLOCK_L] at entries `ls` (grad_gates is
    0 past N: padding entries get no gate gradient)."""
    g = tl.load(
        grad_gates_ptr + rows[:, None].to(tl.int64) * N + ls[None, :],
        mask=row_ok[:, None] & (ls[None, :] < N),
        other=0.0,
    )
    u = p_i * g
    if HAS_GRAD_SELECTORS:
        sel = (rows[:, None].to(tl.int64) * K + i) * BLOCK_L + ls[None, :]
        u += tl.load(grad_sel_ptr + sel, mask=row_ok[:, None], other=0.0)
    return u


def launch_config(num_rows: int, num_selector_entries: int, backward: bool = False):
    """(grid, BLOCK_B, num_warps) for num_rows rows of 2^m selector entries."""
    tile, per_thread = (_TILE_BACKWARD, _PER_THREAD_BACKWARD) if backward else (_TILE, _PER_THREAD)
    grid, block_b, _, num_warps = row_tile_config(num_rows, num_selector_entries, tile, per_thread)
    return grid, block_b, num_warps


def supports(num_experts: int) -> bool:
    """Whether the kernel takes this size; past it moe_kernels.ops.dselect_k asks
    backends.fallback (the reference: dselect_k has no CUDA kernel) and the raw op raises."""
    return num_experts <= MAX_EXPERTS


def _check_size(num_experts: int):
    if not supports(num_experts):
        raise ValueError(
            f"dselect_k: the Triton kernel supports at most {MAX_EXPERTS} experts, got {num_experts}; "
            "use MOE_KERNELS_BACKEND=cpu or torch"
        )


@torch.library.custom_op("moe_kernels_triton::dselect_k", mutates_args=())
@on_tensor_device
def dselect_k(
    alpha: torch.Tensor, z: torch.Tensor, num_experts: int, gamma: float, return_selectors: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launch on alpha [B, k], z [B, k, m] (validated by moe_kernels.ops.dselect_k).
    Returns gates [B, n] and selectors [B, k, 2^m] (or [B, k, 0] if not return_selectors)."""
    _check_size(num_experts)
    B, k, m = z.shape
    L = 1 << m
    a, zc = alpha.contiguous(), z.contiguous()
    gates = a.new_empty((B, num_experts))
    sel = a.new_empty((B, k, L if return_selectors else 0))
    if B > 0:
        grid, block_b, num_warps = launch_config(B, L)
        dselect_k_kernel[grid](
            a,
            zc,
            gates,
            sel if return_selectors else gates,
            B,
            k,
            m,
            num_experts,
            *_params(gamma),
            RETURN_SELECTORS=return_selectors,
            BLOCK_B=block_b,
            BLOCK_K=triton.next_power_of_2(k),
            BLOCK_L=L,
            num_warps=num_warps,
        )
    return gates, sel


@dselect_k.register_fake
def _(alpha, z, num_experts, gamma, return_selectors):
    B, k, m = z.shape
    return alpha.new_empty((B, num_experts)), alpha.new_empty((B, k, (1 << m) if return_selectors else 0))


@torch.library.custom_op("moe_kernels_triton::dselect_k_backward", mutates_args=())
@on_tensor_device
def dselect_k_backward(
    grad_gates: torch.Tensor,
    grad_selectors: torch.Tensor | None,
    alpha: torch.Tensor,
    z: torch.Tensor,
    num_experts: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d loss / d alpha [B, k], d loss / d z [B, k, m]) in alpha's dtype."""
    _check_size(num_experts)
    B, k, m = z.shape
    L = 1 << m
    a, zc = alpha.contiguous(), z.contiguous()
    gg = grad_gates.float().contiguous()
    has_sel = grad_selectors is not None and grad_selectors.numel() > 0
    gs = grad_selectors.float().contiguous() if has_sel else gg
    grad_alpha = torch.empty_like(a)
    grad_z = torch.empty_like(zc)
    if B > 0:
        grid, block_b, num_warps = launch_config(B, L, backward=True)
        dselect_k_backward_kernel[grid](
            gg,
            gs,
            a,
            zc,
            grad_alpha,
            grad_z,
            B,
            k,
            m,
            num_experts,
            *_params(gamma),
            HAS_GRAD_SELECTORS=has_sel,
            BLOCK_B=block_b,
            BLOCK_K=triton.next_power_of_2(k),
            BLOCK_L=L,
            num_warps=num_warps,
        )
    return grad_alpha, grad_z


@dselect_k_backward.register_fake
def _(grad_gates, grad_selectors, alpha, z, num_experts, gamma):
    return torch.empty_like(alpha, memory_format=torch.contiguous_format), torch.empty_like(
        z, memory_format=torch.contiguous_format
    )


# Ahead-of-time specialisations (python_tests/builds/test_triton_aot.py): each dtype, with and without
# selectors, a many-row tile (n = 16) and the widest single-row tile (n = MAX_EXPERTS).
def _aot(kernel, dt, flag, num_experts, k=4):
    L = triton.next_power_of_2(num_experts)
    _, block_b, num_warps = launch_config(1 << 20, L, backward=kernel is dselect_k_backward_kernel)
    common = {"B": "i32", "K": "i32", "M": "constexpr", "N": "i32", "half": "fp32", "c1": "fp32", "c3": "fp32"}
    if kernel is dselect_k_kernel:
        ptrs = {"alpha_ptr": f"*{dt}", "z_ptr": f"*{dt}", "gates_ptr": f"*{dt}", "sel_ptr": f"*{dt}"}
        flag_name = "RETURN_SELECTORS"
    else:
        ptrs = {
            "grad_gates_ptr": "*fp32",
            "grad_sel_ptr": "*fp32",
            "alpha_ptr": f"*{dt}",
            "z_ptr": f"*{dt}",
            "grad_alpha_ptr": f"*{dt}",
            "grad_z_ptr": f"*{dt}",
        }
        flag_name = "HAS_GRAD_SELECTORS"
    constexprs = {
        "M": L.bit_length() - 1,
        flag_name: flag,
        "BLOCK_B": block_b,
        "BLOCK_K": triton.next_power_of_2(k),
        "BLOCK_L": L,
    }
    signature = {**ptrs, **common, **dict.fromkeys(list(constexprs)[1:], "constexpr")}
    return kernel, signature, constexprs, {"num_warps": num_warps}


AOT_KERNELS = [
    _aot(dselect_k_kernel, "fp32", False, 16),
    _aot(dselect_k_kernel, "fp32", True, MAX_EXPERTS),
    _aot(dselect_k_kernel, "bf16", True, 64, k=2),
    _aot(dselect_k_backward_kernel, "fp32", True, 16),
    _aot(dselect_k_backward_kernel, "fp16", False, 256),
    _aot(dselect_k_backward_kernel, "fp32", False, MAX_EXPERTS, k=8),  # m = 10 bits: 100 unrolled products
]
