"""The experts' grouped GEMM over weights in the tiled layout (model.weights), in Triton.

The megakernel streams the experts from the tiled layout in place (a second, row-major copy
of North's 58 GB of experts does not fit an 80 GB part), so the PyTorch prefill on the same
weights reads that layout too: torch's grouped GEMMs take strided matrices only, and a band
of 16 rows stored as [16, 32] blocks is not one. Triton ships with torch's CUDA builds; this
module is imported only on a CUDA device (reference.moe_experts), and untiles the routed
experts where Triton is missing.

    grouped_gemm_tiled(x, counts, w)   y[p] = x[p] @ w[e(p)].T for pairs p grouped by expert
    warm_up(gate_up, down)             compile the kernels a layer of these experts runs
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_tiled(x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, row_end_ptr, N, K, expert_stride,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (n tile, m tile): the n tiles of one m tile run side by side, so an expert's
    # weights are read once per m tile while its other m tiles find them in L2.
    pid_n, t = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_expert_ptr + t)
    if e < 0:  # past the last expert's tiles (the grid is sized without a host sync)
        return
    m0 = tl.load(tile_row_ptr + t)
    m_end = tl.load(row_end_ptr + e)
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_rows = rm[:, None] < m_end
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * K + rk[None, :]
    # Tiled element (n, k): (n - n % 16) K + (k / 32) 512 + (n % 16) 32 + k % 32. Along k a
    # block's 32 columns are contiguous, and BLOCK_K of k advance BLOCK_K * 16 elements.
    w_ptrs = (w_ptr + e.to(tl.int64) * expert_stride + ((rn // 16) * 16 * K + (rn % 16) * 32)[None, :]
              + ((rk // 32) * 512 + rk % 32)[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        a = tl.load(x_ptrs, mask=in_rows, other=0.0)
        b = tl.load(w_ptrs)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * 16
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=in_rows)


def grouped_gemm_tiled(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """y [P, N] (x's dtype, fp32 sums) with y[p] = x[p] @ w[e].T for the counts[e] rows of x
    that belong to expert e, x's rows grouped by expert in ascending order (x [P, K], counts
    [E] on x's device). w [E, N, K] holds each expert in the tiled layout (N % 64 == 0, K % 32
    == 0). No host sync: the grid is sized for the most m tiles P rows can take. block_m: rows
    of an m tile (16 or 64), by default 16 where experts get few rows each (decode-sized
    chunks), else 64."""
    experts, n, k = w.shape
    rows = x.shape[0]
    if x.shape[1] != k or counts.shape != (experts,):
        raise ValueError(f"x {tuple(x.shape)}, counts {tuple(counts.shape)} do not match w {tuple(w.shape)}")
    if n % 64 or k % 32:
        raise ValueError(f"the tiled grouped GEMM needs N % 64 == 0 and K % 32 == 0, got {tuple(w.shape)}")
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    if block_m is None:
        block_m = 16 if rows <= 2 * experts * 16 else 64
    block_n = 128 if n % 128 == 0 else 64
    block_k = 64 if k % 64 == 0 else 32
    counts = counts.to(torch.int64)
    ends = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    bound = rows // block_m + experts  # sum of ceil(count / block_m) is at most this
    t = torch.arange(bound, device=x.device)
    e = torch.searchsorted(tile_ends, t, right=True)
    valid = e < experts
    e = e.clamp(max=experts - 1)
    tile_row = ends[e] - counts[e] + (t - (tile_ends[e] - tiles[e])) * block_m
    tile_expert = torch.where(valid, e, -1).to(torch.int32)
    grid = (n // block_n, bound)
    _grouped_gemm_tiled[grid](x, w, y, tile_expert, tile_row.to(torch.int32), ends.to(torch.int32), n, k, n * k,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4)
    return y


def warm_up(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Compile (or load from Triton's cache) the kernels a layer of these tiled experts runs at
    every prompt size, so that a server's first prefill does not."""
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int64, device=gate_up.device)
    counts[0] = 1
    for block_m in (16, 64):
        for w in (gate_up, down):
            grouped_gemm_tiled(torch.zeros(1, w.shape[2], dtype=w.dtype, device=w.device), counts, w, block_m)
