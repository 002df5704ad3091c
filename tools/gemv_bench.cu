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
//   tiled/bulkSxN   gemv()'s work split on that copy, each warp's band streamed by bulk copies
//                   of S KB into a ring of N slots of its own (DotBulk; 8 warps x S x N KB per SM)
//   tiled/ringCxN   one ring per CTA of N slots of C KB that runs on across its tiles, every warp
//                   reading every slot: a slot is C / bands KB of each band, a bulk copy each
//   tiled/pieceN    the same with a producer warp and slots of one bulk copy of up to 32 KB (a
//                   piece of one band's K range, contiguous in the tiled layout), N in flight
// Every output of a sample of tiles is checked against a CPU reference (error relative to the
// row's sum |w| |x|, 1e-2 at most). One line per (shape, path, batch); exit code 1 on a mismatch.
//   northmk_gemv_bench [--quick] [--read-peak] [--filter SUBSTR]... [--ctas N] [--pool-mib M] [--shuffle]
//     --quick: 512 MiB of weights, one repetition; --read-peak: first the device's read
//     bandwidth with no GEMV (read_ldg, read_bulk; --ctas sets their SMs); --filter: only the
//     paths whose name contains SUBSTR (repeatable: any of them); --ctas: launch N CTAs (default
//     one per SM: what one SM streams when fewer share the DRAM); --pool-mib: M MiB of weights
//     (small enough, and L2 holds them after the first repetition: what an SM streams from L2).
//     GB/s per SM divides by the CTAs launched. --shuffle: the tiles in a random order (a fixed
//     seed) instead of the matrices' order, so that the CTAs' tiles at any moment lie in scattered
//     pages of the pool, as a step's routed experts do (with a pool larger than the GPU's TLBs
//     cover, what the address translation of scattered tiles costs).
#include <cuda/atomic>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
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

// As the megakernel's wait_for: thread 0 polls an acquire load (poll_ready), then a barrier.
__device__ __forceinline__ void poll_ready(const uint32_t *counter) {
    if (threadIdx.x == 0) {
        cuda::atomic_ref<const uint32_t, cuda::thread_scope_device> c(*counter);
        while (c.load(cuda::memory_order_acquire) < 1u) __nanosleep(20);
    }
}
__device__ __forceinline__ void wait_ready(const uint32_t *counter) {
    poll_ready(counter);
    __syncthreads();
}

// The matrix row of a tile's row r (segment 0's rows first, then segment 1's).
__device__ __forceinline__ int tile_row(const BenchTile &bt, int r) {
    return r < bt.rows[0] ? bt.row0[0] + r : bt.row0[1] + r - bt.rows[0];
}
// In the tiled copy: row r of tile bt (r % 16 == 0: a band's start) at its 32-wide k step s.
__device__ __forceinline__ const bf16 *tiled_at(const Args &a, const BenchTile &bt, int r, int s) {
    return a.tiled + bt.matrix * a.matrix_elems + tiled_index(tile_row(bt, r), 0, a.K) + 16 * (bt.k0 + 32 * s);
}
// The tiles CTA blockIdx.x takes: blockIdx.x, + gridDim.x, ...
__device__ __forceinline__ int cta_tiles(const Args &a) {
    return a.ntiles > (int)blockIdx.x ? (a.ntiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
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

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
                 : "memory");
    return v;
}

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
};

// The tiled layout's weights through a ring of bulk copies per warp (the TMA unit's 1-D form): a
// warp's unit, one 16-row band over [ka, kb), is (kb - ka) / 32 contiguous blocks of 1 KB, so
// lane 0 copies it in chunks of S blocks into the warp's NB slots, each completing on its own
// mbarrier; the lanes read their 16 bytes of rows g and g + 8 of each block from shared memory
// (16 * lane and 512 + 16 * lane: a warp reads 512 contiguous bytes, no bank conflict) and
// run the same mma_k32 as the register path. Once every lane has read a slot (__syncwarp after
// its mmas took the registers) lane 0 refills it with chunk j + NB. The barriers live for one
// unit: lane 0 initializes them at its start and invalidates them at its end.
template <int S, int NB>
struct DotBulk {
    static constexpr bool kWarpgroups = false;  // mma.sync for every tile count
    static constexpr bool kTiled = true;        // gemv passes lo = band + 8 lane, hi = lo + 256
    static constexpr bool kStaged = false;      // gemv stages no input during the call
    static constexpr int kSlotBytes = S * 1024;
    static constexpr int kWarpBytes = NB * kSlotBytes;
    static constexpr int kScratch = kWarps * (kWarpBytes + NB * 8);
    __device__ __forceinline__ void operator()(const bf16 *lo, const bf16 *, uint32_t x, int ka, int kb, float c[4],
                                               char *scratch) const {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        char *ring = scratch + warp * kWarpBytes;
        uint64_t *bar = reinterpret_cast<uint64_t *>(scratch + kWarps * kWarpBytes) + warp * NB;
        const char *src = reinterpret_cast<const char *>(lo - 8 * lane) + 32 * (size_t)ka;  // block ka / 32
        const int blocks = (kb - ka) / 32, chunks = (blocks + S - 1) / S;
        auto issue = [&](int j) {
            const uint32_t bytes = (uint32_t)min(S, blocks - j * S) * 1024;
            mbar_arrive_expect(&bar[j % NB], bytes);
            bulk_load(ring + (j % NB) * kSlotBytes, src + (size_t)j * kSlotBytes, bytes, &bar[j % NB]);
        };
        if (lane == 0) {
            for (int i = 0; i < NB; i++) mbar_init(&bar[i], 1);
            mbar_init_fence();
            for (int j = 0; j < NB && j < chunks; j++) issue(j);
        }
        __syncwarp();
        const uint32_t ring_addr = smem_u32(ring) + 16 * lane;
        float acc[kChains][4] = {};
#pragma unroll 1
        for (int j = 0; j < chunks; j++) {
            mbar_wait(&bar[j % NB], (j / NB) & 1);
            const uint32_t slot = ring_addr + (j % NB) * kSlotBytes;
            const int n = min(S, blocks - j * S);
#pragma unroll
            for (int i = 0; i < S; i++)
                if (i < n)
                    mma_k32(acc[i % kChains], lds128(slot + i * 1024),
                            lds128(slot + i * 1024 + 512), load_in_k32(x, ka + 32 * (j * S + i)));
            __syncwarp();
            if (lane == 0 && j + NB < chunks) issue(j + NB);
        }
        if (lane == 0)
            for (int i = 0; i < NB; i++) mbar_inval(&bar[i]);
        __syncwarp();
#pragma unroll
        for (int j = 0; j < kChains; j++)
#pragma unroll
            for (int v = 0; v < 4; v++) c[v] += acc[j][v];
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
        const int K = a.K, width = bt.k1 - bt.k0;
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
            if constexpr (kTiled) return tiled_at(a, bt, r, 0);
            return W + (size_t)tile_row(bt, r) * K;
        };
        gemv(row, a.rows, s.in, width, s.out, s.red, Dot{}, s.extra);
        write_out(s.out, a.out + (size_t)i * a.rows * 8, a.rows * 8);
        __syncthreads();
    }
}

// ---- the device's read bandwidth, no GEMV (--read-peak) ---------------------------------------
// Every thread of a full-occupancy grid reads 16-byte chunks by streaming loads, four in flight.
__global__ void read_ldg(const uint4 *p, size_t n, uint32_t *sink) {
    uint32_t acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];"
                         : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                         : "l"(p + i + j * stride));
#pragma unroll
        for (int j = 0; j < 4; j++) acc ^= v[j].x ^ v[j].y ^ v[j].z ^ v[j].w;
    }
    for (; i < n; i += stride) acc ^= p[i].x;
    if (acc == 0x9e3779b9u) *sink = acc;  // keeps the loads
}

// One CTA per SM streams its contiguous share into a ring of kReadSlots x kReadChunk bytes of
// shared memory by bulk copies, thread 0 refilling each slot as soon as it lands.
constexpr int kReadSlots = 6, kReadChunk = 32 * 1024;
__global__ void read_bulk(const char *p, size_t bytes) {
    extern __shared__ __align__(1024) char smem_raw[];
    uint64_t *bar = reinterpret_cast<uint64_t *>(smem_raw + kReadSlots * kReadChunk);
    if (threadIdx.x != 0) return;
    const size_t share = bytes / gridDim.x / kReadChunk * kReadChunk;
    const char *src = p + blockIdx.x * share;
    const int chunks = (int)(share / kReadChunk);
    for (int i = 0; i < kReadSlots; i++) mbar_init(&bar[i], 1);
    mbar_init_fence();
    for (int j = 0; j < chunks + kReadSlots; j++) {
        const int slot = j % kReadSlots;
        if (j >= kReadSlots) mbar_wait(&bar[slot], ((j - kReadSlots) / kReadSlots) & 1);
        if (j < chunks) {
            mbar_arrive_expect(&bar[slot], kReadChunk);
            bulk_load(smem_raw + slot * kReadChunk, src + (size_t)j * kReadChunk, kReadChunk, &bar[slot]);
        }
    }
}

// Best GB/s of `reps` launches of each read kernel over the pool (bytes read / time).
void read_peak(const bf16 *pool, size_t bytes, int sms, int reps) {
    uint32_t *sink = nullptr;
    CHECK(cudaMalloc(&sink, sizeof(uint32_t)));
    const int bulk_smem = kReadSlots * kReadChunk + kReadSlots * 8;
    CHECK(cudaFuncSetAttribute(reinterpret_cast<const void *>(read_bulk), cudaFuncAttributeMaxDynamicSharedMemorySize,
                               bulk_smem));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    for (int kind = 0; kind < 2; kind++) {
        double best = 1e30;
        for (int r = 0; r < reps + 1; r++) {
            CHECK(cudaEventRecord(e0));
            if (kind == 0)
                read_ldg<<<sms * 8, 256>>>(reinterpret_cast<const uint4 *>(pool), bytes / 16, sink);
            else
                read_bulk<<<sms, 32, bulk_smem>>>(reinterpret_cast<const char *>(pool), bytes);
            CHECK(cudaEventRecord(e1));
            CHECK(cudaEventSynchronize(e1));
            CHECK(cudaGetLastError());
            float ms = 0.f;
            CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (r > 0) best = std::min(best, (double)ms);
        }
        const double read = kind == 0 ? (double)bytes : (double)(bytes / sms / kReadChunk * kReadChunk) * sms;
        std::printf("read peak  %-18s %7.1f GB/s  (%d CTAs of %d threads)\n",
                    kind == 0 ? "ld.global.cs x4" : "bulk 6 x 32 KB", read / (best * 1e-3) / 1e9,
                    kind == 0 ? sms * 8 : sms, kind == 0 ? 256 : 32);
    }
    CHECK(cudaFree(sink));
}

// The tiled layout's weights through one ring per CTA that runs on across its tiles (tiled/ringCxN):
// N slots of C KB, each holding the same `kb` 32-wide k steps of every 16-row band of the tile
// (C / bands KB a band, one bulk copy each); lane 0 of warp 0 fills them, before it consumes slot
// c issuing up to slot c + N - 1 (which needs only slots before c released, as tma_gemv's ring), so
// the next tile's weights stream while this one's last slots are consumed and its outputs written.
// Warp w takes band w % bands and, with fewer than 8 bands, the part w / bands of each slot's
// steps; parts add up in shared memory at the tile's end. Slot c's empty barrier takes the 8
// warps' arrivals.
template <int SlotKB>
struct RingShape {
    static constexpr int kSlotBytes = SlotKB * 1024;
    int bands, parts, kb, slots;  // per tile
    __device__ RingShape(int rows, int width) {
        bands = rows / 16;
        parts = bands >= kWarps ? 1 : kWarps / bands;
        kb = SlotKB / bands;  // steps of a band per slot
        slots = (width / 32 + kb - 1) / kb;
    }
};

template <int SlotKB, int NS>
__global__ void __launch_bounds__(kThreads, 1) ring_kernel(const __grid_constant__ Args a) {
    extern __shared__ __align__(1024) char smem_raw[];
    using Sh = RingShape<SlotKB>;
    char *ring = smem_raw;
    bf16 *xs = reinterpret_cast<bf16 *>(ring + NS * Sh::kSlotBytes);
    float *red = reinterpret_cast<float *>(reinterpret_cast<char *>(xs) + in_bytes(2048));  // [16][128]
    uint64_t *full = reinterpret_cast<uint64_t *>(red + 2 * kWarps * 128), *empty = full + NS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (a.ntiles <= 0) return;  // the warm-up launch
    const Sh sh(a.rows, a.tiles[0].k1 - a.tiles[0].k0);
    if (sh.bands > 2 * kWarps || sh.kb < 1) __trap();
    const int my_tiles = cta_tiles(a);
    const uint32_t total = (uint32_t)my_tiles * sh.slots;
    if (threadIdx.x == 0) {
        for (int i = 0; i < NS; i++) mbar_init(&full[i], 1), mbar_init(&empty[i], kWarps);
        mbar_init_fence();
    }
    __syncthreads();
    uint32_t issued = 0;
    int issue_tile = -1;  // the tile whose descriptor thread 0 holds (one load a tile, not a slot)
    BenchTile ibt{};
    auto issue = [&](uint32_t c) {  // thread 0: slot c of the CTA's sequence
        const int slot = c % NS;
        if ((int)(c / sh.slots) != issue_tile) {
            issue_tile = (int)(c / sh.slots);
            ibt = a.tiles[blockIdx.x + issue_tile * gridDim.x];
        }
        if (c >= NS) mbar_wait(&empty[slot], ((c / NS) - 1) & 1);
        const BenchTile &bt = ibt;
        const int j = c % sh.slots, steps = (bt.k1 - bt.k0) / 32, s0 = j * sh.kb, n = min(sh.kb, steps - s0);
        mbar_arrive_expect(&full[slot], (uint32_t)(sh.bands * n * 1024));
        for (int b = 0; b < sh.bands; b++)
            bulk_load(ring + slot * Sh::kSlotBytes + b * sh.kb * 1024, tiled_at(a, bt, 16 * b, s0), n * 1024, &full[slot]);
    };
    // the warp's bands (w, and w + 8 past 8 bands) and its part of each slot's steps
    const int nmine = sh.bands > kWarps ? 2 : 1, band = warp % sh.bands, part = warp / sh.bands;
    const bool busy = part < sh.parts;
    const int p0 = sh.kb * part / sh.parts, p1 = sh.kb * (part + 1) / sh.parts;
    uint32_t c = 0;
    for (int k = 0; k < my_tiles; k++) {
        const int i = blockIdx.x + k * gridDim.x;
        const BenchTile bt = a.tiles[i];
        wait_ready(a.ready);
        stage_bf16(xs, a.x + bt.k0, a.batch, bt.k1 - bt.k0, kXStride);
        __syncthreads();
        const uint32_t x_lane = in_lane_addr(smem_u32(xs));
        float acc[2][4] = {};  // one chain per band: acc[m][q & 1] in a rolled loop went to local memory
        const int steps = (bt.k1 - bt.k0) / 32;
        for (int j = 0; j < sh.slots; j++, c++) {
            if (threadIdx.x == 0)
                for (; issued < total && issued < c + NS; issued++) issue(issued);
            const int slot = c % NS;
            mbar_wait(&full[slot], (c / NS) & 1);
            const int s0 = j * sh.kb;
            if (busy)
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    if (m >= nmine) break;
                    const uint32_t base =
                        smem_u32(ring + slot * Sh::kSlotBytes + (band + m * kWarps) * sh.kb * 1024) + 16 * lane;
#pragma unroll 1
                    for (int q = p0; q < p1 && s0 + q < steps; q++)
                        mma_k32(acc[m], lds128(base + q * 1024), lds128(base + q * 1024 + 512),
                                load_in_k32(x_lane, 32 * (s0 + q)));
                }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[slot]);
        }
        for (int m = 0; m < nmine; m++) {
            float *mine = red + (warp + m * kWarps) * 128;  // band warp + 8m (one band), or part `part` of band
            *reinterpret_cast<float2 *>(mine + g * 8 + 2 * t) = make_float2(acc[m][0], acc[m][1]);
            *reinterpret_cast<float2 *>(mine + (g + 8) * 8 + 2 * t) = make_float2(acc[m][2], acc[m][3]);
        }
        __syncthreads();
        float *dst = a.out + (size_t)i * a.rows * 8;
        for (int e = threadIdx.x; e < sh.bands * 128; e += kThreads) {
            const int b = e / 128;  // its parts: red entries b + q * bands (one part past 4 bands)
            float v = 0.f;
            for (int q = 0; q < sh.parts; q++) v += red[(b + q * sh.bands) * 128 + e % 128];
            dst[e] = v;
        }
        __syncthreads();
    }
}
template <int SlotKB, int NS>
constexpr int ring_smem() {
    return NS * SlotKB * 1024 + in_bytes(2048) + 2 * kWarps * 128 * 4 + 2 * NS * 8;
}

// The paths with a producer warp of their own (warp 8: 288 threads); their consumers meet at
// named barrier 1.
constexpr int kChunkThreads = kThreads + 32;
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory"); }

// tiled/pieceN: a ring of N slots of one bulk copy each, which every consumer warp reads (as
// tiled/ringCxN) but whose copies are big: a tile's segments are contiguous in the tiled layout
// (band after band, each its K range's 32-wide k steps of 1 KB), so slot p holds piece p of the
// tile, a band's range cut into pieces of at most 32 KB (a band's pieces equal). Warp w takes the
// piece's steps w, w + 8, ... into that band's accumulator; at the tile's end the 8 warps' sums
// of each band add up in warp order through shared memory, 8 bands at a time. The producer is
// warp 8's lane 0 (288 threads): it waits only on the slots' empty barriers, the consumers only
// on their full ones, and every warp consumes every slot in order, so none waits on a slot two
// phases ahead (which try_wait.parity cannot tell from the phase before).
constexpr int kPieceMaxBytes = 32 * 1024, kPieceMaxBands = 16;
template <int NS>
__global__ void __launch_bounds__(kChunkThreads, 1) piece_kernel(const __grid_constant__ Args a) {
    extern __shared__ __align__(1024) char smem_raw[];
    char *ring = smem_raw;
    bf16 *xs = reinterpret_cast<bf16 *>(ring + NS * kPieceMaxBytes);
    float *red = reinterpret_cast<float *>(reinterpret_cast<char *>(xs) + in_bytes(2048));  // [8 warps][8 bands][128]
    uint64_t *full = reinterpret_cast<uint64_t *>(red + kWarps * 8 * 128), *empty = full + NS;
    if (a.ntiles <= 0) return;  // the warm-up launch
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int bands = a.rows / 16, band_steps = (a.tiles[0].k1 - a.tiles[0].k0) / 32;
    const int per_band = (band_steps * 1024 + kPieceMaxBytes - 1) / kPieceMaxBytes, piece_steps = band_steps / per_band;
    if (bands > kPieceMaxBands || piece_steps * per_band != band_steps) __trap();
    const int pieces = bands * per_band;
    const int my_tiles = cta_tiles(a);
    if (threadIdx.x == 0) {
        for (int i = 0; i < NS; i++) mbar_init(&full[i], 1), mbar_init(&empty[i], kWarps);
        mbar_init_fence();
    }
    __syncthreads();
    if (warp == kWarps) {  // the producer: piece after piece of the CTA's tiles
        if (lane != 0) return;
        const uint32_t total = (uint32_t)my_tiles * pieces;
        int tile = -1;
        BenchTile bt{};
        for (uint32_t c = 0; c < total; c++) {
            const int slot = c % NS;
            if ((int)(c / pieces) != tile) tile = (int)(c / pieces), bt = a.tiles[blockIdx.x + tile * gridDim.x];
            const int j = c % pieces, band = j / per_band, s0 = (j % per_band) * piece_steps;
            if (c >= NS) mbar_wait(&empty[slot], ((c / NS) - 1) & 1);
            mbar_arrive_expect(&full[slot], (uint32_t)piece_steps * 1024);
            bulk_load(ring + slot * kPieceMaxBytes, tiled_at(a, bt, 16 * band, s0), piece_steps * 1024, &full[slot]);
        }
        for (uint32_t c = total > NS ? total - NS : 0; c < total; c++)  // its copies consumed before it exits
            mbar_wait(&empty[c % NS], (c / NS) & 1);
        return;
    }
    uint32_t c = 0;
    for (int k = 0; k < my_tiles; k++) {
        const int i = blockIdx.x + k * gridDim.x;
        const BenchTile bt = a.tiles[i];
        poll_ready(a.ready);  // the consumers' barrier after the staging publishes it (no __syncthreads: warp 8)
        stage_bf16(xs, a.x + bt.k0, a.batch, bt.k1 - bt.k0, kXStride);
        consumers_sync();
        const uint32_t x_lane = in_lane_addr(smem_u32(xs));
        float acc[kPieceMaxBands][4] = {};
#pragma unroll
        for (int b = 0; b < kPieceMaxBands; b++) {
            if (b >= bands) break;
#pragma unroll 1
            for (int pp = 0; pp < per_band; pp++, c++) {
                const uint32_t slot = c % NS;
                mbar_wait(&full[slot], (c / NS) & 1);
                const uint32_t src = smem_u32(ring + slot * kPieceMaxBytes) + 16 * lane;
                const int s0 = pp * piece_steps;
#pragma unroll 1
                for (int q = warp; q < piece_steps; q += kWarps)
                    mma_k32(acc[b], lds128(src + q * 1024), lds128(src + q * 1024 + 512),
                            load_in_k32(x_lane, 32 * (s0 + q)));
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[slot]);
            }
        }
        float *dst = a.out + (size_t)i * a.rows * 8;
#pragma unroll
        for (int b0 = 0; b0 < kPieceMaxBands; b0 += 8) {
            if (b0 >= bands) break;
#pragma unroll
            for (int b = b0; b < b0 + 8; b++) {
                float *mine = red + (warp * 8 + b - b0) * 128;
                *reinterpret_cast<float2 *>(mine + g * 8 + 2 * t) = make_float2(acc[b][0], acc[b][1]);
                *reinterpret_cast<float2 *>(mine + (g + 8) * 8 + 2 * t) = make_float2(acc[b][2], acc[b][3]);
            }
            consumers_sync();
            for (int e = threadIdx.x; e < min(8, bands - b0) * 128; e += kThreads) {
                float v = 0.f;
                for (int w = 0; w < kWarps; w++) v += red[(w * 8 + e / 128) * 128 + e % 128];
                dst[b0 * 128 + e] = v;
            }
            consumers_sync();
        }
    }
}
template <int NS>
constexpr int piece_smem() {
    return NS * kPieceMaxBytes + in_bytes(2048) + kWarps * 8 * 128 * 4 + 2 * NS * 8;
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
    int threads = kThreads;
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
    {"tiled/bulk8x2", mma_kernel<false, DotBulk<8, 2>, true>, mma_smem(DotBulk<8, 2>::kScratch)},
    {"tiled/bulk4x4", mma_kernel<false, DotBulk<4, 4>, true>, mma_smem(DotBulk<4, 4>::kScratch)},
    {"tiled/bulk4x5", mma_kernel<false, DotBulk<4, 5>, true>, mma_smem(DotBulk<4, 5>::kScratch)},
    {"tiled/bulk2x8", mma_kernel<false, DotBulk<2, 8>, true>, mma_smem(DotBulk<2, 8>::kScratch)},
    {"tiled/bulk8x1", mma_kernel<false, DotBulk<8, 1>, true>, mma_smem(DotBulk<8, 1>::kScratch)},
    {"tiled/ring64x2", ring_kernel<64, 2>, ring_smem<64, 2>()},
    {"tiled/ring32x5", ring_kernel<32, 5>, ring_smem<32, 5>()},
    {"tiled/ring16x8", ring_kernel<16, 8>, ring_smem<16, 8>()},
    {"tiled/ring16x10", ring_kernel<16, 10>, ring_smem<16, 10>()},
    {"tiled/piece3", piece_kernel<3>, piece_smem<3>(), kChunkThreads},
    {"tiled/piece4", piece_kernel<4>, piece_smem<4>(), kChunkThreads},
    {"tiled/piece5", piece_kernel<5>, piece_smem<5>(), kChunkThreads},
};
constexpr int kNumPaths = sizeof(kPaths) / sizeof(kPaths[0]);

void launch(const Path &p, int grid, const Args &args) {
    void *params[] = {const_cast<Args *>(&args)};
    CHECK(cudaLaunchKernel(reinterpret_cast<const void *>(p.kernel), dim3(grid), dim3(p.threads), params, p.smem, 0));
}

}  // namespace

int main(int argc, char **argv) {
    bool quick = false, peak = false, shuffle = false;
    std::vector<std::string> filters;
    int ctas = 0, pool_mib = 0;
    for (int i = 1; i < argc; i++) {
        if (!std::strcmp(argv[i], "--quick")) quick = true;
        else if (!std::strcmp(argv[i], "--read-peak")) peak = true;
        else if (!std::strcmp(argv[i], "--shuffle")) shuffle = true;
        else if (!std::strcmp(argv[i], "--filter") && i + 1 < argc) filters.push_back(argv[++i]);
        else if (!std::strcmp(argv[i], "--ctas") && i + 1 < argc && (ctas = std::atoi(argv[++i])) > 0) continue;
        else if (!std::strcmp(argv[i], "--pool-mib") && i + 1 < argc && (pool_mib = std::atoi(argv[++i])) > 0) continue;
        else {
            std::fprintf(stderr,
                         "usage: %s [--quick] [--read-peak] [--filter SUBSTR]... [--ctas N] [--pool-mib M] [--shuffle]\n",
                         argv[0]);
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
    std::printf("%s: %d SMs, %.0f MHz; %zu MiB of weights in %d matrices per shape, %d rep(s), %d CTAs, tiles %s\n",
                prop.name, sms, clock_khz / 1e3, pool_bytes >> 20, kMatrices, reps, grid,
                shuffle ? "shuffled" : "in order");

    bf16 *pool = nullptr, *tiled = nullptr;
    CHECK(cudaMalloc(&pool, pool_bytes));
    bool any_tiled = false;
    for (int p : paths) any_tiled |= std::strncmp(kPaths[p].name, "tiled/", 6) == 0;
    if (any_tiled) CHECK(cudaMalloc(&tiled, pool_bytes));
    const size_t pool_elems = pool_bytes / sizeof(bf16), matrix_elems = pool_elems / kMatrices;
    fill_random<<<4 * sms, 256>>>(pool, pool_elems, 1);
    CHECK(cudaGetLastError());
    if (peak) read_peak(pool, pool_bytes, grid, std::max(reps, 5));

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
        std::vector<BenchTile> tiles = make_tiles(sh, matrix_elems, matrix_rows);
        if (shuffle) std::shuffle(tiles.begin(), tiles.end(), std::mt19937(12345));
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
