"""The experts' grouped GEMM over weights in the tiled layout (model.weights), in Triton.

The megakernel streams the experts from the tiled layout in place (a second, row-major copy
of North's 58 GB of experts does not fit an 80 GB part), so the PyTorch prefill on the same
weights reads that layout too: torch's grouped GEMMs take strided matrices only, and a band
of 16 rows stored as [16, 32] blocks is not one. Triton ships with torch's CUDA builds; this
module is imported only on a CUDA device (reference.moe_experts), and untiles the routed
experts where Triton is missing.

    grouped_gemm_tiled(x, counts, w)        y[p] = x[p] @ w[e(p)].T for rows p grouped by expert
    swiglu_tiled(x, counts, gate_up, down)  an expert's SwiGLU on each row
    warm_up(gate_up, down)                  compile the kernels a layer of these experts runs
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
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


@dataclass(frozen=True)
class Blocks:
    """A launch's tile sizes: rows of x (m), of w (n) and columns (k) per program and k step."""
    m: int
    n: int = 128
    k: int = 64
    warps: int = 4
    stages: int = 4


def default_blocks(rows: int, experts: int) -> Blocks:
    """m tiles of 16 rows where experts get few rows each (decode-sized chunks), else 64."""
    return Blocks(16 if rows <= 2 * experts * 16 else 64)


@dataclass(frozen=True)
class TileMap:
    """The m tiles of x's rows grouped by expert: tile t covers rows [row[t], ends[expert[t]])
    up to `block_m` of them (expert -1: past the last tile). Sized without a host sync for the
    most tiles `rows` rows can take, sum of ceil(count / block_m) <= rows / block_m + E."""
    block_m: int
    expert: torch.Tensor
    row: torch.Tensor
    ends: torch.Tensor

    @staticmethod
    def of(counts: torch.Tensor, rows: int, block_m: int) -> TileMap:
        experts = counts.shape[0]
        counts = counts.to(torch.int64)
        ends = counts.cumsum(0)
        tiles = (counts + block_m - 1) // block_m
        tile_ends = tiles.cumsum(0)
        t = torch.arange(rows // block_m + experts, device=counts.device)
        e = torch.searchsorted(tile_ends, t, right=True)
        valid = e < experts
        e = e.clamp(max=experts - 1)
        row = ends[e] - counts[e] + (t - (tile_ends[e] - tiles[e])) * block_m
        return TileMap(block_m, torch.where(valid, e, -1).to(torch.int32), row.to(torch.int32), ends.to(torch.int32))


def grouped_gemm_tiled(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, blocks: Blocks | None = None,
                       tiles: TileMap | None = None) -> torch.Tensor:
    """y [P, N] (x's dtype, fp32 sums) with y[p] = x[p] @ w[e].T for the counts[e] rows of x
    that belong to expert e, x's rows grouped by expert in ascending order (x [P, K], counts
    [E] on x's device). w [E, N, K] holds each expert in the tiled layout (N a multiple of
    blocks.n, K of 32 and blocks.k). blocks: default_blocks; tiles: TileMap.of(counts, P,
    blocks.m), where the caller has it already. No host sync."""
    experts, n, k = w.shape
    rows = x.shape[0]
    if x.shape[1] != k or counts.shape != (experts,):
        raise ValueError(f"x {tuple(x.shape)}, counts {tuple(counts.shape)} do not match w {tuple(w.shape)}")
    blocks = blocks or default_blocks(rows, experts)
    if n % blocks.n or k % 32 or k % min(blocks.k, k):
        raise ValueError(f"the tiled grouped GEMM needs N % {blocks.n} == 0 and K % 32 == 0, got {tuple(w.shape)}")
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    tiles = tiles or TileMap.of(counts, rows, blocks.m)
    grid = (n // blocks.n, tiles.expert.shape[0])
    _grouped_gemm_tiled[grid](x, w, y, tiles.expert, tiles.row, tiles.ends, n, k, n * k, BLOCK_M=blocks.m,
                              BLOCK_N=blocks.n, BLOCK_K=min(blocks.k, k), num_warps=blocks.warps,
                              num_stages=blocks.stages)
    return y


def swiglu_tiled(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) per expert, x's rows grouped by expert (as grouped_gemm_tiled),
    both GEMMs on one tile map. gate_up [E, 2I, H], down [E, H, I], tiled."""
    blocks = default_blocks(x.shape[0], gate_up.shape[0])
    tiles = TileMap.of(counts, x.shape[0], blocks.m)
    gate, up = grouped_gemm_tiled(x, counts, gate_up, blocks, tiles).chunk(2, dim=-1)
    return grouped_gemm_tiled(F.silu(gate) * up, counts, down, blocks, tiles)


def warm_up(gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """Compile (or load from Triton's cache) the kernels a layer of these tiled experts runs at
    every prompt size (default_blocks), so that a server's first prefill does not."""
    experts = gate_up.shape[0]
    counts = torch.zeros(experts, dtype=torch.int64, device=gate_up.device)
    counts[0] = 1
    for rows in (1, 2 * experts * 16 + 1):
        for w in (gate_up, down):
            grouped_gemm_tiled(torch.zeros(1, w.shape[2], dtype=w.dtype, device=w.device), counts, w,
                               default_blocks(rows, experts))
