"""The experts' grouped GEMM over weights in the tiled layout (model.weights), in Triton.

The megakernel streams the experts from the tiled layout in place (a second, row-major copy
of North's 58 GB of experts does not fit an 80 GB part), so the PyTorch prefill on the same
weights reads that layout too: torch's grouped GEMMs take strided matrices only, and a band
of 16 rows stored as [16, 32] blocks is not one. Triton ships with torch's CUDA builds; this
module is imported only on a CUDA device (reference.moe_experts), and untiles the routed
experts where Triton is missing.

    grouped_gemm_tiled(x, counts, w)        y[p] = x[p] @ w[e(p)].T for rows p grouped by expert
    swiglu_tiled(x, counts, gate_up, down)  an expert's SwiGLU on each row: two launches, the
                                            second taking silu(gate) * up as it loads its input
    warm_up(gate_up, down)                  compile the kernels a layer of these experts runs
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_tiled(x_ptr, w_ptr, y_ptr, counts_ptr, experts, N, K, x_stride, up_offset,
                        EXPERTS_POW2: tl.constexpr, SWIGLU: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (n tile, m tile t). The m tiles are the experts' rows in blocks of BLOCK_M, expert
    # after expert; the grid has as many as the rows could take, and each program finds its
    # own from the counts (a scan of E numbers), so nothing runs on the host or in other
    # launches. The n tiles of one m tile run side by side: an expert's weights are read from
    # DRAM once per m tile, its later m tiles find them in L2.
    pid_n, t = tl.program_id(0), tl.program_id(1)
    ids = tl.arange(0, EXPERTS_POW2)
    counts = tl.load(counts_ptr + ids, mask=ids < experts, other=0).to(tl.int32)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    e = tl.sum((tile_ends <= t).to(tl.int32), 0)
    if e >= experts:  # past the last expert's tiles
        return
    mine = ids == e
    row_end = tl.sum(tl.where(mine, tl.cumsum(counts, 0), 0), 0)
    m0 = row_end - tl.sum(tl.where(mine, counts, 0), 0) + (t - tl.sum(tl.where(mine, tile_ends - tiles, 0), 0)) * BLOCK_M
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_rows = rm[:, None] < row_end
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * x_stride + rk[None, :]
    # Tiled element (n, k): (n - n % 16) K + (k / 32) 512 + (n % 16) 32 + k % 32. Along k a
    # block's 32 columns are contiguous, and BLOCK_K of k advance BLOCK_K * 16 elements.
    w_ptrs = (w_ptr + e.to(tl.int64) * N * K + ((rn // 16) * 16 * K + (rn % 16) * 32)[None, :]
              + ((rk // 32) * 512 + rk % 32)[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=in_rows, other=0.0)
        if SWIGLU:  # x holds [gate | up]: silu(gate) * up, each rounded as torch's bf16 ops round
            up = tl.load(x_ptrs + up_offset, mask=in_rows, other=0.0).to(tl.float32)
            g = a.to(tl.float32)
            a = ((g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty).to(tl.float32) * up).to(x_ptr.dtype.element_ty)
        b = tl.load(w_ptrs)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * 16
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=in_rows)


@dataclass(frozen=True)
class Blocks:
    """A launch's tile sizes: rows of x (m), of w (n) and columns (k) per program and k step."""
    m: int
    n: int = 128
    k: int = 64
    warps: int = 4
    stages: int = 4


def default_blocks(rows: int, experts: int, n: int, k: int) -> Blocks:
    """Tile sizes for `rows` rows over `experts` experts of [n, k] (tools/moe_bench.py --sweep,
    North's experts on the H200, benchmarks/NOTES.md session 20): the best of the sweep by the
    rows an expert gets on average, for long-k matrices (gate_up) and short ones (down); n
    halved until it divides the matrix."""
    per_expert, long_k = rows / experts, k > n
    if per_expert <= 4:  # prompts of a few tokens: a GEMV per expert
        blocks = Blocks(16, 128, 256, 4, 3) if long_k else Blocks(16, 64, 128, 4, 4)
    elif per_expert <= 32:
        blocks = Blocks(32, 64, 128, 4, 4) if long_k else Blocks(32, 128, 128, 4, 3)
    else:
        blocks = Blocks(128, 256, 64, 8, 4)
    while n % blocks.n:
        blocks = replace(blocks, n=blocks.n // 2)
    return blocks


def grouped_gemm_tiled(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, blocks: Blocks | None = None,
                       swiglu: bool = False) -> torch.Tensor:
    """y [P, N] (x's dtype, fp32 sums) with y[p] = x[p] @ w[e].T for the counts[e] rows of x
    that belong to expert e, x's rows grouped by expert in ascending order (x [P, K], counts
    [E] on x's device). w [E, N, K] holds each expert in the tiled layout (N a multiple of
    blocks.n, K of 32). swiglu: x is [P, 2K], gate columns then up, and the product takes
    silu(gate) * up in its place. blocks: default_blocks. No host sync."""
    experts, n, k = w.shape
    rows = x.shape[0]
    x = x.contiguous()
    if x.shape[1] != (2 * k if swiglu else k) or counts.shape != (experts,):
        raise ValueError(f"x {tuple(x.shape)}, counts {tuple(counts.shape)} do not match w {tuple(w.shape)}")
    blocks = blocks or default_blocks(rows, experts, n, k)
    if n % blocks.n or k % 32:
        raise ValueError(f"the tiled grouped GEMM needs N % {blocks.n} == 0 and K % 32 == 0, got {tuple(w.shape)}")
    block_k = blocks.k
    while k % block_k:  # a power of two down to 32
        block_k //= 2
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    grid = (n // blocks.n, rows // blocks.m + experts)  # sum of ceil(count / m) <= rows / m + E
    _grouped_gemm_tiled[grid](x, w, y, counts, experts, n, k, x.stride(0), k, EXPERTS_POW2=triton.next_power_of_2(experts),
                              SWIGLU=swiglu, BLOCK_M=blocks.m, BLOCK_N=blocks.n, BLOCK_K=block_k,
                              num_warps=blocks.warps, num_stages=blocks.stages)
    return y


def swiglu_tiled(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) per expert, x's rows grouped by expert (as grouped_gemm_tiled).
    gate_up [E, 2I, H], down [E, H, I], tiled."""
    return grouped_gemm_tiled(grouped_gemm_tiled(x, counts, gate_up), counts, down, swiglu=True)


def warm_up(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Compile (or load from Triton's cache) the kernels a layer of these tiled experts runs at
    every prompt size (default_blocks), so that a server's first prefill does not."""
    experts = gate_up.shape[0]
    counts = torch.zeros(experts, dtype=torch.int64, device=gate_up.device)
    counts[0] = 1
    x = torch.zeros(1, gate_up.shape[2], dtype=gate_up.dtype, device=gate_up.device)
    for rows in (1, 16 * experts, 64 * experts):  # each of default_blocks' three sizes
        gate_and_up = grouped_gemm_tiled(x, counts, gate_up, default_blocks(rows, experts, *gate_up.shape[1:]))
        grouped_gemm_tiled(gate_and_up, counts, down, default_blocks(rows, experts, *down.shape[1:]), swiglu=True)
