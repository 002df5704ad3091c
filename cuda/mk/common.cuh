// Device helpers shared by the tasks: loads, reductions, staging of GEMV inputs, and the
// tensor-core GEMV every matrix task runs.
#pragma once

#include "config.cuh"

namespace nmk::mk {

// Weights stream through once per step: skip L1.
__device__ __forceinline__ uint4 load_weight(const bf16 *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Step scratch and KV are written by other SMs during the step: read them from L2.
__device__ __forceinline__ float load_l2(const float *p) { return __ldcg(p); }
__device__ __forceinline__ float4 load_l2(const float4 *p) { return __ldcg(p); }
__device__ __forceinline__ uint4 load_l2(const uint4 *p) { return __ldcg(p); }
__device__ __forceinline__ uint2 load_l2(const uint2 *p) { return __ldcg(p); }
__device__ __forceinline__ int32_t load_l2(const int32_t *p) { return __ldcg(p); }

// Counters between CTAs. After a barrier, one thread publishes the CTA's writes with an
// acq_rel fence (cumulative over what the barrier ordered before it) and a relaxed add, as
// CUTLASS's GenericBarrier does; __threadfence() compiles to the stronger, sequentially
// consistent MEMBAR.SC, which a release does not need.
__device__ __forceinline__ void red_release(uint32_t *p, uint32_t v) {
    asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// An add that returns the old value, releasing the CTA's writes (as red_release) and
// acquiring the writes the earlier adders released.
__device__ __forceinline__ uint32_t atom_add_acq_rel(uint32_t *p, uint32_t v) {
    uint32_t old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// ---- bulk copies (the TMA unit's 1-D form) and the shared-memory barriers they complete ------
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals) : "memory");
}

// After thread 0's inits, before the barrier that publishes them to the CTA.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Before the barrier's memory is used for anything else.
__device__ __forceinline__ void mbar_inval(uint64_t *bar) {
    asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// One arrival that also expects `bytes` of bulk copies to complete on the barrier.
__device__ __forceinline__ void mbar_arrive_expect(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}

// Waits until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}

// bytes (a multiple of 16, both addresses 16-byte aligned) from global to shared memory by the
// TMA unit, completing on `bar`.
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}

// Orders this thread's earlier accesses through the generic proxy (and those acquired from
// other SMs) before its later bulk copies: shared memory only, or global and shared memory.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.global;" ::: "memory");
    fence_proxy_async_shared();
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

__device__ __forceinline__ void unpack8(uint4 v, float out[8]) {
    const __nv_bfloat162 *p = reinterpret_cast<const __nv_bfloat162 *>(&v);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 f = __bfloat1622float2(p[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// ---- GEMV inputs: [8][in_stride(K)] bf16 in shared memory, one row per batch row ----------------
// The stride is 32 elements past a multiple of 64, so the 8 lanes of a 16-byte shared-load
// phase (two rows x four 16-byte chunks) hit 32 distinct banks.
__host__ __device__ __forceinline__ int in_stride(int K) { return (K + 63) / 64 * 64 + 32; }

// Copies rows x K bf16 (K % 8 == 0) from global scratch (src_stride apart) to a GEMV input,
// four 16-byte loads in flight per thread.
__device__ __forceinline__ void stage_bf16(bf16 *dst, const bf16 *src, int rows, int K, int src_stride) {
    const int chunks = K / 8, ds = in_stride(K), total = rows * chunks;
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
            if (i < total) reinterpret_cast<uint4 *>(dst + (i / chunks) * ds)[i % chunks] = v[j];
        }
    }
}

// ---- shared memory a CTA keeps across its tasks of a step -----------------------------------
// A task's scratch is [0, kTaskSmemBytes); past it, what later tasks of the same layer reuse:
// the normed input a GEMV staged at offset 0 and the routing of a sparse layer (op_router).
constexpr int kTaskSmemBytes = 123 * 1024;
constexpr int kMaxGemvItems = 32;  // (16-row tile, k part) work items of one GEMV, for `red`

struct Kept {
    int normed;  // whose normed input sits at offset 0: a layer, num_layers for the final norm, -1 none
    int routed;  // the layer whose routing sits right after this struct (route()), -1 none
    float rms[NMK_MK_MAX_BATCH];  // stage_normed's scratch
};

__device__ __forceinline__ Kept &kept(char *smem) { return *reinterpret_cast<Kept *>(smem + kTaskSmemBytes); }

// The normed residual as a GEMV input at smem offset 0 (in_stride(H) apart): h =
// bf16(round(x * rms) * weight), rms from the NORM tiles' sums of squares (the roundings of
// the reference's RMSNorm). `tag` names the norm (a layer, or num_layers for the final one):
// when the CTA's last staging was the same, the input is still there and nothing is read.
// Each thread loads its chunk of every row before the sums of squares come back. Ends with
// a barrier.
template <int B>
__device__ __forceinline__ void stage_normed(char *smem, const Params &p, const bf16 *weight, int tag) {
    Kept &k = kept(smem);
    if (k.normed == tag) return;
    bf16 *dst = reinterpret_cast<bf16 *>(smem);
    float *rms = k.rms;
    const int H = p.hidden, ds = in_stride(H), chunks = H / 8, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < B) {
        float ss = 0.f;
        for (int t = lane; t < p.plan.norm_tiles; t += 32) ss += load_l2(p.ss + warp * kMaxNormTiles + t);
        ss = warp_sum(ss);
        if (lane == 0) rms[warp] = rsqrtf(ss / H + p.norm_eps);
    }
    // Chunk c of every row; the first round's loads are in flight across the barrier.
    for (int c = threadIdx.x; c < (chunks + kThreads - 1) / kThreads * kThreads; c += kThreads) {
        const bool mine = c < chunks;
        float4 xa[B] = {}, xb[B] = {};
        uint4 w{};
#pragma unroll
        for (int r = 0; r < B; r++) {
            const float4 *x = reinterpret_cast<const float4 *>(p.x + (size_t)r * H) + 2 * c;
            if (mine) xa[r] = load_l2(x), xb[r] = load_l2(x + 1);
        }
        if (mine) w = reinterpret_cast<const uint4 *>(weight)[c];
        if (c < kThreads) __syncthreads();  // rms; every thread's first round
        if (!mine) continue;
        float wf[8];
        unpack8(w, wf);
#pragma unroll
        for (int r = 0; r < B; r++) {
            const float v[8] = {xa[r].x, xa[r].y, xa[r].z, xa[r].w, xb[r].x, xb[r].y, xb[r].z, xb[r].w};
            uint4 out;
            uint32_t *o = reinterpret_cast<uint32_t *>(&out);
#pragma unroll
            for (int j = 0; j < 4; j++)
                o[j] = pack_bf16(round_bf16(v[2 * j] * rms[r]) * wf[2 * j],
                                 round_bf16(v[2 * j + 1] * rms[r]) * wf[2 * j + 1]);
            reinterpret_cast<uint4 *>(dst + r * ds)[c] = out;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) k.normed = tag;  // every thread read it above, before the barrier
}

// ---- the tensor-core GEMV ---------------------------------------------------------------------
// mma.m16n8k16 with weights as A (16 rows) and the 8 batch rows as B. The reduction order
// inside an mma is free, so each lane loads 16 contiguous bytes per row: lane (g, t) reads
// weight rows g and g + 8 and input row g at k0 + 8t .. k0 + 8t + 7, and the two mmas of a
// 32-wide k step take words {0, 1} and {2, 3} of those chunks as their k pairs.
__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_k32(float c[4], uint4 lo, uint4 hi, uint4 x) {
    mma_bf16(c, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
    mma_bf16(c, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
}

constexpr int kStepsInFlight = 8;  // 32-wide k steps whose weight loads a lane issues together

// c += rows lo, hi (lane's rows g, g + 8) . input row g over k in [ka, kb) (multiples of 32).
__device__ __forceinline__ void tile_dot(const bf16 *lo, const bf16 *hi, const bf16 *x, int ka, int kb, float c[4]) {
    int k = ka;
    for (; k + 32 * kStepsInFlight <= kb; k += 32 * kStepsInFlight) {
        uint4 wl[kStepsInFlight], wh[kStepsInFlight];
#pragma unroll
        for (int i = 0; i < kStepsInFlight; i++) {
            wl[i] = load_weight(lo + k + 32 * i);
            wh[i] = load_weight(hi + k + 32 * i);
        }
#pragma unroll
        for (int i = 0; i < kStepsInFlight; i++) mma_k32(c, wl[i], wh[i], *reinterpret_cast<const uint4 *>(x + k + 32 * i));
    }
    for (; k < kb; k += 32) mma_k32(c, load_weight(lo + k), load_weight(hi + k), *reinterpret_cast<const uint4 *>(x + k));
}

// tile_dot as gemv's k loop; tools/gemv_bench.cu passes others (with shared scratch) in its place.
struct TileDot {
    __device__ __forceinline__ void operator()(const bf16 *lo, const bf16 *hi, const bf16 *x, int ka, int kb,
                                               float c[4], char *) const {
        tile_dot(lo, hi, x, ka, kb, c);
    }
};

// Pieces of K per 16-row tile so that (tile, piece) items spread evenly over the warps: the
// fewest pieces that minimize the busiest warp's share, at most kWarps pieces, kMaxGemvItems
// items and one 32-wide step per piece.
__device__ __forceinline__ int k_parts(int tiles, int steps) {
    int best = 1, best_rounds = (tiles + kWarps - 1) / kWarps;  // share = rounds / parts
    for (int ks = 2; ks <= kWarps && ks <= steps && tiles * ks <= kMaxGemvItems; ks++) {
        const int rounds = (tiles * ks + kWarps - 1) / kWarps;
        if (rounds * best < best_rounds * ks) best = ks, best_rounds = rounds;
    }
    return best;
}

// out[r * 8 + n] = row(r) . in[n] for r < n_rows (out: shared fp32, [round_up(n_rows, 16)][8]).
// Warps take (16-row tile, piece of K) items (k_parts); pieces add up through `red` (shared,
// kMaxGemvItems * 128 floats). K % 32 == 0. Ends with a barrier.
template <class Row, class Dot = TileDot>
__device__ __forceinline__ void gemv(Row row, int n_rows, const bf16 *in, int K, float *out, float *red, Dot dot = {},
                                     char *scratch = nullptr) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tiles = (n_rows + 15) / 16, steps = K / 32, ks = k_parts(tiles, steps);
    const bf16 *x = in + g * in_stride(K) + 8 * t;
    for (int item = warp; item < tiles * ks; item += kWarps) {
        const int tile = item / ks, part = item % ks, r = tile * 16 + g;
        const bf16 *lo = row(min(r, n_rows - 1)) + 8 * t, *hi = row(min(r + 8, n_rows - 1)) + 8 * t;
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        dot(lo, hi, x, steps * part / ks * 32, steps * (part + 1) / ks * 32, c, scratch);
        float *dst = ks == 1 ? out + tile * 128 : red + item * 128;
        *reinterpret_cast<float2 *>(dst + g * 8 + 2 * t) = make_float2(c[0], c[1]);
        *reinterpret_cast<float2 *>(dst + (g + 8) * 8 + 2 * t) = make_float2(c[2], c[3]);
    }
    __syncthreads();
    if (ks > 1) {
        for (int i = threadIdx.x; i < tiles * 128; i += kThreads) {
            const int tile = i / 128, e = i % 128;
            float s = 0.f;
            for (int part = 0; part < ks; part++) s += red[(tile * ks + part) * 128 + e];
            out[i] = s;
        }
        __syncthreads();
    }
}

// Shared-memory carve-up of a GEMV task: input, output, split-K partials, then `extra` bytes
// (at most kGemvExtraBytes). The widest fits in a task's scratch.
constexpr int kMaxGemvRows = 512, kGemvExtraBytes = 4096;
static_assert(NMK_MK_MAX_BATCH * (kMaxK + 64 + 32) * 2 + (kMaxGemvRows + kMaxGemvItems * 16) * 8 * 4 +
                      kGemvExtraBytes <= kTaskSmemBytes,
              "a GEMV task's shared memory must stay below kTaskSmemBytes");
struct GemvSmem {
    bf16 *in;
    float *out, *red;
    char *extra;
    __device__ GemvSmem(char *smem, int K, int out_rows) {
        in = reinterpret_cast<bf16 *>(smem);
        out = reinterpret_cast<float *>(smem + NMK_MK_MAX_BATCH * in_stride(K) * sizeof(bf16));
        red = out + (out_rows + 15) / 16 * 16 * 8;
        extra = reinterpret_cast<char *>(red + kMaxGemvItems * 128);
    }
};

// Physical page of row b's position pos in a KV group.
__device__ __forceinline__ int kv_page(const Params &p, int group, int b, int pos) {
    int page = load_l2(p.tables[group] + (size_t)b * p.table_cols + pos / kPage);
    if (page < 0) __trap();  // the host guarantees a page for every position it sends
    return page;
}

}  // namespace nmk::mk
