// The TMA + wgmma GEMV: out[r][n] = sum_k W[r][k] * x[n][k] over a tile of R <= 256 weight rows
// (one or two row segments of a matrix, each a multiple of 16 rows) and a K range [k0, k1)
// (multiples of 64), for the n < 8 batch rows; bf16 in, fp32 accumulate.
//
// Only tools/gemv_bench.cu runs it (its tma+wgmma paths): the megakernel streams its weights through
// common.cuh's register GEMV, which measured faster in the kernel (benchmarks/NOTES.md, sessions 3,
// 16 and 28). The ring is a template, TmaRingT<Slots, SlotBytes, BoxRows>; TmaRing (4 x 32 KB, 16-row
// boxes) is the bench's first TMA path, the others its variants. Every function below takes its
// parameters from the ring's type.
//
// Data path. The TMA unit streams the weights into a ring of Slots slots of SlotBytes in shared
// memory, in boxes of 64 columns (128 bytes, 128-byte swizzle) by 16 rows; with BoxRows > 16 a
// segment that has a `tall_map` (same matrix, BoxRows-row boxes) and whose rows in the stage are a
// multiple of BoxRows comes in BoxRows-row boxes instead (same shared layout: the swizzle repeats
// every 8 rows). A stage (one fill of a slot) holds `kb_per_stage` 64-wide k blocks of all R rows:
// k block j of the stage at row offset j * R, the tile's rows in order (segment 0, then segment 1).
// When R rows of one k block exceed a slot (R > SlotBytes / 128, only with slots under 32 KB),
// each k block comes as `chunks` consecutive stages of SlotBytes / 128 rows each (a multiple of
// 128: whole pairs of 64-row tiles), the last chunk holding the rest. Each (64-row tile m, k block)
// is four wgmma m64n8k16 with the weights as A (64 rows from row 64m of that k block, K-major,
// 128-byte swizzle) and the input as B (8 rows, same layout, staged by the caller). Rows past R in
// a 64-row tile are whatever follows in shared memory (the next k block, the rest of the slot, the
// next slot, or up to kRingOverread bytes past the ring); their results are discarded.
//
// Work split. With an even number of 64-row tiles (R in (64, 128] or (192, 256]) warpgroup wg
// owns the tiles 2i + wg; with an odd number both take every tile, warpgroup wg the k16 steps
// 2wg and 2wg + 1 of each k block, and the two partial sums are added through `out` at the end.
// Both warpgroups thus run the same wgmma stream (no branch on the warpgroup between fence and
// commit, which would make ptxas serialize the wgmmas) and consume every stage; a row chunk holds
// tiles of both warpgroups.
//
// Pipeline. Stage number c counts every stage since ring_init (TmaRing::fill: issued,
// TmaRing::consume: consumed); its slot is c % S and its phase parity (c / S) & 1 (S = Slots; when
// S is not a power of two this holds until the counter wraps, 2^32 stages into a launch).
//   full[slot]:  1 arrival (thread 0's arrive.expect_tx with the stage's bytes) + the TMA bytes.
//                Every thread waits on parity (c / S) & 1 before reading the stage.
//   empty[slot]: kWarps arrivals, lane 0 of each warp after its own wgmma.wait_group 0, so the
//                slot's reads are complete. A warp arrives for stage c only after waiting on its
//                full barrier, so it can never arrive for stage c + S in the phase of stage c.
//                Thread 0 waits on parity ((c / S) & 1) ^ 1 before refilling the slot with stage
//                c (for c < S that is the phase before the first: it passes at once).
// Producer: thread 0 only. gemv_begin issues the tile's first min(S, stages) stages; it runs after
// the previous task's gemv_finish, so every slot is released by then and its empty waits pass at
// once. In gemv_finish, before consuming stage s of the tile, thread 0 issues up to stage s + S - 1;
// that needs stages < s released, which warp 0 already did and the other warps do without needing
// thread 0 (their full barriers were completed before), so thread 0, consumer too, cannot deadlock.
// Each task consumes exactly the stages it issued, so the ring is empty between tasks; the counters
// carry the slots and phases from one task to the next.
//
// Contract: ring_init once per launch (all threads); per task gemv_begin (optional, thread 0 acts)
// then gemv_finish (all threads) with the same tile, nothing else touching the ring in between.
#pragma once

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "common.cuh"
#include "tensor_map.hpp"

namespace nmk::mk {

// The bench's first ring: 4 stages of 32 KB, 96-128 KB in flight per SM (>= 64 KB covers ~33 GB/s per
// SM over 1.5-2 us of loaded DRAM latency), one k block of the widest tile per stage, and few
// enough stages that a small tile (16 x 2048: 2 stages) is issued whole by gemv_begin.
constexpr int kRingStages = 4;
constexpr int kStageBytes = 32 * 1024;       // 256 rows x one k block, or more k blocks of fewer rows
constexpr int kRingBytes = kRingStages * kStageBytes;
constexpr int kRingOverread = 48 * 128;      // padding rows of the last 64-row tile read past the ring
constexpr int kGemvMaxRows = 256;

using GemvMma = cute::SM90_64x8x16_F32BF16BF16_SS<cute::GMMA::Major::K, cute::GMMA::Major::K>;

struct GemvSegment {
    const CUtensorMap *map;  // the matrix (global memory, 64-byte aligned), kTmaBoxRows-row boxes
    int row0, rows;          // rows: a multiple of 16; 0 for an unused segment
    // The same matrix with boxes of the ring's BoxRows rows, or nullptr: 16-row boxes only.
    const CUtensorMap *tall_map = nullptr;
};

struct GemvTile {
    GemvSegment seg[2];
    int k0, k1;  // multiples of 64
};

// Per-CTA pipeline state, in shared memory (8-byte aligned).
template <int Slots, int SlotBytes, int BoxRows>
struct TmaRingT {
    static constexpr int kSlots = Slots, kSlotBytes = SlotBytes, kBoxRows = BoxRows;
    static constexpr int kBytes = Slots * SlotBytes;
    static constexpr int kSlotRows = SlotBytes / 128;  // rows of one k block a slot holds
    static_assert(Slots >= 2 && SlotBytes % 1024 == 0, "slots keep the 1024-byte alignment of the swizzle");
    static_assert(kSlotRows >= kGemvMaxRows || kSlotRows % 128 == 0,
                  "a row chunk holds whole pairs of 64-row tiles, one per warpgroup");
    static_assert((Slots - 1) * SlotBytes >= 64 * 1024, "too little in flight");
    static_assert(BoxRows >= kTmaBoxRows && BoxRows <= 256 && BoxRows % kTmaBoxRows == 0, "TMA box rows");

    uint64_t full[Slots];
    uint64_t empty[Slots];
    char *stages;      // kBytes, 1024-byte aligned; kRingOverread more bytes must be shared memory
    uint32_t fill;     // stages issued (thread 0 only)
    uint32_t consume;  // stages consumed
};
using TmaRing = TmaRingT<kRingStages, kStageBytes, kTmaBoxRows>;

// ---- the input as the wgmma B operand ------------------------------------------------------
// Per 64-wide k block an 8 x 128-byte atom (1 KB): row n at n * 128 bytes, its 16-byte chunk c
// at chunk c ^ n. x_swizzled holds columns [k0, k1) of a tile: block j is columns k0 + 64j...
// It must start on a 1024-byte boundary.
__device__ __forceinline__ int swizzled_offset(int n, int k) {
    return (k >> 6) * 512 + n * 64 + ((((k >> 3) & 7) ^ n) << 3) + (k & 7);
}

// All threads: rows x K bf16 (K % 64 == 0) from global scratch (src_stride apart) into the
// swizzled layout; rows rows..7 are written as zero. No barrier (gemv_finish begins with one).
__device__ __forceinline__ void stage_swizzled(bf16 *dst, const bf16 *src, int rows, int K, int src_stride) {
    const int chunks = K / 8;
    for (int i = threadIdx.x; i < 8 * chunks; i += kThreads) {
        const int n = i / chunks, c = i - n * chunks;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (n < rows) v = load_l2(reinterpret_cast<const uint4 *>(src + (size_t)n * src_stride) + c);
        *reinterpret_cast<uint4 *>(dst + swizzled_offset(n, 8 * c)) = v;
    }
}

// ---- internals -----------------------------------------------------------------------------
namespace tma_detail {

// How a tile falls into stages of SlotBytes. A malformed tile traps (the ring would hang or overflow).
template <int SlotBytes>
struct TileShape {
    static constexpr bool kMayChunk = SlotBytes < kGemvMaxRows * 128;  // else chunks is always 1
    int rows, mtiles, kblocks, kb_per_stage, chunks, stages;
    __device__ __forceinline__ explicit TileShape(const GemvTile &t) {
        rows = t.seg[0].rows + t.seg[1].rows;
        if (rows <= 0 || rows > kGemvMaxRows || ((t.seg[0].rows | t.seg[1].rows) & 15) || t.k1 <= t.k0 ||
            ((t.k0 | t.k1) & 63))
            __trap();
        mtiles = (rows + 63) >> 6;
        kblocks = (t.k1 - t.k0) >> 6;
        if (!kMayChunk || rows * 128 <= SlotBytes) {
            kb_per_stage = SlotBytes / (rows * 128);
            chunks = 1;
        } else {  // each k block in row chunks of SlotBytes / 128 rows
            kb_per_stage = 1;
            chunks = (rows * 128 + SlotBytes - 1) / SlotBytes;
        }
        stages = (kblocks + kb_per_stage - 1) / kb_per_stage * chunks;
    }
};

// K-major operand with the 128-byte swizzle: 8-row groups 1024 bytes apart (the stride byte
// offset), leading byte offset unused (1), base offset 0 (every operand starts 1024-aligned; the
// k16 steps move the start by 32 bytes inside the 128-byte rows, as CuTe's descriptor iterator).
__device__ __forceinline__ uint64_t sw128_desc(uint32_t smem_addr) {
    cute::GmmaDescriptor d;
    d.bitfield.start_address_ = static_cast<uint16_t>(smem_addr >> 4);
    d.bitfield.leading_byte_offset_ = 1;
    d.bitfield.stride_byte_offset_ = 1024 >> 4;
    d.bitfield.base_offset_ = 0;
    d.bitfield.layout_type_ = static_cast<uint8_t>(cute::GMMA::LayoutType::B128);
    return d.desc_;
}

// Thread 0: stage s of the tile into the next slot (waits until that slot is released). Stage s
// holds k blocks from (s / chunks) * kb_per_stage on, of the tile rows [ra, rb) of row chunk s % chunks.
template <int S, int B, int BR>
__device__ __forceinline__ void issue_stage(TmaRingT<S, B, BR> &ring, const GemvTile &t, const TileShape<B> &sh,
                                            int s) {
    using Ring = TmaRingT<S, B, BR>;
    const uint32_t c = ring.fill, slot = c % S;
    cutlass::arch::ClusterBarrier::wait(&ring.empty[slot], ((c / S) & 1) ^ 1);
    // (TmaRing's 32 KB slots never chunk: kMayChunk keeps the division out of its code)
    const int kb0 = (sh.kMayChunk ? s / sh.chunks : s) * sh.kb_per_stage;
    const int nkb = min(sh.kb_per_stage, sh.kblocks - kb0);
    const int ra = sh.kMayChunk ? s % sh.chunks * Ring::kSlotRows : 0;
    const int rb = sh.kMayChunk ? min(sh.rows, ra + Ring::kSlotRows) : sh.rows;
    uint64_t *bar = &ring.full[slot];
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, (uint32_t)(nkb * (rb - ra) * 128));
    char *dst = ring.stages + slot * B;
    for (int j = 0; j < nkb; j++) {
        const int col = t.k0 + (kb0 + j) * 64;
        int first = 0;  // the segment's first row in the tile
#pragma unroll
        for (int g = 0; g < 2; g++) {
            const GemvSegment &seg = t.seg[g];
            // the segment's rows in the stage
            const int lo = sh.kMayChunk ? max(ra - first, 0) : 0;
            const int hi = sh.kMayChunk ? min(rb - first, seg.rows) : seg.rows;
            first += seg.rows;
            const bool tall = BR > kTmaBoxRows && seg.tall_map && lo % BR == 0 && hi % BR == 0;
            const CUtensorMap *map = tall ? seg.tall_map : seg.map;
            const int step = tall ? BR : kTmaBoxRows;
#pragma unroll 1
            for (int r = lo; r < hi; r += step, dst += step * 128)
                cute::SM90_TMA_LOAD_2D::copy(map, bar, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST),
                                             dst, col, seg.row0 + r);
        }
    }
    ring.fill = c + 1;
}

}  // namespace tma_detail

// All threads, once per launch before any other use: barriers and counters. Ends with a barrier.
template <int S, int B, int BR>
__device__ __forceinline__ void ring_init(TmaRingT<S, B, BR> &ring, char *stages) {
    if (threadIdx.x == 0) {
        for (int i = 0; i < S; i++) {
            cutlass::arch::ClusterBarrier::init(&ring.full[i], 1);
            cutlass::arch::ClusterBarrier::init(&ring.empty[i], kWarps);
        }
        ring.stages = stages;
        ring.fill = ring.consume = 0;
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();
}

// Thread 0 (the others return): starts streaming the tile's first stages; never blocks (the
// previous task released every slot). Call it before the task's dependency wait.
template <int S, int B, int BR>
__device__ __forceinline__ void gemv_begin(TmaRingT<S, B, BR> &ring, const GemvTile &t) {
    if (threadIdx.x != 0) return;
    const tma_detail::TileShape<B> sh(t);
    cute::prefetch_tma_descriptor(t.seg[0].map);
    if (t.seg[1].rows) cute::prefetch_tma_descriptor(t.seg[1].map);
    if (BR > kTmaBoxRows && t.seg[0].tall_map) cute::prefetch_tma_descriptor(t.seg[0].tall_map);
    if (BR > kTmaBoxRows && t.seg[1].rows && t.seg[1].tall_map) cute::prefetch_tma_descriptor(t.seg[1].tall_map);
    const int n = min(sh.stages, S);
    for (int s = 0; s < n; s++) tma_detail::issue_stage(ring, t, sh, s);
}

namespace tma_detail {

// The consuming side of gemv_finish for a tile of MT 64-row wgmma tiles. With MT even each
// warpgroup owns the tiles m = 2i + wg, all four k16 steps of every k block; with MT odd both
// take every tile, warpgroup wg the k16 steps 2wg, 2wg + 1 of each k block. Either way both run
// the same instruction stream, no branch on the warpgroup between wgmma fence and commit. When
// MT tiles exceed a slot, the kChunks stages of a k block are unrolled, each running the wgmmas
// of its own tiles only (decided at compile time).
template <int MT, int S, int B, int BR>
__device__ __forceinline__ void consume(TmaRingT<S, B, BR> &ring, const GemvTile &t, const TileShape<B> &sh,
                                        uint32_t first, uint32_t x_addr, float *out) {
    using Ring = TmaRingT<S, B, BR>;
    constexpr bool kOwnTiles = MT % 2 == 0;
    constexpr int kAcc = kOwnTiles ? MT / 2 : MT, kSteps = kOwnTiles ? 4 : 2;
    constexpr int kTilesPerChunk = Ring::kSlotRows / 64;
    constexpr int kChunks = MT > kTilesPerChunk ? (MT + kTilesPerChunk - 1) / kTilesPerChunk : 1;
    if (sh.kMayChunk && sh.chunks != kChunks) __trap();  // rows in (64 (MT - 1), 64 MT] give the same split
    const int wg = threadIdx.x >> 7;
    const uint32_t ring_addr = cute::cast_smem_ptr_to_uint(ring.stages);
    // this warpgroup's start in a k block: its first tile (64 rows of 128 bytes), or its k16 steps
    const uint32_t a_off = kOwnTiles ? 64 * 128 * wg : 64 * wg, b_off = kOwnTiles ? 0 : 64 * wg;
    float acc[kAcc][4];
#pragma unroll
    for (int i = 0; i < kAcc; i++)
#pragma unroll
        for (int v = 0; v < 4; v++) acc[i][v] = 0.f;

    const int groups = sh.stages / kChunks;
    for (int gi = 0; gi < groups; gi++) {
#pragma unroll
        for (int h = 0; h < kChunks; h++) {
            const int s = gi * kChunks + h;
            if (threadIdx.x == 0) {
                const int until = min(s + S, sh.stages);
                for (int next = (int)(ring.fill - first); next < until; next++) issue_stage(ring, t, sh, next);
            }
            const uint32_t c = first + s, slot = c % S;
            cutlass::arch::ClusterBarrier::wait(&ring.full[slot], (c / S) & 1);
            const int kb0 = gi * sh.kb_per_stage, nkb = min(sh.kb_per_stage, sh.kblocks - kb0);
            // the stage's first row is tile row 64 kTilesPerChunk h
            const uint32_t a_stage = ring_addr + slot * B + a_off - h * kTilesPerChunk * 64 * 128,
                           b_stage = x_addr + kb0 * 1024 + b_off;
#pragma unroll
            for (int i = 0; i < kAcc; i++)
#pragma unroll
                for (int v = 0; v < 4; v++) cute::warpgroup_fence_operand(acc[i][v]);
            for (int j = 0; j < nkb; j++) {
                const uint32_t a = a_stage + j * sh.rows * 128, b = b_stage + j * 1024;
                cute::warpgroup_arrive();
#pragma unroll
                for (int i = 0; i < kAcc; i++) {
                    if (kChunks > 1 && (kOwnTiles ? 2 * i : i) / kTilesPerChunk != h) continue;  // another chunk's tile
#pragma unroll
                    for (int kk = 0; kk < kSteps; kk++)
                        GemvMma::fma(sw128_desc(a + (kOwnTiles ? 2 : 1) * 64 * 128 * i + 32 * kk),
                                     sw128_desc(b + 32 * kk), acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
                }
                cute::warpgroup_commit_batch();
            }
            cute::warpgroup_wait<0>();
#pragma unroll
            for (int i = 0; i < kAcc; i++)
#pragma unroll
                for (int v = 0; v < 4; v++) cute::warpgroup_fence_operand(acc[i][v]);
            if ((threadIdx.x & 31) == 0) cutlass::arch::ClusterBarrier::arrive(&ring.empty[slot]);
        }
    }

    // Accumulator fragment of m64n8: warp w of the warpgroup holds rows 16w + lane / 4 (+ 8),
    // columns 2 (lane % 4) (+ 1).
    const int r_lo = 16 * ((threadIdx.x >> 5) & 3) + ((threadIdx.x & 31) >> 2), col = 2 * (threadIdx.x & 3);
    auto put = [&](bool add) {
#pragma unroll
        for (int i = 0; i < kAcc; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = 64 * (kOwnTiles ? 2 * i + wg : i) + r_lo + 8 * h;
                if (r >= sh.rows) continue;
                float2 *o = reinterpret_cast<float2 *>(out + r * 8 + col);
                float2 v = make_float2(acc[i][2 * h], acc[i][2 * h + 1]);
                if (add) v.x += o->x, v.y += o->y;
                *o = v;
            }
    };
    if (kOwnTiles) {
        put(false);
    } else {  // warpgroup 0 writes, then warpgroup 1 adds its k16 steps
        if (wg == 0) put(false);
        __syncthreads();
        if (wg == 1) put(true);
    }
}

}  // namespace tma_detail

// All threads: out[r * 8 + n] (fp32, shared or global memory) = tile row r . x row n for r < R,
// where rows [0, seg[0].rows) are segment 0's and the rest segment 1's; x_swizzled as
// stage_swizzled writes it (any thread may have written it before the call). Ends with a barrier.
template <int S, int B, int BR>
__device__ __forceinline__ void gemv_finish(TmaRingT<S, B, BR> &ring, const GemvTile &t, const bf16 *x_swizzled,
                                            float *out) {
    const tma_detail::TileShape<B> sh(t);
    const uint32_t first = ring.consume;
    cutlass::arch::fence_view_async_shared();  // x's generic-proxy stores, before wgmma reads them
    __syncthreads();
    const uint32_t x_addr = cute::cast_smem_ptr_to_uint(x_swizzled);
    if ((x_addr | cute::cast_smem_ptr_to_uint(ring.stages)) & 1023) __trap();  // the swizzle needs both aligned
    switch (sh.mtiles) {
        case 1: tma_detail::consume<1>(ring, t, sh, first, x_addr, out); break;
        case 2: tma_detail::consume<2>(ring, t, sh, first, x_addr, out); break;
        case 3: tma_detail::consume<3>(ring, t, sh, first, x_addr, out); break;
        default: tma_detail::consume<4>(ring, t, sh, first, x_addr, out); break;
    }
    if (threadIdx.x == 0) ring.consume = first + sh.stages;  // every thread read it before the first barrier
    __syncthreads();
}

}  // namespace nmk::mk
