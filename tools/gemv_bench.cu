// northmk_gemv_bench: the decode GEMV primitives alone, at the megakernel's tile shapes.
//
// For each shape (rows per tile x K) and batch (1, 8), one persistent kernel per path, one CTA
// of 256 threads per SM, each CTA walking a static round-robin list of tiles over >= 2 GiB of
// random bf16 weights (several matrices, so L2 never holds them):
//   tma+wgmma       gemv_begin before a simulated dependency wait, stage_swizzled, gemv_finish
//                   (the engine's ring: 4 x 32 KB, 16-row boxes)
//   mma.sync        the megakernel's gemv() (common.cuh: wgmma for tiles in fours, mma.sync
//                   otherwise, each lane loading 8 k32 steps into registers at once)
//   mma.sync+pf     the same with an L2 prefetch of the tile before the wait
//   mma.sync/16     gemv()'s work split, each lane loading 16 k32 steps at once (128 KB per SM)
//   mma.sync/pipe   the same, software-pipelined in registers: the loads of the next 8 k32 steps
//                   are issued before the mmas of the current 8 (DotRing<8, 2>)
//   mma.sync/cpasync16  the same pipeline through shared memory: cp.async groups of 4 k32 steps,
//                   a ring of 16 steps per lane (12-16 in flight, 96-128 KB per SM)
//   mma.sync/cpasync20  a ring of 20 steps per lane (16-20 in flight, 128-160 KB per SM)
//   tma/box64       tma+wgmma with 64-row boxes where a segment's rows allow (a second map)
//   tma/8x16K       tma+wgmma with a ring of 8 x 16 KB (256-row tiles: two 128-row chunks per k block)
//   tma/6x32K       tma+wgmma with a ring of 6 x 32 KB; results go straight to global memory
//                   (224 KB of ring and input leave no room for them in shared memory)
//   tma/6x32K/box64 both
//   ld/FLAVOUR      mma.sync in bursts of 8 steps (DotBurst) with each flavour of weight load
//                   (load_flavour): engine, nc-ef, nc, plain, cg, cs, nc256
//   tiled/FLAVOUR   ld/FLAVOUR (engine, cs) on a copy of the weights in the tiled layout
//                   (common.cuh's tiled_index): each (16-row band, 32-wide k step) block of 1 KB
//                   contiguous, so a warp's load reads 512 contiguous bytes and its burst 8 KB
//   tiled/gemv      the megakernel's gemv() on that copy, as it runs attention's weights
// Every output of a sample of tiles is checked against a CPU reference (error relative to the
// row's sum |w| |x|, 1e-2 at most). One line per (shape, path, batch); exit code 1 on a mismatch.
//   northmk_gemv_bench [--quick] [--filter SUBSTR]... [--ctas N] [--pool-mib M]
//     --quick: 512 MiB of weights, one repetition; --filter: only the paths whose name contains
//     SUBSTR (repeatable: any of them); --ctas: launch N CTAs (default one per SM: what one SM
//     streams when fewer share the DRAM); --pool-mib: M MiB of weights (small enough, and L2
//     holds them after the first repetition: what an SM streams from L2). GB/s per SM divides by
//     the CTAs launched.
#include <cuda/atomic>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "mk/common.cuh"
#include "mk/tensor_map.hpp"
#include "mk/tma_gemv.cuh"

using namespace nmk::mk;

namespace {

struct Shape {
    const char *name;
    int rows;     // per tile, all segments
    int K;        // matrix width
    int segments; // 2: gate + up halves of the tile, from the two halves of the matrix
    int ksplit;   // K ranges per row tile
};

const Shape kShapes[] = {
    {"128x2048", 128, 2048, 1, 1}, {"64x2048", 64, 2048, 1, 1},  {"2x48x2048", 96, 2048, 2, 1},
    {"128x768", 128, 768, 1, 1},   {"256x768", 256, 768, 1, 1},  {"64x4096/4", 64, 4096, 1, 4},
    {"16x2048", 16, 2048, 1, 1},
};
constexpr int kMatrices = 8;
constexpr int kXStride = 4096;  // the input: [8][kXStride] bf16, widest K
constexpr int kTallBoxRows = 64;  // the box rows of the tall maps

struct BenchTile {
    int matrix;
    int row0[2], rows[2];
    int k0, k1;
};

struct Args {
    const BenchTile *tiles;
    int ntiles, rows, K, batch;
    const TensorMap *maps;    // per matrix, 16-row boxes
    const TensorMap *tall_maps;  // per matrix, kTallBoxRows-row boxes
    const bf16 *pool;         // matrix m at pool + m * matrix_elems
    const bf16 *tiled;        // the same matrices in the tiled layout (tile_layout)
    size_t matrix_elems;
    const bf16 *x;            // [8][kXStride]
    float *out;               // [ntiles][rows][8]
    const uint32_t *ready;    // the simulated dependency counter, already 1
};

// Shared memory of the TMA kernels: the ring, then the swizzled input (which also covers the
// ring's over-read), the outputs (unless they go to global memory) and the ring state; the
// mma.sync kernels use GemvSmem from 0, in kSmem.
constexpr int kInputBytes = 2048 / 64 * 1024;  // widest K range of a tile: 2048
constexpr int kOutBytes = kGemvMaxRows * 8 * sizeof(float);
constexpr int kSmem = 1024 + kRingBytes + kInputBytes + kOutBytes + 1024;
static_assert(kInputBytes >= kRingOverread, "the input follows the ring and absorbs its over-read");

// GemvSmem of the widest tile (K range 2048, 256 rows), then `scratch` bytes of its extra.
int mma_smem(int scratch) {
    return in_bytes(2048) + kGemvMaxRows * 8 * (int)sizeof(float) +
           kMaxGemvItems * 128 * (int)sizeof(float) + scratch;
}

template <class Ring, bool kOutGlobal>
constexpr int tma_smem() {
    static_assert(sizeof(Ring) <= 1024, "the ring state fits the last KB");
    return 1024 + Ring::kBytes + kInputBytes + (kOutGlobal ? 0 : kOutBytes) + 1024;
}

__device__ __forceinline__ char *aligned_smem(char *p) {
    return reinterpret_cast<char *>((reinterpret_cast<uintptr_t>(p) + 1023) & ~uintptr_t(1023));
}

// As the megakernel's wait_for: thread 0 polls an acquire load, then a barrier.
__device__ __forceinline__ void wait_ready(const uint32_t *counter) {
    if (threadIdx.x == 0) {
        cuda::atomic_ref<const uint32_t, cuda::thread_scope_device> c(*counter);
        while (c.load(cuda::memory_order_acquire) < 1u) __nanosleep(20);
    }
    __syncthreads();
}

__device__ __forceinline__ void write_out(const float *s, float *g, int n) {
    for (int i = threadIdx.x * 4; i < n; i += kThreads * 4)
        *reinterpret_cast<float4 *>(g + i) = *reinterpret_cast<const float4 *>(s + i);
}

// kOutGlobal: gemv_finish writes the results to a.out itself, else to shared memory, then write_out.
template <class Ring, bool kOutGlobal>
__global__ void __launch_bounds__(kThreads, 1) tma_kernel(const __grid_constant__ Args a) {
    extern __shared__ __align__(1024) char smem_raw[];
    char *smem = aligned_smem(smem_raw);
    bf16 *xs = reinterpret_cast<bf16 *>(smem + Ring::kBytes);
    float *out = reinterpret_cast<float *>(smem + Ring::kBytes + kInputBytes);
    Ring &ring = *reinterpret_cast<Ring *>(smem + Ring::kBytes + kInputBytes + (kOutGlobal ? 0 : kOutBytes));
    ring_init(ring, smem);
    for (int i = blockIdx.x; i < a.ntiles; i += gridDim.x) {
        const BenchTile bt = a.tiles[i];
        const TensorMap *map = a.maps + bt.matrix;
        const TensorMap *tall = Ring::kBoxRows > kTmaBoxRows ? a.tall_maps + bt.matrix : nullptr;
        const GemvTile t{{{map, bt.row0[0], bt.rows[0], tall}, {map, bt.row0[1], bt.rows[1], tall}}, bt.k0, bt.k1};
        float *dst = a.out + (size_t)i * a.rows * 8;
        gemv_begin(ring, t);
        wait_ready(a.ready);
        stage_swizzled(xs, a.x + bt.k0, a.batch, bt.k1 - bt.k0, kXStride);
        gemv_finish(ring, t, xs, kOutGlobal ? dst : out);
        if (!kOutGlobal) write_out(out, dst, a.rows * 8);
        __syncthreads();
    }
}

// Asks the TMA unit to pull [p, p + bytes) into L2 (both 16-byte aligned), without waiting.
__device__ __forceinline__ void prefetch_l2(const void *p, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// ---- k loops of the mma.sync GEMV, variants of common.cuh's tile_dot ---------------------------
// Each adds rows lo, hi (the lane's rows g, g + 8) . input row g over k in [ka, kb) (multiples of
// 32) into c, with the lane layout of tile_dot: 16 contiguous bytes per row and 32-wide k step.
// The last argument is shared scratch (GemvSmem::extra), for the variants that stage through it.

// The weight loads' flavours (the ld/ paths): the megakernel's load_weight (streaming, 256-byte
// L2 fetches); its form before 308b241 (non-coherent, no L1 allocation, an L2 evict_first
// policy) alone and with a 256-byte fetch; non-coherent alone; a plain coherent load; L2 only
// (.cg); streaming (.cs) alone.
enum LoadFlavour { kLoadEngine, kLoadNcEvictFirst, kLoadNc, kLoadPlain, kLoadCg, kLoadCs, kLoadNc256 };
template <int F>
__device__ __forceinline__ uint4 load_flavour(const bf16 *p) {
    uint4 v;
    if constexpr (F == kLoadEngine) {
        v = load_weight(p);
    } else if constexpr (F == kLoadNcEvictFirst) {
        asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p), "l"(evict_first_policy()));
    } else if constexpr (F == kLoadNc) {
        asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else if constexpr (F == kLoadPlain) {
        asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else if constexpr (F == kLoadCg) {
        asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else if constexpr (F == kLoadCs) {
        asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else {
        asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p), "l"(evict_first_policy()));
    }
    return v;
}

// Steps i < n (n <= S) of the 32-wide k steps from k: loads into wl, wh; mmas from them. A lane's
// weights of column k lie at lo + kScale * k (1 row-major, 16 in the tiled layout).
template <int S, int F = kLoadEngine, int kScale = 1>
__device__ __forceinline__ void load_steps(uint4 (&wl)[S], uint4 (&wh)[S], const bf16 *lo, const bf16 *hi, int k,
                                           int n) {
#pragma unroll
    for (int i = 0; i < S; i++)
        if (i < n) {
            wl[i] = load_flavour<F>(lo + kScale * (k + 32 * i));
            wh[i] = load_flavour<F>(hi + kScale * (k + 32 * i));
        }
}

template <int S>
__device__ __forceinline__ void mma_steps(float c[4], const uint4 (&wl)[S], const uint4 (&wh)[S], uint32_t x,
                                          int k, int n) {
#pragma unroll
    for (int i = 0; i < S; i++)
        if (i < n) mma_k32(c, wl[i], wh[i], load_in_k32(x, k + 32 * i));
}

// Bursts of S steps loaded into registers, then their mmas; the rest in one burst of fewer steps.
template <int S, int F = kLoadEngine, int kScale = 1>
struct DotBurst {
    static constexpr bool kWarpgroups = false;  // mma.sync for every tile count
    static constexpr bool kTiled = false;       // gemv passes each lane's row pointers
    static constexpr bool kStaged = false;      // gemv stages no input during the call
    __device__ __forceinline__ void operator()(const bf16 *lo, const bf16 *hi, uint32_t x, int ka, int kb,
                                               float c[4], char *) const {
        uint4 wl[S], wh[S];
        int k = ka;
        for (; k + 32 * S <= kb; k += 32 * S) {
            load_steps<S, F, kScale>(wl, wh, lo, hi, k, S);
            mma_steps(c, wl, wh, x, k, S);
        }
        const int n = (kb - k) / 32;
        if (n > 0) {
            load_steps<S, F, kScale>(wl, wh, lo, hi, k, n);
            mma_steps(c, wl, wh, x, k, n);
        }
    }
};

// Batches of S steps through a ring of NB register buffers: before running batch b from buffer
// b % NB, a lane issues the loads of batch b + NB - 1 into the buffer batch b - 1 used, so NB - 1
// batches stay in flight while one is consumed. Whole batches only; the steps past the last
// whole batch follow as one burst. Caveat: ptxas (CUDA 13.0) gives the loads of different
// batches the same scoreboard, so the first mma of a batch also waits for the newer batch's
// loads; the SASS shows no wait that leaves loads in flight.
template <int S, int NB>
struct DotRing {
    static constexpr bool kWarpgroups = false;  // mma.sync for every tile count
    static constexpr bool kTiled = false;       // gemv passes each lane's row pointers
    static constexpr bool kStaged = false;      // gemv stages no input during the call
    __device__ __forceinline__ void operator()(const bf16 *lo, const bf16 *hi, uint32_t x, int ka, int kb,
                                               float c[4], char *) const {
        constexpr int kBatch = 32 * S;  // k per batch
        uint4 wl[NB][S], wh[NB][S];
        const int batches = (kb - ka) / kBatch;
#pragma unroll
        for (int i = 0; i < NB - 1; i++)
            if (i < batches) load_steps(wl[i], wh[i], lo, hi, ka + i * kBatch, S);
        int b = 0;
        for (; b + NB <= batches; b += NB) {
#pragma unroll
            for (int i = 0; i < NB; i++) {
                if (b + i + NB - 1 < batches)
                    load_steps(wl[(i + NB - 1) % NB], wh[(i + NB - 1) % NB], lo, hi,
                               ka + (b + i + NB - 1) * kBatch, S);
                mma_steps(c, wl[i], wh[i], x, ka + (b + i) * kBatch, S);
            }
        }
#pragma unroll
        for (int i = 0; i < NB - 1; i++)  // the batches loaded but not run: fewer than NB
            if (b + i < batches) mma_steps(c, wl[i], wh[i], x, ka + (b + i) * kBatch, S);
        const int k = ka + batches * kBatch, n = (kb - k) / 32;
        if (n > 0) {
            load_steps(wl[0], wh[0], lo, hi, k, n);
            mma_steps(c, wl[0], wh[0], x, k, n);
        }
    }
};

// The weights through shared memory with cp.async, whose commit groups complete in order: a
// per-thread ring of NB batches of S steps (each step: the lane's 16 bytes of row lo, then of row
// hi, in two planes of kThreads x 16 bytes, so a warp's accesses are contiguous). Before running
// batch b the lane issues batch b + NB - 1 into the slot batch b - 1 used (its loads into
// registers are done), then waits until only the NB - 1 newest groups are pending. Each thread
// reads only what it copied itself, so no barrier. A short last batch is guarded; every batch
// commits a group, empty or not, so the count stays exact.
template <int S, int NB>
struct DotAsync {
    static constexpr bool kWarpgroups = false;  // mma.sync for every tile count
    static constexpr bool kTiled = false;       // gemv passes each lane's row pointers
    static constexpr bool kStaged = false;      // gemv stages no input during the call
    static constexpr int kStepBytes = 2 * kThreads * 16;
    static constexpr int kScratch = NB * S * kStepBytes;
    __device__ __forceinline__ void operator()(const bf16 *lo, const bf16 *hi, uint32_t x, int ka, int kb,
                                               float c[4], char *scratch) const {
        const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(scratch)) + threadIdx.x * 16;
        const int batches = ((kb - ka) / 32 + S - 1) / S;
        auto issue = [&](int b) {
            if (b < batches) {
                const uint32_t slot = base + (uint32_t)(b % NB) * (S * kStepBytes);
#pragma unroll
                for (int i = 0; i < S; i++) {
                    const int k = ka + (b * S + i) * 32;
                    if (k < kb) {
                        cp_async16(slot + i * kStepBytes, lo + k);
                        cp_async16(slot + i * kStepBytes + kThreads * 16, hi + k);
                    }
                }
            }
            asm volatile("cp.async.commit_group;" ::: "memory");
        };
#pragma unroll
        for (int b = 0; b < NB - 1; b++) issue(b);
        for (int b = 0; b < batches; b++) {
            issue(b + NB - 1);
            asm volatile("cp.async.wait_group %0;" ::"n"(NB - 1) : "memory");
            const uint32_t slot = base + (uint32_t)(b % NB) * (S * kStepBytes);
#pragma unroll
            for (int i = 0; i < S; i++) {
                const int k = ka + (b * S + i) * 32;
                if (k < kb)
                    mma_k32(c, lds128(slot + i * kStepBytes), lds128(slot + i * kStepBytes + kThreads * 16),
                            load_in_k32(x, k));
            }
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");  // only empty groups are left
    }

    // 16 bytes global -> shared, cached in L2 only.
    __device__ __forceinline__ static void cp_async16(uint32_t dst, const bf16 *src) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
    }
    __device__ __forceinline__ static uint4 lds128(uint32_t addr) {
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
                     : "memory");
        return v;
    }
};

// Copies rows x K bf16 (K % 32 == 0) from global memory (src_stride apart) to a GEMV input,
// four 16-byte loads in flight per thread (the megakernel's staging before its producers wrote
// the inputs in this layout, common.cuh's stage_image). The caller's barrier publishes it, to wgmma's
// reads (the async proxy) too.
__device__ __forceinline__ void stage_bf16(bf16 *dst, const bf16 *src, int rows, int K, int src_stride) {
    const int chunks = K / 8, total = rows * chunks;
#pragma unroll 1
    for (int base = threadIdx.x; base < total; base += 4 * kThreads) {
        uint4 v[4] = {};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = base + j * kThreads;
            if (i < total)
                v[j] = load_l2(reinterpret_cast<const uint4 *>(src + (size_t)(i / chunks) * src_stride) + i % chunks);
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int i = base + j * kThreads;
            if (i < total) store_in_chunk(dst, i / chunks, i % chunks, v[j]);
        }
    }
    fence_proxy_async_shared();
}

// common.cuh's gemv() as the megakernel runs it on row-major weights (the mma.sync and
// mma.sync+pf paths) and on tiled ones (tiled/gemv).
using CommonDot = RowMajorDot;

// dst = the first `rows` rows of each matrix (K wide) of src in the tiled layout (common.cuh's
// tiled_index). A lane's columns 8 t + 32 s + e of its row r then lie at tiled_index(r, 0, K) +
// 8 t + 16 * 32 s + e: DotBurst<.., 16> reads lo + 16 k.
__global__ void tile_layout(const bf16 *src, bf16 *dst, size_t matrix_elems, int rows, int K) {
    const size_t per_matrix = (size_t)rows * K;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < kMatrices * per_matrix;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t m = i / per_matrix, j = i % per_matrix;
        dst[m * matrix_elems + tiled_index((int)(j / K), (int)(j % K), K)] = src[m * matrix_elems + j];
    }
}

template <bool kPrefetch, class Dot, bool kTiled = false>
__global__ void __launch_bounds__(kThreads, 1) mma_kernel(const __grid_constant__ Args a) {
    extern __shared__ __align__(1024) char smem_raw[];
    for (int i = blockIdx.x; i < a.ntiles; i += gridDim.x) {
        const BenchTile bt = a.tiles[i];
        const int K = a.K, width = bt.k1 - bt.k0, n0 = bt.rows[0];
        const bf16 *W = a.pool + bt.matrix * a.matrix_elems + bt.k0;
        if (kPrefetch && threadIdx.x == 0) {
            for (int g = 0; g < 2; g++) {
                if (!bt.rows[g]) continue;
                const bf16 *p = W + (size_t)bt.row0[g] * K;
                if (width == K) prefetch_l2(p, (uint32_t)bt.rows[g] * K * sizeof(bf16));
                else
                    for (int r = 0; r < bt.rows[g]; r++) prefetch_l2(p + (size_t)r * K, width * sizeof(bf16));
            }
        }
        wait_ready(a.ready);
        GemvSmem s(smem_raw, width, a.rows);
        stage_bf16(s.in, a.x + bt.k0, a.batch, width, kXStride);
        __syncthreads();
        const auto row = [&](int r) {
            const int mr = r < n0 ? bt.row0[0] + r : bt.row0[1] + r - n0;
            if constexpr (kTiled) return a.tiled + bt.matrix * a.matrix_elems + tiled_index(mr, 0, K) + 16 * bt.k0;
            return W + (size_t)mr * K;
        };
        gemv(row, a.rows, s.in, width, s.out, s.red, Dot{}, s.extra);
        write_out(s.out, a.out + (size_t)i * a.rows * 8, a.rows * 8);
        __syncthreads();
    }
}

__device__ __host__ inline uint32_t mix(uint64_t v) {
    v ^= v >> 33;
    v *= 0xff51afd7ed558ccdull;
    v ^= v >> 33;
    v *= 0xc4ceb9fe1a85ec53ull;
    v ^= v >> 33;
    return (uint32_t)v;
}

__global__ void fill_random(bf16 *p, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16((mix(i * 0x9e3779b97f4a7c15ull + seed) >> 8) * (2.f / 16777216.f) - 1.f);
}

// The tiles of a shape over the matrices, and each matrix's row count.
std::vector<BenchTile> make_tiles(const Shape &sh, size_t matrix_elems, int &matrix_rows) {
    std::vector<BenchTile> tiles;
    const int row_tiles = (int)(matrix_elems / sh.K / sh.rows);
    matrix_rows = row_tiles * sh.rows;
    const int half = sh.rows / 2, width = sh.K / sh.ksplit;
    for (int m = 0; m < kMatrices; m++)
        for (int t = 0; t < row_tiles; t++)
            for (int s = 0; s < sh.ksplit; s++) {
                BenchTile b{};
                b.matrix = m;
                if (sh.segments == 2) {  // gate rows from the first half of the matrix, up rows from the second
                    b.row0[0] = t * half, b.rows[0] = half;
                    b.row0[1] = matrix_rows / 2 + t * half, b.rows[1] = half;
                } else {
                    b.row0[0] = t * sh.rows, b.rows[0] = sh.rows;
                }
                b.k0 = s * width, b.k1 = (s + 1) * width;
                tiles.push_back(b);
            }
    return tiles;
}

struct Sample {
    int tile;
    std::vector<std::vector<float>> got;  // per path
};

using Kernel = void (*)(Args);
struct Path {
    const char *name;
    Kernel kernel;
    int smem;
};

using RingBox64 = TmaRingT<4, 32 * 1024, kTallBoxRows>;
using Ring8x16 = TmaRingT<8, 16 * 1024, kTmaBoxRows>;
using Ring6x32 = TmaRingT<6, 32 * 1024, kTmaBoxRows>;
using Ring6x32Box64 = TmaRingT<6, 32 * 1024, kTallBoxRows>;

const Path kPaths[] = {
    {"tma+wgmma", tma_kernel<TmaRing, false>, tma_smem<TmaRing, false>()},
    {"mma.sync", mma_kernel<false, CommonDot>, kSmem},
    {"mma.sync+pf", mma_kernel<true, CommonDot>, kSmem},
    {"mma.sync/16", mma_kernel<false, DotBurst<16>>, kSmem},
    {"mma.sync/pipe", mma_kernel<false, DotRing<8, 2>>, kSmem},
    {"mma.sync/cpasync16", mma_kernel<false, DotAsync<4, 4>>, mma_smem(DotAsync<4, 4>::kScratch)},
    {"mma.sync/cpasync20", mma_kernel<false, DotAsync<4, 5>>, mma_smem(DotAsync<4, 5>::kScratch)},
    {"tma/box64", tma_kernel<RingBox64, false>, tma_smem<RingBox64, false>()},
    {"tma/8x16K", tma_kernel<Ring8x16, false>, tma_smem<Ring8x16, false>()},
    {"tma/6x32K", tma_kernel<Ring6x32, true>, tma_smem<Ring6x32, true>()},
    {"tma/6x32K/box64", tma_kernel<Ring6x32Box64, true>, tma_smem<Ring6x32Box64, true>()},
    {"ld/engine", mma_kernel<false, DotBurst<8, kLoadEngine>>, kSmem},
    {"ld/nc-ef", mma_kernel<false, DotBurst<8, kLoadNcEvictFirst>>, kSmem},
    {"ld/nc", mma_kernel<false, DotBurst<8, kLoadNc>>, kSmem},
    {"ld/plain", mma_kernel<false, DotBurst<8, kLoadPlain>>, kSmem},
    {"ld/cg", mma_kernel<false, DotBurst<8, kLoadCg>>, kSmem},
    {"ld/cs", mma_kernel<false, DotBurst<8, kLoadCs>>, kSmem},
    {"ld/nc256", mma_kernel<false, DotBurst<8, kLoadNc256>>, kSmem},
    {"tiled/engine", mma_kernel<false, DotBurst<8, kLoadEngine, 16>, true>, kSmem},
    {"tiled/cs", mma_kernel<false, DotBurst<8, kLoadCs, 16>, true>, kSmem},
    {"tiled/gemv", mma_kernel<false, TileDot, true>, kSmem},
};
constexpr int kNumPaths = sizeof(kPaths) / sizeof(kPaths[0]);

void launch(const Path &p, int grid, const Args &args) {
    void *params[] = {const_cast<Args *>(&args)};
    CHECK(cudaLaunchKernel(reinterpret_cast<const void *>(p.kernel), dim3(grid), dim3(kThreads), params, p.smem, 0));
}

}  // namespace

int main(int argc, char **argv) {
    bool quick = false;
    std::vector<std::string> filters;
    int ctas = 0, pool_mib = 0;
    for (int i = 1; i < argc; i++) {
        if (!std::strcmp(argv[i], "--quick")) quick = true;
        else if (!std::strcmp(argv[i], "--filter") && i + 1 < argc) filters.push_back(argv[++i]);
        else if (!std::strcmp(argv[i], "--ctas") && i + 1 < argc && (ctas = std::atoi(argv[++i])) > 0) continue;
        else if (!std::strcmp(argv[i], "--pool-mib") && i + 1 < argc && (pool_mib = std::atoi(argv[++i])) > 0) continue;
        else {
            std::fprintf(stderr, "usage: %s [--quick] [--filter SUBSTR]... [--ctas N] [--pool-mib M]\n", argv[0]);
            return 2;
        }
    }
    std::vector<int> paths;  // the paths to run, in kPaths order
    for (int p = 0; p < kNumPaths; p++) {
        bool match = filters.empty();
        for (const std::string &f : filters) match |= std::strstr(kPaths[p].name, f.c_str()) != nullptr;
        if (match) paths.push_back(p);
    }
    if (paths.empty()) {
        std::fprintf(stderr, "no path matches the filter; paths:");
        for (const Path &p : kPaths) std::fprintf(stderr, " %s", p.name);
        std::fprintf(stderr, "\n");
        return 2;
    }
    const size_t pool_bytes = pool_mib ? (size_t)pool_mib << 20 : quick ? (size_t)512 << 20 : (size_t)2 << 30;
    const int reps = quick ? 1 : 5, samples = quick ? 12 : 40;

    int dev = 0, sms = 0, clock_khz = 0, smem_optin = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int grid = ctas ? ctas : sms;
    CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
    CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    cudaDeviceProp prop{};
    CHECK(cudaGetDeviceProperties(&prop, dev));
    std::printf("%s: %d SMs, %.0f MHz; %zu MiB of weights in %d matrices per shape, %d rep(s), %d CTAs\n", prop.name,
                sms, clock_khz / 1e3, pool_bytes >> 20, kMatrices, reps, grid);

    bf16 *pool = nullptr, *tiled = nullptr;
    CHECK(cudaMalloc(&pool, pool_bytes));
    bool any_tiled = false;
    for (int p : paths) any_tiled |= std::strncmp(kPaths[p].name, "tiled/", 6) == 0;
    if (any_tiled) CHECK(cudaMalloc(&tiled, pool_bytes));
    const size_t pool_elems = pool_bytes / sizeof(bf16), matrix_elems = pool_elems / kMatrices;
    fill_random<<<4 * sms, 256>>>(pool, pool_elems, 1);
    CHECK(cudaGetLastError());

    std::vector<bf16> hx(8 * kXStride);
    for (size_t i = 0; i < hx.size(); i++)
        hx[i] = __float2bfloat16((mix(i + 0x1234567ull) >> 8) * (2.f / 16777216.f) - 1.f);
    bf16 *x = nullptr;
    uint32_t *ready = nullptr;
    TensorMap *maps = nullptr, *tall_maps = nullptr;
    CHECK(cudaMalloc(&x, hx.size() * sizeof(bf16)));
    CHECK(cudaMemcpy(x, hx.data(), hx.size() * sizeof(bf16), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&ready, sizeof(uint32_t)));
    const uint32_t one = 1;
    CHECK(cudaMemcpy(ready, &one, sizeof one, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&maps, kMatrices * sizeof(TensorMap)));
    CHECK(cudaMalloc(&tall_maps, kMatrices * sizeof(TensorMap)));

    {  // load the kernels before anything is timed (lazy module loading would land in the first run)
        std::vector<int> runnable;
        for (int p : paths) {
            if (kPaths[p].smem > smem_optin) {
                std::printf("%s: skipped, needs %d bytes of shared memory (%d available)\n", kPaths[p].name,
                            kPaths[p].smem, smem_optin);
                continue;
            }
            CHECK(cudaFuncSetAttribute(reinterpret_cast<const void *>(kPaths[p].kernel),
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, kPaths[p].smem));
            launch(kPaths[p], 1, Args{});
            runnable.push_back(p);
        }
        CHECK(cudaDeviceSynchronize());
        paths = runnable;
    }
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));

    double worst_all = 0.0;
    bool failed = false;
    for (const Shape &sh : kShapes) {
        int matrix_rows = 0;
        const std::vector<BenchTile> tiles = make_tiles(sh, matrix_elems, matrix_rows);
        if (tiled) {
            tile_layout<<<4 * sms, 256>>>(pool, tiled, matrix_elems, matrix_rows, sh.K);
            CHECK(cudaGetLastError());
        }
        const int ntiles = (int)tiles.size(), width = sh.K / sh.ksplit;
        std::vector<TensorMap> hmaps(kMatrices), htall(kMatrices);
        try {
            for (int m = 0; m < kMatrices; m++) {
                hmaps[m] = make_weight_map(pool + m * matrix_elems, matrix_rows, sh.K);
                htall[m] = make_weight_map(pool + m * matrix_elems, matrix_rows, sh.K, kTallBoxRows);
            }
        } catch (const std::exception &e) {
            std::fprintf(stderr, "%s: %s\n", sh.name, e.what());
            return 2;
        }
        CHECK(cudaMemcpy(maps, hmaps.data(), kMatrices * sizeof(TensorMap), cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(tall_maps, htall.data(), kMatrices * sizeof(TensorMap), cudaMemcpyHostToDevice));
        BenchTile *dtiles = nullptr;
        float *out = nullptr;
        const size_t out_elems = (size_t)ntiles * sh.rows * 8;
        CHECK(cudaMalloc(&dtiles, tiles.size() * sizeof(BenchTile)));
        CHECK(cudaMemcpy(dtiles, tiles.data(), tiles.size() * sizeof(BenchTile), cudaMemcpyHostToDevice));
        CHECK(cudaMalloc(&out, out_elems * sizeof(float)));
        const double bytes = (double)ntiles * sh.rows * width * sizeof(bf16);

        std::vector<Sample> picks;
        for (int j = 0; j < samples; j++)
            picks.push_back({(int)((long long)j * (ntiles - 1) / (samples - 1)),
                             std::vector<std::vector<float>>(kNumPaths)});

        for (int batch : {1, 8}) {
            const Args args{dtiles, ntiles, sh.rows, sh.K, batch, maps, tall_maps, pool, tiled, matrix_elems, x, out,
                            ready};
            double best[kNumPaths];
            for (int path : paths) {
                CHECK(cudaMemset(out, 0xff, out_elems * sizeof(float)));  // NaN where nothing is written
                best[path] = 1e30;
                for (int r = 0; r < reps + (quick ? 0 : 1); r++) {
                    CHECK(cudaEventRecord(e0));
                    launch(kPaths[path], grid, args);
                    CHECK(cudaEventRecord(e1));
                    CHECK(cudaEventSynchronize(e1));
                    CHECK(cudaGetLastError());
                    float ms = 0.f;
                    CHECK(cudaEventElapsedTime(&ms, e0, e1));
                    if (quick || r > 0) best[path] = std::min(best[path], (double)ms);
                }
                for (Sample &p : picks) {
                    p.got[path].resize((size_t)sh.rows * 8);
                    CHECK(cudaMemcpy(p.got[path].data(), out + (size_t)p.tile * sh.rows * 8,
                                     p.got[path].size() * sizeof(float), cudaMemcpyDeviceToHost));
                }
            }
            // CPU reference over the sampled tiles; error relative to sum |w| |x| of the row.
            double worst[kNumPaths] = {};
            std::vector<bf16> w((size_t)sh.rows * width);
            for (const Sample &p : picks) {
                const BenchTile &bt = tiles[p.tile];
                for (int g = 0, r0 = 0; g < 2; r0 += bt.rows[g], g++) {
                    if (!bt.rows[g]) continue;
                    const bf16 *src = pool + bt.matrix * matrix_elems + (size_t)bt.row0[g] * sh.K + bt.k0;
                    CHECK(cudaMemcpy2D(w.data() + (size_t)r0 * width, width * sizeof(bf16), src, sh.K * sizeof(bf16),
                                       width * sizeof(bf16), bt.rows[g], cudaMemcpyDeviceToHost));
                }
                for (int r = 0; r < sh.rows; r++)
                    for (int n = 0; n < batch; n++) {
                        double ref = 0, scale = 0;
                        for (int k = 0; k < width; k++) {
                            const double a = __bfloat162float(w[(size_t)r * width + k]);
                            const double b = __bfloat162float(hx[(size_t)n * kXStride + bt.k0 + k]);
                            ref += a * b, scale += std::fabs(a * b);
                        }
                        for (int path : paths) {
                            const double err = std::fabs(p.got[path][(size_t)r * 8 + n] - ref) / std::max(scale, 1e-30);
                            worst[path] = std::isnan(err) ? INFINITY : std::max(worst[path], err);
                        }
                    }
            }
            for (int path : paths) {
                const double s = best[path] * 1e-3;
                const bool ok = worst[path] <= 1e-2;
                failed |= !ok;
                worst_all = std::max(worst_all, worst[path]);
                std::printf("%-10s %-18s batch %d  %7.1f GB/s  %7.2f us/tile  (%4.1f GB/s per SM)  max err %.2e%s\n",
                            sh.name, kPaths[path].name, batch, bytes / s / 1e9, s * 1e6 * grid / ntiles,
                            bytes / s / 1e9 / grid, worst[path], ok ? "" : "  MISMATCH");
            }
        }
        CHECK(cudaFree(dtiles));
        CHECK(cudaFree(out));
    }
    std::printf("worst error %.2e: %s\n", worst_all, failed ? "MISMATCH" : "ok");
    return failed ? 1 : 0;
}
