// Device helpers shared by the tasks: loads, reductions, staging of GEMV inputs, and the
// tensor-core GEMV every matrix task runs.
#pragma once

#include "config.cuh"

namespace nmk::mk {

// Step scratch and KV are written by other SMs during the step: read them from L2.
__device__ __forceinline__ float load_l2(const float *p) { return __ldcg(p); }
__device__ __forceinline__ float4 load_l2(const float4 *p) { return __ldcg(p); }
__device__ __forceinline__ uint4 load_l2(const uint4 *p) { return __ldcg(p); }
__device__ __forceinline__ uint2 load_l2(const uint2 *p) { return __ldcg(p); }
__device__ __forceinline__ int32_t load_l2(const int32_t *p) { return __ldcg(p); }

// Asks the TMA unit to pull [p, p + bytes) into L2 (both 16-byte aligned), without waiting.
__device__ __forceinline__ void prefetch_l2(const void *p, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
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
__host__ __device__ constexpr int in_stride(int K) { return (K + 63) / 64 * 64 + 32; }

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
// A task's scratch is [0, kTaskSmemBytes) (a GEMV's weight ring at its end); past it, what
// later tasks of the same layer reuse: the normed input a GEMV staged at offset 0 and the
// routing of a sparse layer (op_router).
constexpr int kTaskSmemBytes = 187 * 1024;
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

// ---- the weight stream -----------------------------------------------------------------------
// A GEMV's weights reach the tensor cores through a ring in shared memory, the stream: each
// lane copies its 16 bytes of rows lo and hi per 32-wide k step with cp.async (L2 only) and
// keeps kStreamSteps steps in flight. A lane reads back only what it copied itself, so the
// ring needs no barrier (cp.async.wait_group orders a thread's own copies). The stream spans
// a warp's work items: the copies of its next item are in flight while the current one is
// computed, so a task pays the memory latency once rather than once per item.
constexpr int kStreamSteps = 12;
constexpr int kStreamStepBytes = 2 * kThreads * 16;  // one step of every lane: a plane of lo rows, one of hi rows
constexpr int kStreamBytes = kStreamSteps * kStreamStepBytes;
constexpr int kStreamOffset = kTaskSmemBytes - kStreamBytes;  // the ring, at the end of the task scratch
static_assert(kStreamOffset % 16 == 0 && kStreamOffset > 0, "cp.async needs 16-byte aligned destinations");

__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ uint4 load_shared(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

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

// Shared-memory carve-up of a GEMV task: input, output, split-K partials, then `extra` bytes
// (at most kGemvExtraBytes), below the weight ring at kStreamOffset.
constexpr int kGemvExtraBytes = 4096;
__host__ __device__ constexpr int gemv_smem_bytes(int K, int out_rows) {
    return NMK_MK_MAX_BATCH * in_stride(K) * 2 + ((out_rows + 15) / 16 * 16 + kMaxGemvItems * 16) * 8 * 4 +
           kGemvExtraBytes;
}
struct GemvSmem {
    bf16 *in;
    float *out, *red;
    char *extra;
    uint32_t stream;  // shared address of the weight ring
    __device__ GemvSmem(char *smem, int K, int out_rows) {
        if (gemv_smem_bytes(K, out_rows) > kStreamOffset) __trap();  // nmk_mk_create checks the geometry
        in = reinterpret_cast<bf16 *>(smem);
        out = reinterpret_cast<float *>(smem + NMK_MK_MAX_BATCH * in_stride(K) * sizeof(bf16));
        red = out + (out_rows + 15) / 16 * 16 * 8;
        extra = reinterpret_cast<char *>(red + kMaxGemvItems * 128);
        stream = static_cast<uint32_t>(__cvta_generic_to_shared(smem + kStreamOffset));
    }
};

// s.out[r * 8 + n] = row(r) . s.in[n] for r < n_rows (out: [round_up(n_rows, 16)][8]).
// mma.m16n8k16 with weights as A (16 rows) and the 8 batch rows as B. The reduction order
// inside an mma is free, so each lane loads 16 contiguous bytes per row: lane (g, t) reads
// weight rows g and g + 8 and input row g at k0 + 8t .. k0 + 8t + 7, and the two mmas of a
// 32-wide k step take words {0, 1} and {2, 3} of those chunks as their k pairs.
// Warps take (16-row tile, piece of K) items (k_parts), warp w the items w, w + kWarps, ...;
// their weights come through the ring as one stream of k steps. Pieces add up through s.red.
// K % 32 == 0. Ends with a barrier.
template <class Row>
__device__ __forceinline__ void gemv(Row row, int n_rows, int K, const GemvSmem &s) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tiles = (n_rows + 15) / 16, steps = K / 32, ks = k_parts(tiles, steps), items = tiles * ks;
    const bf16 *x = s.in + g * in_stride(K) + 8 * t;
    const uint32_t lane_ring = s.stream + threadIdx.x * 16;
    // The copy cursor: item `ci`, its next step `ck` of [.., ck_end), the lane's rows.
    int ci = warp, ck = 0, ck_end = 0;
    const bf16 *lo = nullptr, *hi = nullptr;
    auto enter = [&](int item) {
        const int r = item / ks * 16 + g, part = item % ks;
        lo = row(min(r, n_rows - 1)) + 8 * t, hi = row(min(r + 8, n_rows - 1)) + 8 * t;
        ck = steps * part / ks, ck_end = steps * (part + 1) / ks;
    };
    if (ci < items) enter(ci);
    int copy_slot = 0;
    auto copy_next = [&] {  // one commit group per call, empty past the warp's last step
        if (ci < items) {
            const uint32_t dst = lane_ring + copy_slot * kStreamStepBytes;
            cp_async16(dst, lo + 32 * ck);
            cp_async16(dst + kThreads * 16, hi + 32 * ck);
            if (++ck == ck_end && (ci += kWarps) < items) enter(ci);
        }
        cp_async_commit();
        copy_slot = copy_slot + 1 == kStreamSteps ? 0 : copy_slot + 1;
    };
#pragma unroll 1
    for (int i = 0; i < kStreamSteps - 1; i++) copy_next();
    int slot = 0;
    for (int item = warp; item < items; item += kWarps) {
        const int part = item % ks, k_end = steps * (part + 1) / ks;
        float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
        for (int k = steps * part / ks; k < k_end; k++) {
            copy_next();
            cp_async_wait<kStreamSteps - 1>();  // this step's group is complete
            const uint32_t src = lane_ring + slot * kStreamStepBytes;
            mma_k32(c, load_shared(src), load_shared(src + kThreads * 16), *reinterpret_cast<const uint4 *>(x + 32 * k));
            slot = slot + 1 == kStreamSteps ? 0 : slot + 1;
        }
        float *dst = ks == 1 ? s.out + item / ks * 128 : s.red + item * 128;
        *reinterpret_cast<float2 *>(dst + g * 8 + 2 * t) = make_float2(c[0], c[1]);
        *reinterpret_cast<float2 *>(dst + (g + 8) * 8 + 2 * t) = make_float2(c[2], c[3]);
    }
    cp_async_wait<0>();  // only empty groups are left
    __syncthreads();
    if (ks > 1) {
        for (int i = threadIdx.x; i < tiles * 128; i += kThreads) {
            const int tile = i / 128, e = i % 128;
            float sum = 0.f;
            for (int part = 0; part < ks; part++) sum += s.red[(tile * ks + part) * 128 + e];
            s.out[i] = sum;
        }
        __syncthreads();
    }
}

// Physical page of row b's position pos in a KV group.
__device__ __forceinline__ int kv_page(const Params &p, int group, int b, int pos) {
    int page = load_l2(p.tables[group] + (size_t)b * p.table_cols + pos / kPage);
    if (page < 0) __trap();  // the host guarantees a page for every position it sends
    return page;
}

}  // namespace nmk::mk
