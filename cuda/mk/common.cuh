// Device helpers shared by the tasks: loads, reductions, staging of GEMV inputs, and the
// tensor-core GEMV every matrix task runs.
#pragma once

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "config.cuh"

namespace nmk::mk {

// Streams read once a step leave L2 first (evict_first), so that the lines every SM reads again
// (the step's scratch, the kernel's code) stay there: attention's KV boxes take this policy.
__device__ __forceinline__ uint64_t evict_first_policy() {
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}
// Row-major weights (tools/gemv_bench.cu's row-major paths; the kernel's MLPs until ABI 7):
// streaming loads (.cs: evict first from L1 and L2) that have L2 fetch 256 bytes a miss. A lane
// reads 16 bytes of a row per 32-wide k step, a burst 512 contiguous bytes of each of its rows.
// In the GEMV bench (tools/gemv_bench.cu's ld/ paths, 132 SMs) a streaming load, or a 256-byte
// fetch, each streamed 6-20% faster than the non-coherent load with an evict_first policy used
// before; in the kernel the two together ran batch 1 4.8% faster, the 256-byte fetch with the
// evict_first policy 3.3% (benchmarks/NOTES.md, session 18).
// Weights in the tiled layout (every matrix the kernel streams) read whole 128-byte lines per
// warp load: plain streaming loads (the 256-byte fetch measured slower there:
// benchmarks/NOTES.md, session 19).
template <bool kTiled = false>
__device__ __forceinline__ uint4 load_weight(const bf16 *p) {
    uint4 v;
    if constexpr (kTiled)
        asm volatile("ld.global.cs.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    else
        asm volatile("ld.global.cs.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    return v;
}

// The tiled layout of a [R][K] weight matrix (include/northmk.h): R rounded up to 16 (zero rows),
// each 16-row band stored as its K / 32 blocks of [16][32], block after block. A band takes the
// 16 K elements a row-major band would, so a tile of rows r0.. (r0 % 16 == 0) starts at W + r0 K
// in either layout; a lane's 16 bytes of row g (g + 8) of a block lie at 16 * lane (+ 512) bytes,
// and a warp's load reads 512 contiguous bytes.
__device__ __forceinline__ size_t tiled_index(int r, int c, int K) {
    return (size_t)(r & ~15) * K + (c >> 5) * 512 + (r & 15) * 32 + (c & 31);
}

// Step scratch and KV are written by other SMs during the step: read them from L2.
__device__ __forceinline__ float load_l2(const float *p) { return __ldcg(p); }
__device__ __forceinline__ float4 load_l2(const float4 *p) { return __ldcg(p); }
__device__ __forceinline__ uint4 load_l2(const uint4 *p) { return __ldcg(p); }
__device__ __forceinline__ uint2 load_l2(const uint2 *p) { return __ldcg(p); }
__device__ __forceinline__ int32_t load_l2(const int32_t *p) { return __ldcg(p); }

// The residual entering layer l (l = num_layers: the final norm's input), [B][H] fp32 sums
// (Params::resid).
__device__ __forceinline__ float *resid_of(const Params &p, int l) {
    return p.resid + (size_t)(l % 3) * NMK_MK_MAX_BATCH * p.hidden;
}

// Counters between CTAs. After a barrier, one thread publishes the CTA's writes with a release
// add (cumulative over what the barrier ordered before it): MEMBAR.ALL.GPU and the add. A
// fence.acq_rel before a relaxed add (CUTLASS's GenericBarrier) also invalidates L1 (CCTL.IVALL),
// the acquire half that a signal does not need; __threadfence() compiles to the stronger,
// sequentially consistent MEMBAR.SC.
__device__ __forceinline__ void red_release(uint32_t *p, uint32_t v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Four fp32 adds to 16-byte aligned p[0..3] in one reduction (the residual's sums).
__device__ __forceinline__ void red_add4(float *p, float4 v) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
}

__device__ __forceinline__ void st_release(uint32_t *p, uint32_t v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// A word that carries its own tag (op_router's logit words): stored and polled with no fence.
__device__ __forceinline__ void st_relaxed(uint32_t *p, uint32_t v) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_relaxed(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Before relaxed stores of the same thread, which it makes releases (a release pattern).
__device__ __forceinline__ void fence_acq_rel() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ uint32_t load_acquire(const uint32_t *p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// The device's nanosecond clock (globaltimer): the tasks' timing records.
__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
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

// One box of a tensor map (a 5-D tiled map: coordinates innermost first) into shared memory by
// the TMA unit, completing on `bar`; the map may sit in the kernel's parameters. Attention's
// keys and values, read once a step: evict_first.
__device__ __forceinline__ void tensor_load_5d(void *dst, const TensorMap *map, int c0, int c1, int c2, int c3, int c4,
                                               uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
        "%3, %4, %5, %6}], [%7], %8;" ::"r"(smem_u32(dst)),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(smem_u32(bar)), "l"(evict_first_policy())
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

// (value, index) order of an argmax (the LM head's token; the router's picks, through 32-bit
// keys that order the same way): larger value, then smaller index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

// The best (value, index) of the warp's lanes, in every lane: `better` is a total order, so the
// result does not depend on the order of the comparisons.
__device__ __forceinline__ void warp_best(float &v, int &i) {
#pragma unroll
    for (int o = 16; o; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) v = ov, i = oi;
    }
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

// ---- GEMV inputs: the 8 batch rows of a K-wide input in shared memory -------------------------
// Laid out as the tensor cores read them (wgmma's K-major B operand without swizzle, and
// ldmatrix for mma.sync): each 32-wide k block is four 8 x 16-byte core matrices 128 bytes
// apart, and core matrix q holds, at row n and word t, the block's k pair 4t + q of batch row
// n. That is the order in which a lane's 16 contiguous weight bytes per row meet the mma
// fragments (gemv). Blocks are kInBlockBytes apart: 16 bytes of padding put a warp's staging
// stores of 32 consecutive chunks into 32 banks. K % 32 == 0.
// Byte offset in a GEMV input of element k of batch row n (store_in_chunk's layout).
__host__ __device__ constexpr int in_offset(int n, int k) {
    return (k >> 5) * kInBlockBytes + n * 16 + ((k >> 3) & 3) * 4 + ((k & 7) >> 1) * 128 + (k & 1) * 2;
}

// Chunk c (k = 8c .. 8c + 7, the k pairs 4c .. 4c + 3) of batch row n: pair 4c + j is the word
// at in_offset(n, 8c + 2j) = in_offset(n, 8c) + 128 j.
__device__ __forceinline__ void store_in_chunk(bf16 *in, int n, int c, uint4 v) {
    uint32_t *w = reinterpret_cast<uint32_t *>(reinterpret_cast<char *>(in) + in_offset(n, 8 * c));
    w[0] = v.x, w[32] = v.y, w[64] = v.z, w[96] = v.w;
}

// ---- shared memory a CTA keeps across its tasks of a step -----------------------------------
// A task's scratch is [0, kTaskSmemBytes); past it, what later tasks reuse (the normed input a
// GEMV staged at offset 0 is the layer's) and the routing the last ROUTER tile computes (op_router).
constexpr int kTaskSmemBytes = task_smem_bytes(kBuildBatch);
constexpr int kMaxGemvItems = 32;  // (16-row tile, k part) work items of one GEMV, for `red`

struct Kept {
    int normed;  // whose normed input sits at offset 0: a layer, num_layers for the final norm, -1 none
    // The staged input's sums of squares, per warp and row (stage_normed's, NormedStaging's).
    float ss_part[kWarps][NMK_MK_MAX_BATCH];
    uint32_t claimed;             // the drain's claimed task (vm.cuh): its index and descriptor
    nmk_task claimed_task;
    uint32_t ahead_first, ahead_count;  // the bounds of the queue claimed from ahead (claim_ahead)
    int seen;             // a counter this CTA has seen reach seen_target this step (vm.cuh's wait), -1 none
    uint32_t seen_target;
    // stage_image's bulk copies: each completes a phase of image_full; each thread then arrives
    // on image_empty once it is done with the image; image_uses counts the copies.
    uint64_t image_full, image_empty;
    uint32_t image_uses;
    // NormedStaging's arrivals, one phase per staged GEMV (kThreads arrivals), staged_uses
    // counting them; gemv_blocks's, one barrier per column block (32 arrivals: its stager
    // warp's), one phase each per such GEMV, block_uses counting them.
    uint64_t staged, block_staged[kWarps];
    uint32_t staged_uses, block_uses;
    // The layer's mlp slots' experts (op_mlp's slot_expert_of), loaded by the CTA's first
    // GATE_UP or DOWN task of the layer; slots_layer: whose they are, -1 none.
    int slots_layer;
    int16_t slot_expert[NMK_MK_MAX_BATCH * kMaxTopK];
    uint8_t slot_rows[NMK_MK_MAX_BATCH * kMaxTopK];  // bit b: row b picked the slot's expert
};

__device__ __forceinline__ Kept &kept(char *smem) { return *reinterpret_cast<Kept *>(smem + kTaskSmemBytes); }

// The words of a launch's routing table (Params::slot_expert, router_words), each its own flag:
// a word of an earlier layer, or 0 (the table zeroed by the launch before), never matches.
// A router logit's word: layer + 1 above the value's bf16 bits (op_router's tiles store them).
__device__ __forceinline__ uint32_t logit_word(int layer, float v) {
    return ((uint32_t)layer + 1) << 16 | __float_as_uint(v) >> 16;
}
__device__ __forceinline__ bool logit_word_of(uint32_t w, int layer) { return w >> 16 == (uint32_t)layer + 1; }
__device__ __forceinline__ float logit_of(uint32_t w) { return __uint_as_float(w << 16); }
// Slot y's word: its expert's low 16 bits (-1: none), the rows that picked it (bit b: row b),
// layer + 1 above them (op_router's routing tile stores them, op_mlp's slot_expert_of reads them).
__device__ __forceinline__ uint32_t slot_word(int layer, int expert, uint32_t rows) {
    return ((uint32_t)layer + 1) << 24 | rows << 16 | ((uint32_t)expert & 0xffffu);
}
__device__ __forceinline__ bool slot_word_of(uint32_t w, int layer) { return w >> 24 == (uint32_t)layer + 1; }
static_assert(kMaxLayers < 255 && NMK_MK_MAX_BATCH <= 8, "a slot word's layer and rows fit in its 16 high bits");

// Thread 0, once per launch (a barrier must follow before any other use of the CTA's Kept).
__device__ __forceinline__ void kept_init(char *smem) {
    Kept &k = kept(smem);
    k.normed = -1;
    k.claimed = 0, k.claimed_task = nmk_task{};
    k.seen = -1, k.seen_target = 0;
    k.slots_layer = -1;
    mbar_init(&k.image_full, 1);
    mbar_init(&k.image_empty, kThreads);
    mbar_init(&k.staged, kThreads);
    for (int b = 0; b < kWarps; b++) mbar_init(&k.block_staged[b], 32);
    mbar_init_fence();
    k.image_uses = 0;
    k.staged_uses = 0, k.block_uses = 0;
}

// A GEMV input that its producers wrote in global memory in its shared-memory image (in_offset),
// staged by one bulk copy of `bytes` into dst. Returns the copy's completion, for TileDot (whose
// warps wait for it only after their first weight burst is in flight); call stage_image_end
// after the gemv. The copies of successive tasks are ordered as a ring of one slot: thread 0
// issues one only once every thread has released the previous image.
struct ImageCopy {
    uint64_t *full;
    uint32_t parity;
};
__device__ __forceinline__ ImageCopy stage_image(char *smem, bf16 *dst, const bf16 *src, int bytes) {
    Kept &k = kept(smem);
    const uint32_t n = k.image_uses;
    if (threadIdx.x == 0) {
        if (n > 0) mbar_wait(&k.image_empty, (n - 1) & 1);
        fence_proxy_async();  // the producers' stores (acquired by the task's wait) and this smem's last use
        mbar_arrive_expect(&k.image_full, bytes);
        bulk_load(dst, src, bytes, &k.image_full);
    }
    return {&k.image_full, n & 1};
}

// All threads, after the gemv that read the image (past its closing barrier, every thread has
// read image_uses for this copy).
__device__ __forceinline__ void stage_image_end(char *smem, ImageCopy c) {
    Kept &k = kept(smem);
    mbar_wait(c.full, c.parity);  // a warp without GEMV work has not observed it yet
    mbar_arrive(&k.image_empty);
    if (threadIdx.x == 0) k.image_uses++;
}

// Chunk c (8 columns) of the B rows of a normed input, from each row's x (two float4, bf16
// values) and rms and the norm's weight (8 bf16): bf16(round(x * rms) * weight), the roundings of
// the reference's RMSNorm.
template <int B>
__device__ __forceinline__ void store_normed_chunk(bf16 *dst, int c, const float4 (&xa)[B], const float4 (&xb)[B],
                                                   const float *rms, uint4 w) {
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
        store_in_chunk(dst, r, c, out);
    }
}

__device__ __forceinline__ float4 round_bf16(float4 v) {
    return make_float4(round_bf16(v.x), round_bf16(v.y), round_bf16(v.z), round_bf16(v.w));
}

// Chunk c of the B rows of the residual sums of `tag` (not yet rounded).
template <int B>
__device__ __forceinline__ void load_x_chunk(const Params &p, int tag, int c, float4 (&xa)[B], float4 (&xb)[B]) {
    const float *x = resid_of(p, tag);
#pragma unroll
    for (int r = 0; r < B; r++) {
        const float4 *row = reinterpret_cast<const float4 *>(x + (size_t)r * p.hidden) + 2 * c;
        xa[r] = load_l2(row), xb[r] = load_l2(row + 1);
    }
}

// The thread's sums of squares of x over its chunks (threadIdx.x, + kThreads, ...): the first
// one's values in xa and xb (loaded, rounded here), the others loaded here.
template <int B>
__device__ __forceinline__ void chunk_squares(const Params &p, int tag, float4 (&xa)[B], float4 (&xb)[B],
                                              float (&ss)[B]) {
    const int chunks = p.hidden / 8;
#pragma unroll
    for (int r = 0; r < B; r++) {
        xa[r] = round_bf16(xa[r]), xb[r] = round_bf16(xb[r]);
        const float4 u = xa[r], v = xb[r];
        ss[r] = threadIdx.x < chunks ? u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w + v.x * v.x + v.y * v.y +
                                           v.z * v.z + v.w * v.w
                                     : 0.f;
    }
#pragma unroll 1
    for (int c = threadIdx.x + kThreads; c < chunks; c += kThreads) {  // hidden > 8 * kThreads
        float4 ya[B], yb[B];
        load_x_chunk<B>(p, tag, c, ya, yb);
#pragma unroll
        for (int r = 0; r < B; r++) {
            const float4 u = round_bf16(ya[r]), v = round_bf16(yb[r]);
            ss[r] += u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w + v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
    }
}

// The warp's sums of squares of each row into Kept::ss_part[slot] (the warp's own, or the column
// block it staged: gemv_blocks). The B rows' sums share the
// shuffles: each round of the first log2(P) (P: B rounded up to a power of two) halves the
// values a lane holds, a lane keeping the half its bit selects and adding its partner's (P - 1
// shuffles in all, not 5 B), so that lane l ends with row (l >> (5 - log2 P)) % P's sum over
// the lanes that share those bits; the last rounds add over the remaining bits.
template <int B>
__device__ __forceinline__ void warp_squares(char *smem, const float (&ss)[B], int slot = threadIdx.x >> 5) {
    constexpr int P = B <= 1 ? 1 : B <= 2 ? 2 : B <= 4 ? 4 : 8;
    const int lane = threadIdx.x & 31;
    float v[P];
#pragma unroll
    for (int r = 0; r < P; r++) v[r] = r < B ? ss[r] : 0.f;
    int o = 16;
#pragma unroll
    for (int half = P / 2; half >= 1; half /= 2, o /= 2) {
        const bool upper = lane & o;
#pragma unroll
        for (int j = 0; j < half; j++) {
            const float got = __shfl_xor_sync(0xffffffffu, upper ? v[j] : v[j + half], o);
            v[j] = (upper ? v[j + half] : v[j]) + got;
        }
    }
#pragma unroll
    for (; o >= 1; o /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    const int row = (lane >> (5 - (P == 8 ? 3 : P == 4 ? 2 : P == 2 ? 1 : 0))) % P;
    if (row < B && (lane & (32 / P - 1)) == 0) kept(smem).ss_part[slot][row] = v[0];
}

// Each row's rms from the warps' sums of squares (in warp order).
template <int B>
__device__ __forceinline__ void rms_of(char *smem, const Params &p, float (&rms)[B]) {
    const Kept &k = kept(smem);
#pragma unroll
    for (int r = 0; r < B; r++) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; w++) s += k.ss_part[w][r];
        rms[r] = rsqrtf(s / p.hidden + p.norm_eps);
    }
}

// Normalizes and stores the thread's chunks (the first one's values in xa and xb, the others
// loaded again).
template <int B>
__device__ __forceinline__ void store_normed_chunks(char *smem, const Params &p, int tag, const bf16 *weight,
                                                    float4 (&xa)[B], float4 (&xb)[B], uint4 w, const float (&rms)[B]) {
    bf16 *dst = reinterpret_cast<bf16 *>(smem);
    const int chunks = p.hidden / 8;
    if (threadIdx.x < chunks) store_normed_chunk<B>(dst, threadIdx.x, xa, xb, rms, w);
#pragma unroll 1
    for (int c = threadIdx.x + kThreads; c < chunks; c += kThreads) {
        load_x_chunk<B>(p, tag, c, xa, xb);
        w = reinterpret_cast<const uint4 *>(weight)[c];
#pragma unroll
        for (int r = 0; r < B; r++) xa[r] = round_bf16(xa[r]), xb[r] = round_bf16(xb[r]);
        store_normed_chunk<B>(dst, c, xa, xb, rms, w);
    }
}

// The normed residual of `tag` (a layer, or num_layers for the final norm) as a GEMV input at
// smem offset 0: h = bf16(round(x * rms) * weight), x the residual's sums rounded to bf16 and
// rms from their sums of squares (the roundings of the reference's RMSNorm). When the CTA's
// last staging was the same, the input is still there and nothing is read. Ends with a barrier.
template <int B>
__device__ __forceinline__ void stage_normed(char *smem, const Params &p, const bf16 *weight, int tag) {
    Kept &k = kept(smem);
    if (k.normed == tag) return;
    float4 xa[B] = {}, xb[B] = {};
    uint4 w{};
    float ss[B], rms[B];
    if (threadIdx.x < p.hidden / 8) {
        load_x_chunk<B>(p, tag, threadIdx.x, xa, xb);
        w = reinterpret_cast<const uint4 *>(weight)[threadIdx.x];
    }
    chunk_squares<B>(p, tag, xa, xb, ss);
    warp_squares<B>(smem, ss);
    __syncthreads();
    rms_of<B>(smem, p, rms);
    store_normed_chunks<B>(smem, p, tag, weight, xa, xb, w, rms);
    fence_proxy_async_shared();
    __syncthreads();
    if (threadIdx.x == 0) k.normed = tag;  // every thread read it above, before the barrier
}

// Up to kStagedMaxBatch rows, QKV and the router read their input scaled after the GEMV: the
// staged input is bf16(x * weight), x the residual's sums rounded to bf16, and the GEMV's outputs
// are multiplied by each row's rms (rms_of, from the stagers' sums of squares) before they are
// rounded. So no staging waits for the whole row: each chunk of the input is staged as soon as
// its column block is complete (a counter per NMK_MK_BLOCK_COLS columns; the tasks run in the
// previous layer's tail: schedule builder). A 2048-wide input goes through gemv_blocks, whose
// warps go on block by block; any other through this staging.
//
// The staging by the CTA's threads around their first weight burst, with no CTA barrier (a
// Stage for TileDotT): load() waits for the thread's first chunk's block (lane 0 polls, then
// each lane's own acquire: a warp's 32 chunks are one block) and issues its loads, after the
// burst's; finish() rounds, sums the squares, stores the chunk (waiting for and loading any
// further chunks then), writes the warp's sums of squares (Kept::ss_part), keeps the rounded x
// and weight of chunks [stash0, stash1) in `stash` (the router's share of the exact normed
// image, written once the rms is known), and arrives on Kept::staged; gemv's warps wait for all
// kThreads arrivals before their first mma.
template <int B>
struct NormedStaging {
    static constexpr bool kActive = true;
    const Params *p;
    char *smem;
    const bf16 *weight;
    int tag;
    const uint32_t *counter = nullptr;  // the input's first block counter, or none (complete)
    uint32_t target = 0;
    uint4 *stash = nullptr;  // [stash1 - stash0][B + 1]: each chunk's rounded x rows, then its weight
    int stash0 = 0, stash1 = 0;
    // what load() issued (zeroed: read only where loaded, which ptxas cannot see)
    float4 xa[B] = {}, xb[B] = {};
    uint4 w = {};

    __device__ __forceinline__ bool waits() const { return counter != nullptr; }

    __device__ __forceinline__ void wait_block(int c) const {
        if (!counter) return;
        const uint32_t *block = counter + c * 8 / NMK_MK_BLOCK_COLS;
        if ((threadIdx.x & 31) == 0)
            while (load_acquire(block) < target) __nanosleep(20);
        __syncwarp();
        (void)load_acquire(block);
    }

    __device__ __forceinline__ void load_chunk(int c) {
        wait_block(c);
        load_x_chunk<B>(*p, tag, c, xa, xb);
        w = reinterpret_cast<const uint4 *>(weight)[c];
    }

    __device__ __forceinline__ void load() {
        if (threadIdx.x < p->hidden / 8) load_chunk(threadIdx.x);
    }

    // The loaded chunk c: x rounded, its squares added to ss, bf16(x * weight) stored at smem
    // offset 0, the rounded x and the weight kept in `stash` when c is in [stash0, stash1).
    __device__ __forceinline__ void stage_chunk(int c, float (&ss)[B]) const {
        float wf[8];
        unpack8(w, wf);
        const bool kept_here = c >= stash0 && c < stash1;
#pragma unroll
        for (int r = 0; r < B; r++) {
            const float4 u = round_bf16(xa[r]), v = round_bf16(xb[r]);
            ss[r] += u.x * u.x + u.y * u.y + u.z * u.z + u.w * u.w + v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            const float x[8] = {u.x, u.y, u.z, u.w, v.x, v.y, v.z, v.w};
            uint4 out, xr;
            uint32_t *o = reinterpret_cast<uint32_t *>(&out), *q = reinterpret_cast<uint32_t *>(&xr);
#pragma unroll
            for (int j = 0; j < 4; j++) {
                o[j] = pack_bf16(x[2 * j] * wf[2 * j], x[2 * j + 1] * wf[2 * j + 1]);
                q[j] = pack_bf16(x[2 * j], x[2 * j + 1]);  // exact: x is bf16
            }
            store_in_chunk(reinterpret_cast<bf16 *>(smem), r, c, out);
            if (kept_here) stash[(c - stash0) * (B + 1) + r] = xr;
        }
        if (kept_here) stash[(c - stash0) * (B + 1) + B] = w;
    }

    __device__ __forceinline__ void finish() {
        Kept &k = kept(smem);
        float ss[B] = {};
#pragma unroll 1
        for (int c = threadIdx.x; c < p->hidden / 8; c += kThreads) {
            if (c != threadIdx.x) load_chunk(c);
            stage_chunk(c, ss);
        }
        warp_squares<B>(smem, ss);
        mbar_arrive(&k.staged);
        __syncwarp();  // the warp's own reads of what its lanes staged
    }
};
struct NoStaging {
    static constexpr bool kActive = false;
    __device__ __forceinline__ bool waits() const { return false; }
    __device__ __forceinline__ void load() {}
    __device__ __forceinline__ void finish() {}
};

// ---- the tensor-core GEMV ---------------------------------------------------------------------
// Weights as A (16 rows a warp) straight from global memory into registers, the 8 batch rows
// as B. The reduction order inside an mma is free, so each lane loads 16 contiguous bytes per
// row: lane (g, t) reads weight rows g and g + 8 at k0 + 8t .. k0 + 8t + 7 of a 32-wide k step,
// and the step's two k16 mmas take words {0, 1} and {2, 3} of those chunks as the fragment's
// k pairs {2t, 2t + 1} and {2t + 8, 2t + 9}; the input's layout (store_in_chunk) holds the
// matching k pairs of x in the B operand's places. Tiles in fours run as one wgmma m64n8k16
// per k16 step for the warpgroup (A from the four warps' registers, B from shared memory);
// other tiles as mma.sync m16n8k16 per warp, B through ldmatrix. The fragments of A and of
// the accumulators are the same in both.
__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16_k8(float c[4], uint32_t a0, uint32_t a1, uint32_t b0) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
}

// Four 8 x 8 bf16 matrices from shared memory, transposed: lane l gives the address of row l % 8
// of matrix l / 8 and gets, of each matrix i, rows 2 (l % 4) and 2 (l % 4) + 1 of column l / 4.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// lo, hi: the lane's 16 bytes of rows g and g + 8; x: its words of the input's block.
__device__ __forceinline__ void mma_k32(float c[4], uint4 lo, uint4 hi, uint4 x) {
    mma_bf16(c, lo.x, hi.x, lo.y, hi.y, x.x, x.y);
    mma_bf16(c, lo.z, hi.z, lo.w, hi.w, x.z, x.w);
}

// The lane's address for ldmatrix in a GEMV input (in_addr: its shared-memory address): lane l
// points at row l % 8 of core matrix l / 8, so load_in_k32 returns word t of row g of the four
// core matrices, the B fragments of mma_k32.
__device__ __forceinline__ uint32_t in_lane_addr(uint32_t in_addr) {
    const int lane = threadIdx.x & 31;
    return in_addr + (lane >> 3) * 128 + (lane & 7) * 16;
}
__device__ __forceinline__ uint4 load_in_k32(uint32_t lane_addr, int k) {
    uint4 v;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(lane_addr + k / 32 * kInBlockBytes));
    return v;
}

// wgmma's descriptor of the input's block holding k (K-major, no swizzle: the two core
// matrices of a k16 step 128 bytes apart); + 256 bytes (16 units) for the step's second k16.
__device__ __forceinline__ uint64_t in_desc(uint32_t in_addr, int k) {
    cute::GmmaDescriptor d;
    d.bitfield.start_address_ = static_cast<uint16_t>((in_addr + k / 32 * kInBlockBytes) >> 4);
    d.bitfield.leading_byte_offset_ = 128 >> 4;
    d.bitfield.stride_byte_offset_ = 512 >> 4;  // to the next 8 batch rows: there are none
    d.bitfield.base_offset_ = 0;
    d.bitfield.layout_type_ = static_cast<uint8_t>(cute::SM90::GMMA::LayoutType::INTERLEAVE);
    return d.desc_;
}

using Wgmma = cute::SM90::GMMA::MMA_64x8x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::K>;

// Independent accumulator chains of a burst: step i of a burst adds into chain i % kChains, so
// its mmas do not wait for one another's results; the chains add up at the end of the k loop.
constexpr int kChains = 2;

// The warp's quarter of a warpgroup's wgmmas over S 32-wide steps (both k16 of each) from
// `desc`, A from lo and hi, step i into chain i % kChains; waits until they have read the registers.
template <int S>
__device__ __forceinline__ void wgmma_steps(float (&c)[kChains][4], const uint4 *lo, const uint4 *hi, uint64_t desc) {
#pragma unroll
    for (int j = 0; j < kChains; j++)
#pragma unroll
        for (int v = 0; v < 4; v++) cute::warpgroup_fence_operand(c[j][v]);
    cute::warpgroup_arrive();
#pragma unroll
    for (int i = 0; i < S; i++) {
        const uint64_t d = desc + i * (kInBlockBytes >> 4);
        float *a = c[i % kChains];
        Wgmma::fma(lo[i].x, hi[i].x, lo[i].y, hi[i].y, d, a[0], a[1], a[2], a[3]);
        Wgmma::fma(lo[i].z, hi[i].z, lo[i].w, hi[i].w, d + (256 >> 4), a[0], a[1], a[2], a[3]);
    }
    cute::warpgroup_commit_batch();
    cute::warpgroup_wait<0>();
#pragma unroll
    for (int j = 0; j < kChains; j++)
#pragma unroll
        for (int v = 0; v < 4; v++) cute::warpgroup_fence_operand(c[j][v]);
}

// 32-wide k steps whose weight loads a lane issues together (a burst): tile_dot's default, and
// every GEMV's but the layer's tail tiles' up to kLongBurstMaxBatch rows (tail_burst).
constexpr int kStepsInFlight = 8;

// c += rows lo, hi (lane's rows g, g + 8) . input row g over k in [ka, kb) (multiples of 32), in
// bursts of kSteps steps:
// with wgmma (kWg, the whole warpgroup at once; in_addr the input's address) or mma.sync
// (in_addr the lane's ldmatrix address). Row-major weights hold the lane's column k at lo + k;
// tiled ones (kTiled) at lo + 16 k.
// With `ready` the input lands by a bulk copy (stage_image) or by the threads' staging (`stage`
// when stage_now: its loads first, its math after the first burst's loads, or before any weight
// load when the unit is shorter than a burst): each burst's loads are issued before the wait
// (once the input is complete, the wait passes at once).
template <bool kWg, bool kTiled, class Stage = NoStaging, int kSteps = kStepsInFlight>
__device__ __forceinline__ void tile_dot(const bf16 *lo, const bf16 *hi, uint32_t in_addr, int ka, int kb, float c[4],
                                         uint64_t *ready, uint32_t parity, const Stage &stage = {},
                                         bool stage_now = false) {
    constexpr int kScale = kTiled ? 16 : 1;
    int k = ka;
    Stage st = stage;
    if (Stage::kActive && stage_now && !st.waits()) {
        st.load();
        asm volatile("" ::: "memory");  // its loads issue before the burst's
    }
    uint4 wl[kSteps], wh[kSteps];
    float acc[kChains][4] = {};
#pragma unroll 1
    for (; k + 32 * kSteps <= kb; k += 32 * kSteps) {
#pragma unroll
        for (int i = 0; i < kSteps; i++) {
            wl[i] = load_weight<kTiled>(lo + kScale * (k + 32 * i));
            wh[i] = load_weight<kTiled>(hi + kScale * (k + 32 * i));
        }
        if (Stage::kActive && stage_now) {
            if (st.waits()) st.load();  // the burst in flight through the task's wait
            st.finish(), stage_now = false;
        }
        if (ready) mbar_wait(ready, parity);
        if (kWg) {
            wgmma_steps<kSteps>(acc, wl, wh, in_desc(in_addr, k));
        } else {
#pragma unroll
            for (int i = 0; i < kSteps; i++)
                mma_k32(acc[i % kChains], wl[i], wh[i], load_in_k32(in_addr, k + 32 * i));
        }
    }
    if (Stage::kActive && stage_now) {  // a unit shorter than a burst: staged before its loads
        if (st.waits()) st.load();
        st.finish();
    }
#pragma unroll 1
    for (; k < kb; k += 32) {
        const uint4 l = load_weight<kTiled>(lo + kScale * k), h = load_weight<kTiled>(hi + kScale * k);
        if (ready) mbar_wait(ready, parity);
        if (kWg) wgmma_steps<1>(acc, &l, &h, in_desc(in_addr, k));
        else mma_k32(acc[0], l, h, load_in_k32(in_addr, k));
    }
#pragma unroll
    for (int j = 0; j < kChains; j++)
#pragma unroll
        for (int v = 0; v < 4; v++) c[v] += acc[j][v];
}

// tile_dot as gemv's k loops, over weights in the tiled layout (TileDot: every matrix the kernel
// streams) or row-major (RowMajorDot: tools/gemv_bench.cu's row-major paths, which also pass
// other Dots, with shared scratch and mma.sync only: kWarpgroups false).
// With a Stage (kStaged; mma.sync only), gemv passes `first` (the warp's first unit: the staging
// runs there) and runs the staging itself for a warp that has no unit.
template <bool kTiledLayout, class Stage = NoStaging, int kSteps = kStepsInFlight>
struct TileDotT {
    // has warpgroup(): tiles in fours run as wgmma (not with a Stage: the staging's code once less)
    static constexpr bool kWarpgroups = !Stage::kActive;
    static constexpr bool kTiled = kTiledLayout;
    static constexpr bool kStaged = Stage::kActive;
    uint64_t *ready = nullptr;                 // the input's bulk copy (stage_image) or staging, or none
    uint32_t parity = 0;
    Stage stage = {};
    __device__ __forceinline__ void operator()(const bf16 *lo, const bf16 *hi, uint32_t lane_addr, int ka, int kb,
                                               float c[4], char *, bool first = false) const {
        tile_dot<false, kTiled, Stage, kSteps>(lo, hi, lane_addr, ka, kb, c, ready, parity, stage, first);
    }
    __device__ __forceinline__ void warpgroup(const bf16 *lo, const bf16 *hi, uint32_t in_addr, int ka, int kb,
                                              float c[4]) const {
        tile_dot<true, kTiled, NoStaging, kSteps>(lo, hi, in_addr, ka, kb, c, ready, parity);
    }
};
using TileDot = TileDotT<true>;
using RowMajorDot = TileDotT<false>;

// dot.warpgroup(...) for a Dot that has it (gemv calls it only then).
template <class Dot>
__device__ __forceinline__ void warpgroup_dot(const Dot &dot, const bf16 *lo, const bf16 *hi, uint32_t in_addr, int ka,
                                              int kb, float c[4]) {
    if constexpr (Dot::kWarpgroups) dot.warpgroup(lo, hi, in_addr, ka, kb, c);
}

// Pieces of K per unit of work (a 16-row tile for a warp, four for a warpgroup) so that (unit,
// piece) items spread evenly over the workers: the fewest pieces that minimize the busiest
// worker's share, at most kWarps pieces, kMaxGemvItems (16-row tile, piece) items and one
// 32-wide step per piece.
__device__ __forceinline__ int k_parts(int units, int tiles_per_unit, int workers, int steps) {
    int best = 1, best_rounds = (units + workers - 1) / workers;  // share = rounds / parts
#pragma unroll 1
    for (int ks = 2; ks <= kWarps && ks <= steps && units * tiles_per_unit * ks <= kMaxGemvItems; ks++) {
        const int rounds = (units * ks + workers - 1) / workers;
        if (rounds * best < best_rounds * ks) best = ks, best_rounds = rounds;
    }
    return best;
}

// out[r * 8 + n] = row(r) . in[n] for r < n_rows (out: shared fp32, [round_up(n_rows, 16)][8]).
// Tiles in fours go to the two warpgroups as (four tiles, piece of K) items, any other count
// to the warps as (16-row tile, piece of K) items (k_parts); pieces add up through `red`
// (shared, kMaxGemvItems * 128 floats). K % 32 == 0. A staged Dot (TileDotT with a Stage)
// writes `in` itself during the call. Ends with a barrier.
template <class Row, class Dot = TileDot>
__device__ __forceinline__ void gemv(Row row, int n_rows, const bf16 *in, int K, float *out, float *red, Dot dot = {},
                                     char *scratch = nullptr) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tiles = (n_rows + 15) / 16, steps = K / 32;
    const bool wg = Dot::kWarpgroups && tiles % 4 == 0;
    const int ks = wg ? k_parts(tiles / 4, 4, 2, steps) : k_parts(tiles, 1, kWarps, steps);
    const int units = (wg ? tiles / 4 : tiles) * ks, first = wg ? warp / 4 : warp, stride = wg ? 2 : kWarps;
    const uint32_t in_addr = smem_u32(in);
#pragma unroll 1
    for (int u = first; u < units; u += stride) {
        const int tile = wg ? u / ks * 4 + warp % 4 : u / ks, part = u % ks, item = tile * ks + part, r = tile * 16 + g;
        const bf16 *lo, *hi;
        if constexpr (Dot::kTiled) {  // the band's rows past n_rows are the layout's zero rows
            lo = row(tile * 16) + 8 * lane, hi = lo + 256;
        } else {
            lo = row(min(r, n_rows - 1)) + 8 * t, hi = row(min(r + 8, n_rows - 1)) + 8 * t;
        }
        const int ka = steps * part / ks * 32, kb = steps * (part + 1) / ks * 32;
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        if (wg) warpgroup_dot(dot, lo, hi, in_addr, ka, kb, c);
        else if constexpr (Dot::kStaged) dot(lo, hi, in_lane_addr(in_addr), ka, kb, c, scratch, u == first);
        else dot(lo, hi, in_lane_addr(in_addr), ka, kb, c, scratch);
        float *dst = ks == 1 ? out + tile * 128 : red + item * 128;
        *reinterpret_cast<float2 *>(dst + g * 8 + 2 * t) = make_float2(c[0], c[1]);
        *reinterpret_cast<float2 *>(dst + (g + 8) * 8 + 2 * t) = make_float2(c[2], c[3]);
    }
    if constexpr (Dot::kStaged)
        if (first >= units) {  // a warp without a unit stages its share too
            auto st = dot.stage;
            st.load();
            st.finish();
        }
    __syncthreads();
    if (ks > 1) {  // the parts' loads at once, their sum in part order (as the loop's)
#pragma unroll 1
        for (int i = threadIdx.x; i < tiles * 128; i += kThreads) {
            const float *src = red + i / 128 * ks * 128 + i % 128;
            float v[kWarps];
#pragma unroll
            for (int part = 0; part < kWarps; part++) v[part] = part < ks ? src[part * 128] : 0.f;
            float s = 0.f;
#pragma unroll
            for (int part = 0; part < kWarps; part++)
                if (part < ks) s += v[part];
            out[i] = s;
        }
        __syncthreads();
    }
}

// A layer's o-proj and DOWN tiles run in its tail, where fewer SMs stream and DRAM is below its
// peak: up to this batch size their bursts are longer, so that a tile takes fewer round trips.
// An o-proj warp's share of its tile (16 rows x 512 columns) is one burst of 16 steps instead of
// two of 8, a DOWN warpgroup's (64 rows x an expert's 768) two of 12 instead of three: batch 1
// +0.9% each. What streams beside attention pays in attention's time: GATE_UP's bursts of 16
// gained 0.5% alone (attention's tasks 12.8 -> 14.1 us) and lost 2.3% beside DOWN's of 12; every
// GEMV's bursts of 16 lost 5-7% in session 18 (benchmarks/NOTES.md, session 36). A burst must
// divide the unit's steps: tile_dot runs the steps past its last whole burst one at a time, a
// round trip each (DOWN's 24 steps in bursts of 16: 6.5 -> 9.8 us a task).
constexpr int kLongBurstMaxBatch = 2;
template <int B>
constexpr int tail_burst(int steps) {
    return B <= kLongBurstMaxBatch ? steps : kStepsInFlight;
}

// Up to this batch size a GEMV over a layer's normed input stages it while the warps' first
// weight bursts are in flight (gemv_normed); past it the staging's registers beside a burst's
// would crowd the kernel.
constexpr int kStagedMaxBatch = NMK_MK_POST_SCALED_MAX_BATCH;

// gemv_normed's staged GEMV where the input is kWarps column blocks (hidden = 2048): its
// (16-row tile, block) items go to the warps in block order (item i = block * tiles + tile, warp
// i % kWarps, in turn), so that the blocks completed last are each warp's last item and a warp
// holds that item's weights (issued before it waits) when they complete. A block's first item's
// warp stages it (NormedStaging's form: bf16(x * weight), its sums of squares in
// Kept::ss_part[block]) once its counter is complete, and arrives on Kept::block_staged[block];
// the block's other items wait for that. Partial sums per (tile, block) in `red`, added in block
// order into out. Ends with a barrier.
template <int B, class Row>
__device__ __forceinline__ void gemv_blocks(char *smem, const Params &p, const bf16 *weight, int tag, Row row,
                                            int n_rows, bf16 *in, float *out, float *red, const uint32_t *counter,
                                            uint32_t target, uint4 *stash, int stash0, int stash1) {
    Kept &k = kept(smem);
    const uint32_t parity = k.block_uses & 1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int tiles = (n_rows + 15) / 16, items = tiles * kWarps;
    const uint32_t lane_addr = in_lane_addr(smem_u32(in));
#pragma unroll 1
    for (int i = warp; i < items; i += kWarps) {
        const int blk = i / tiles, tile = i % tiles, ka = blk * NMK_MK_BLOCK_COLS;
        const bf16 *lo = row(tile * 16) + 8 * lane, *hi = lo + 256;
        uint4 wl[kStepsInFlight], wh[kStepsInFlight];
#pragma unroll
        for (int j = 0; j < kStepsInFlight; j++) {
            wl[j] = load_weight<true>(lo + 16 * (ka + 32 * j));
            wh[j] = load_weight<true>(hi + 16 * (ka + 32 * j));
        }
        if (tile == 0) {
            // stage the block: lane l its chunk 32 blk + l (NormedStaging's load and stage_chunk)
            NormedStaging<B> st{&p, smem, weight, tag, counter, target, stash, stash0, stash1};
            const int c = blk * 32 + lane;
            float ss[B] = {};
            st.load_chunk(c);
            st.stage_chunk(c, ss);
            warp_squares<B>(smem, ss, blk);
            mbar_arrive(&k.block_staged[blk]);
            __syncwarp();  // the warp's own reads of what its lanes staged
        } else {
            mbar_wait(&k.block_staged[blk], parity);
        }
        float acc[kChains][4] = {};
#pragma unroll
        for (int j = 0; j < kStepsInFlight; j++)
            mma_k32(acc[j % kChains], wl[j], wh[j], load_in_k32(lane_addr, ka + 32 * j));
        float c4[4];
#pragma unroll
        for (int v = 0; v < 4; v++) c4[v] = acc[0][v] + acc[1][v];
        float *dst = red + (tile * kWarps + blk) * 128;
        *reinterpret_cast<float2 *>(dst + g * 8 + 2 * t) = make_float2(c4[0], c4[1]);
        *reinterpret_cast<float2 *>(dst + (g + 8) * 8 + 2 * t) = make_float2(c4[2], c4[3]);
    }
    __syncthreads();
#pragma unroll 1
    for (int i = threadIdx.x; i < tiles * 128; i += kThreads) {  // the blocks' sums in block order
        const float *src = red + i / 128 * kWarps * 128 + i % 128;
        float v[kWarps];
#pragma unroll
        for (int b = 0; b < kWarps; b++) v[b] = src[b * 128];
        float sum = 0.f;
#pragma unroll
        for (int b = 0; b < kWarps; b++) sum += v[b];
        out[i] = sum;
    }
    __syncthreads();
}

// gemv over the input of `tag` with the norm's weight, at smem offset 0 (`in`). Up to
// kStagedMaxBatch rows, scaled after the GEMV (NormedStaging: the caller multiplies each output
// by post_rms's rms), its chunks waiting on the input's block counters from `counter` (to
// target; none: the input is complete), `stash` keeping chunks [stash0, stash1) (NormedStaging);
// past that, stage_normed's normed input (the task waited for the whole input). Ends with a barrier.
template <int B, class Row>
__device__ __forceinline__ void gemv_normed(char *smem, const Params &p, const bf16 *weight, int tag, Row row,
                                            int n_rows, bf16 *in, int K, float *out, float *red,
                                            const uint32_t *counter = nullptr, uint32_t target = 0,
                                            uint4 *stash = nullptr, int stash0 = 0, int stash1 = 0) {
    Kept &k = kept(smem);
    if constexpr (B <= kStagedMaxBatch) {
        if (K == kWarps * NMK_MK_BLOCK_COLS && (n_rows + 15) / 16 * kWarps <= kMaxGemvItems) {
            gemv_blocks<B>(smem, p, weight, tag, row, n_rows, in, out, red, counter, target, stash, stash0, stash1);
            if (threadIdx.x == 0) k.block_uses++;  // every thread read the count before gemv_blocks's last barrier
        } else {
            const uint32_t parity = k.staged_uses & 1;
            const TileDotT<true, NormedStaging<B>> dot{
                &k.staged, parity, {&p, smem, weight, tag, counter, target, stash, stash0, stash1}};
            gemv(row, n_rows, in, K, out, red, dot);
            if (threadIdx.x == 0) k.staged_uses++;  // every thread read the count before gemv's barrier
        }
        if (threadIdx.x == 0) k.normed = -1;
    } else {
        stage_normed<B>(smem, p, weight, tag);
        gemv(row, n_rows, in, K, out, red);
    }
}

// The factor of a gemv_normed output of batch row b: its rms up to kStagedMaxBatch rows (the
// stagers' sums of squares, past gemv's barrier), 1 past that (the input was normed).
template <int B>
struct PostRms {
    float rms[B <= kStagedMaxBatch ? B : 1];
    __device__ __forceinline__ PostRms(char *smem, const Params &p) {
        if constexpr (B <= kStagedMaxBatch) rms_of<B>(smem, p, rms);
        else rms[0] = 1.f;
    }
    __device__ __forceinline__ float operator()(int b) const {
        if constexpr (B == 2) return b ? rms[1] : rms[0];
        return rms[0];
    }
};

// Shared-memory carve-up of a GEMV task: input, output, split-K partials, then `extra` bytes
// (at most kGemvExtraBytes). The widest fits in a task's scratch.
constexpr int kMaxGemvRows = 512, kGemvExtraBytes = 4096;
static_assert(in_bytes(kMaxK) + (kMaxGemvRows + kMaxGemvItems * 16) * 8 * 4 + kGemvExtraBytes <= kTaskSmemBytes,
              "a GEMV task's shared memory must stay below kTaskSmemBytes");
struct GemvSmem {
    bf16 *in;
    float *out, *red;
    char *extra;
    __device__ GemvSmem(char *smem, int K, int out_rows) {
        in = reinterpret_cast<bf16 *>(smem);
        out = reinterpret_cast<float *>(smem + in_bytes(K));
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
