// NMK_OP_ATTN: one split of one (row, kv head): the row's live keys are cut into `splits`
// page ranges at run time. The TMA unit streams the split's pages (the kv head's 64 keys and
// 64 values of a page, 16 KB each) into a ring of kAttnSlots slots in shared memory, through
// the group's tensor map (kv_map): a page's keys and values by one copy, each slab as two
// halves of 64 dims (8 KB, one 128-byte row a key) with the 128-byte swizzle, so that the
// warps' reads of a slab hit every bank once (the plain slab's 256-byte rows put a column of
// keys in one bank group); warp w
// takes keys 8w .. 8w + 7 of every page: scores of the group's query heads by tensor cores
// (S = Q K^T, heads as the mma's rows, keys as its 8 columns), an online softmax per head,
// then O^T += V^T P^T by tensor cores too (dims as the mma's rows, the heads as its columns). The warps merge into the split's partial
// (acc, max, sum); the last split of the pair to finish merges the splits into attn_out (a
// ticket per pair in global memory), so o-proj waits on ATTN alone.
#pragma once

#include "common.cuh"

namespace nmk::mk {

constexpr int kPartStride = kHeadDim + 2;  // acc[head_dim], max, sum
constexpr int kQStride = kHeadDim + 8;     // bf16 per query head in shared memory
constexpr int kChunk = 8;                  // keys a warp takes of a page: one n8 tile of the mma
constexpr int kAttnSlots = attn_slots(kBuildBatch);  // pages in flight per SM (32 KB each)
constexpr int kSlabBytes = kPage * kHeadDim * sizeof(bf16);  // a kv head's keys (or values) of a page
constexpr int kBoxBytes = kSlabBytes / 2;                     // its dims [0, 64) or [64, 128): 128 bytes a key
constexpr int kAttnRingBytes = kAttnSlots * 2 * kSlabBytes;   // at smem offset 0
constexpr int kListedPages = 128;          // page numbers a split reads up front; later ones from the table
static_assert(kChunk * kWarps == kPage, "the warps split a page's keys");

// Byte offset in a slab of key `key`'s 16-byte chunk of dims [8c, 8c + 8): box c / 8, row key,
// chunk c % 8 swizzled by the row (the ring's slots are 1024-byte aligned).
__device__ __forceinline__ uint32_t slab_offset(int key, int c) {
    return (c >> 3) * kBoxBytes + key * 128 + (((c & 7) ^ (key & 7)) << 4);
}

__device__ __forceinline__ float *part_of(const Params &p, int b, int kvh, int split, int g) {
    int group = p.num_heads / p.num_kv_heads;
    return p.part + ((((size_t)b * p.num_kv_heads + kvh) * NMK_MK_MAX_SPLITS + split) * group + g) * kPartStride;
}

// After the ring, in the task's shared memory.
struct AttnSmem {
    bf16 q[kMaxGroup][kQStride];
    float m[kWarps][kMaxGroup], l[kWarps][kMaxGroup];  // the warps' maxima and sums; then m: their weights
    float head_max[kMaxGroup], head_den[kMaxGroup];      // the split's, per head
    float split_w[NMK_MK_MAX_SPLITS][kMaxGroup], split_l[NMK_MK_MAX_SPLITS][kMaxGroup];
    float den[kMaxGroup];
    int32_t page[kListedPages];  // physical pages of the split's first kListedPages pages
    uint64_t full[kAttnSlots];   // a slot's page has landed (thread 0's arrival + the bytes)
    uint64_t empty[kAttnSlots];  // every thread is done with a slot's page
    int last;
};
// The warps' accumulators for their merge; they take the ring's place once every page is read.
// Lane (g, t) stores dims 16j + g (+ 8) of heads 2t and 2t + 1: with heads kAccStride floats
// apart, one store's 32 lanes fall in banks 8t + g + const, all distinct (kHeadDim apart put the
// four t of a g in one bank).
constexpr int kAccStride = kHeadDim + 4;
using WarpAcc = float[kWarps][kMaxGroup][kAccStride];

static_assert(sizeof(WarpAcc) <= kAttnRingBytes, "the warps' accumulators alias the ring");
static_assert(kAttnRingBytes + sizeof(AttnSmem) <= kTaskSmemBytes, "attention's shared memory must stay below kTaskSmemBytes");
static_assert(kMaxGroup * kHeadDim % kThreads == 0, "merge_splits gives each thread the same number of outputs");

// Merges the splits of (b, kvh) from their partials into attn_out.
__device__ inline void merge_splits(const Params &p, AttnSmem &s, int b, int kvh, int splits) {
    const int G = p.num_heads / p.num_kv_heads, split_stride = G * kPartStride;
    const float *parts = part_of(p, b, kvh, 0, 0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // Each thread's outputs (g, d), the partials of kBatch splits at a time in flight; the first
    // batch's loads go out with the splits' maxima and sums (one round trip, not two).
    constexpr int kOuts = kMaxGroup * kHeadDim / kThreads, kBatch = 16;
    float num[kOuts] = {};
#pragma unroll 1
    for (int z0 = 0; z0 < splits; z0 += kBatch) {
        float v[kOuts][kBatch];
#pragma unroll
        for (int j = 0; j < kOuts; j++) {
            const int i = threadIdx.x + j * kThreads;
            const float *src = parts + (size_t)z0 * split_stride + i / kHeadDim * kPartStride + i % kHeadDim;
            const bool live = i < G * kHeadDim;
#pragma unroll
            for (int dz = 0; dz < kBatch; dz++)
                v[j][dz] = live && z0 + dz < splits ? load_l2(src + dz * split_stride) : 0.f;
        }
        if (z0 == 0) {
#pragma unroll 1
            for (int i = threadIdx.x; i < splits * G; i += kThreads) {
                const float *part = parts + i / G * split_stride + i % G * kPartStride;
                const float w = load_l2(part + kHeadDim), l = load_l2(part + kHeadDim + 1);  // both loads first
                s.split_w[i / G][i % G] = w;
                s.split_l[i / G][i % G] = l;
            }
            __syncthreads();
            // Warp g weighs head g's splits (lanes take splits lane, lane + 32).
            if (warp < G) {
                float mx = -INFINITY, den = 0.f;
                for (int z = lane; z < splits; z += 32) mx = fmaxf(mx, s.split_w[z][warp]);
#pragma unroll
                for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                for (int z = lane; z < splits; z += 32) {
                    const float w = s.split_w[z][warp] == -INFINITY ? 0.f : __expf(s.split_w[z][warp] - mx);
                    s.split_w[z][warp] = w;
                    den += w * s.split_l[z][warp];
                }
                den = warp_sum(den);
                if (lane == 0) s.den[warp] = den;
            }
            __syncthreads();
        }
#pragma unroll
        for (int j = 0; j < kOuts; j++) {
            const int g = min((threadIdx.x + j * kThreads) / kHeadDim, kMaxGroup - 1);
#pragma unroll
            for (int dz = 0; dz < kBatch; dz++)
                if (z0 + dz < splits) num[j] += s.split_w[z0 + dz][g] * v[j][dz];
        }
    }
#pragma unroll
    for (int j = 0; j < kOuts; j++) {
        const int i = threadIdx.x + j * kThreads, g = i / kHeadDim, d = i % kHeadDim;
        if (i < G * kHeadDim)  // in o-proj's input image (in_offset), which it stages by one bulk copy
            *reinterpret_cast<bf16 *>(reinterpret_cast<char *>(p.attn) + in_offset(b, (kvh * G + g) * kHeadDim + d)) =
                __float2bfloat16(num[j] / s.den[g]);
    }
}

// The split waits for QKV itself (counter `wait` at `target`) once its page numbers, which the
// host wrote before the step, are loaded: its first copies go out as soon as the wait passes
// (with its queries' loads, batch 2 +0.8%, batch 8 +0.4%; benchmarks/NOTES.md, session 47).
__device__ inline void run_attention(const Params &p, int layer, int b, int kvh, int split, int splits, char *smem,
                                     int wait, uint32_t target) {
    const Layer &L = p.layers[layer];
    char *ring = smem;
    AttnSmem &s = *reinterpret_cast<AttnSmem *>(smem + kAttnRingBytes);
    const int G = p.num_heads / p.num_kv_heads, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int pos = p.positions[b];
    const int lo = L.sliding ? max(0, pos - p.sliding_window + 1) : 0;
    const int first_page = lo / kPage, pages = pos / kPage - first_page + 1;
    const int key0 = max(lo, (first_page + split * pages / splits) * kPage);
    const int key1 = min(pos + 1, (first_page + (split + 1) * pages / splits) * kPage);
    const int pg0 = key0 / kPage, np = key1 > key0 ? (key1 - 1) / kPage - pg0 + 1 : 0;  // pages the split reads
    const float scale = rsqrtf((float)kHeadDim);
    const int32_t *table = p.tables[L.group] + (size_t)b * p.table_cols + pg0;
    const TensorMap *map = &p.kv_map[L.group];

    // Thread 0: page i (physical `page`) into slot i % kAttnSlots once every thread has released
    // the slot's previous page (i - kAttnSlots).
    auto issue = [&](int i, int page) {
        const int slot = i % kAttnSlots;
        if (i >= kAttnSlots) {
            mbar_wait(&s.empty[slot], ((i / kAttnSlots) & 1) ^ 1);
            fence_proxy_async_shared();  // after the slot's readers
        }
        if (page < 0) __trap();  // the host guarantees a page for every position it sends
        char *dst = ring + slot * 2 * kSlabBytes;
        const int layer_page = page * L.kv_layers + L.kv_slot;
        mbar_arrive_expect(&s.full[slot], 2 * kSlabBytes);
        // One copy: (k, dims 0-63), (k, 64-127), (v, 0-63), (v, 64-127), kBoxBytes each; the TMA
        // unit takes about as long for a copy of 32 KB as for one of 8 KB (benchmarks/NOTES.md,
        // sessions 28 and 30).
        tensor_load_5d(dst, map, 0, 0, 0, 0, layer_page * 2 * p.num_kv_heads + kvh, &s.full[slot]);
    };
    static_assert(kAttnSlots <= kListedPages, "the first copies take their pages from s.page");
    for (int i = threadIdx.x; i < min(np, kListedPages); i += kThreads) s.page[i] = load_l2(table + i);
    if (wait >= 0 && threadIdx.x == 0)
        while (load_acquire(p.counters + wait) < target) __nanosleep(20);
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int j = 0; j < kAttnSlots; j++) mbar_init(&s.full[j], 1), mbar_init(&s.empty[j], kThreads);
        mbar_init_fence();
        fence_proxy_async();  // the keys QKV wrote (acquired by the wait) and this smem's last use
#pragma unroll
        for (int i = 0; i < kAttnSlots; i++)
            if (i < np) issue(i, s.page[i]);
    }
    // The group's queries (bf16-exact values) as bf16; heads past G are zero. Every thread's
    // loads go out before its first store: a loop whose load sat behind the head's test and
    // before its store waited an L2 round trip per iteration, four in a row.
    constexpr int kQPerThread = kMaxGroup * kHeadDim / kThreads;
    float qv[kQPerThread];
#pragma unroll
    for (int j = 0; j < kQPerThread; j++) {
        const int i = threadIdx.x + j * kThreads, h = min(i / kHeadDim, G - 1), d = i % kHeadDim;
        qv[j] = load_l2(p.q + (size_t)b * p.num_heads * kHeadDim + (kvh * G + h) * kHeadDim + d);
    }
#pragma unroll
    for (int j = 0; j < kQPerThread; j++) {
        const int i = threadIdx.x + j * kThreads, h = i / kHeadDim, d = i % kHeadDim;
        s.q[h][d] = __float2bfloat16(h < G ? qv[j] : 0.f);
    }
    __syncthreads();
    // The lane's A fragments: head g, chunk kc(j) = 2t + 8 (j / 2) + j % 2, dims 8 kc(j) .. + 7,
    // and the keys' B fragments the same chunks: a quarter warp's lanes (two keys, t = 0..3)
    // then read chunks 2t (+ 1) of one box, which the swizzle by key % 8 puts in 8 bank groups.
    auto k_chunk = [&](int j) { return 2 * t + 8 * (j >> 1) + (j & 1); };
    uint4 qa[kHeadDim / 32];
#pragma unroll
    for (int j = 0; j < kHeadDim / 32; j++) qa[j] = *reinterpret_cast<const uint4 *>(&s.q[g][8 * k_chunk(j)]);

    float m = -INFINITY, l = 0.f;  // head g's running max and sum (the same in the 4 lanes of g)
    float acc[kHeadDim / 16][4];   // [j]: dims 16j + g (0, 1), 16j + g + 8 (2, 3) of heads 2t (0, 2), 2t + 1 (1, 3)
#pragma unroll
    for (int j = 0; j < kHeadDim / 16; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.f;
    // The lane's ldmatrix rows in a slot's values: key 8 warp + lane % 8, dims 32q + 8 (lane / 8) ...
    // for the q-th ldmatrix (slab_offset's chunk 4q + lane / 8).
    uint32_t v_lane[kHeadDim / 32];
#pragma unroll
    for (int q = 0; q < kHeadDim / 32; q++)
        v_lane[q] = smem_u32(ring) + kSlabBytes + slab_offset(kChunk * warp + (lane & 7), 4 * q + (lane >> 3));

#pragma unroll 1
    for (int i = 0; i < np; i++) {
        const int slot = i % kAttnSlots, kc = (pg0 + i) * kPage + kChunk * warp;
        mbar_wait(&s.full[slot], (i / kAttnSlots) & 1);
        // Warp's keys kc .. kc + 7 and their values; a chunk with no live key is skipped whole.
        const char *ks = ring + slot * 2 * kSlabBytes;
        if (kc < key1 && kc + kChunk > key0) {
            // sc: scores of head g for keys kc + 2t, + 1 (c[2], c[3]: the zero heads 8..15)
            // two accumulator chains (the k16 halves of each 32-wide step), added at the end
            float sc[4] = {0.f, 0.f, 0.f, 0.f}, sd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < kHeadDim / 32; j++) {
                const uint4 kr = *reinterpret_cast<const uint4 *>(ks + slab_offset(kChunk * warp + g, k_chunk(j)));
                mma_bf16(sc, qa[j].x, 0u, qa[j].y, 0u, kr.x, kr.y);
                mma_bf16(sd, qa[j].z, 0u, qa[j].w, 0u, kr.z, kr.w);
            }
            sc[0] += sd[0], sc[1] += sd[1];
            float v2[2], mx = -INFINITY;
#pragma unroll
            for (int i2 = 0; i2 < 2; i2++) {
                const int key = kc + 2 * t + i2;
                v2[i2] = key >= key0 && key < key1 ? sc[i2] * scale : -INFINITY;
                mx = fmaxf(mx, v2[i2]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m, mx);  // finite: the chunk has a live key
            const float corr = __expf(m - m_new);
            const float e0 = __expf(v2[0] - m_new), e1 = __expf(v2[1] - m_new);
            float sum = e0 + e1;
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            l = l * corr + sum, m = m_new;
            // O^T += V^T P^T by tensor cores: P^T (keys 2t, 2t + 1 of head g) is the B fragment
            // as the scores left it, in two bf16 parts (P = hi + lo: fp32's precision, as the
            // FMAs had); V^T's A fragments come transposed by ldmatrix, with the halves of dead
            // keys zeroed (their values may be garbage, and 0 * NaN is NaN).
            const uint32_t p_hi = pack_bf16(e0, e1), p_lo = pack_bf16(e0 - round_bf16(e0), e1 - round_bf16(e1));
            const float ca = __shfl_sync(0xffffffffu, corr, 8 * t), cb = __shfl_sync(0xffffffffu, corr, 8 * t + 4);
            const int key = kc + 2 * t;
            const uint32_t live = (key >= key0 && key < key1 ? 0x0000ffffu : 0u) |
                                  (key + 1 >= key0 && key + 1 < key1 ? 0xffff0000u : 0u);
#pragma unroll
            for (int q = 0; q < kHeadDim / 32; q++) {
                uint32_t r[4];
                ldmatrix_x4_trans(r, v_lane[q] + slot * 2 * kSlabBytes);
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    float *c = acc[2 * q + h];
                    c[0] *= ca, c[1] *= cb, c[2] *= ca, c[3] *= cb;
                    mma_bf16_k8(c, r[2 * h] & live, r[2 * h + 1] & live, p_hi);
                    mma_bf16_k8(c, r[2 * h] & live, r[2 * h + 1] & live, p_lo);
                }
            }
        }
        mbar_arrive(&s.empty[slot]);  // every thread releases its own reads of the slot
        const int next = i + kAttnSlots;
        if (threadIdx.x == 0 && next < np) issue(next, next < kListedPages ? s.page[next] : load_l2(table + next));
    }
    // Merge the warps into this split's partial; their accumulators go where the ring was.
    if (t == 0) s.m[warp][g] = m, s.l[warp][g] = l;
    __syncthreads();  // every page is read and landed: the ring and its barriers are free
    if (threadIdx.x == 0)
        for (int j = 0; j < kAttnSlots; j++) mbar_inval(&s.full[j]), mbar_inval(&s.empty[j]);
    if (threadIdx.x < kMaxGroup) {  // head h's max over the warps, each warp's weight, the sum
        const int h = threadIdx.x;
        float mx = -INFINITY, den = 0.f;
        for (int w = 0; w < kWarps; w++) mx = fmaxf(mx, s.m[w][h]);
        for (int w = 0; w < kWarps; w++) {
            const float e = s.m[w][h] == -INFINITY ? 0.f : __expf(s.m[w][h] - mx);
            s.m[w][h] = e;
            den += s.l[w][h] * e;
        }
        s.head_max[h] = mx, s.head_den[h] = den;
    }
    WarpAcc &wacc = *reinterpret_cast<WarpAcc *>(ring);
#pragma unroll
    for (int j = 0; j < kHeadDim / 16; j++) {
        wacc[warp][2 * t][16 * j + g] = acc[j][0], wacc[warp][2 * t + 1][16 * j + g] = acc[j][1];
        wacc[warp][2 * t][16 * j + g + 8] = acc[j][2], wacc[warp][2 * t + 1][16 * j + g + 8] = acc[j][3];
    }
    __syncthreads();
    float *mine = part_of(p, b, kvh, split, 0);
    for (int i = threadIdx.x; i < G * kHeadDim; i += kThreads) {
        const int h = i / kHeadDim, d = i % kHeadDim;
        float num = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; w++)
            num += wacc[w][h][d] * s.m[w][h];  // a warp with no live key has zero accumulators and weight
        float *out = mine + h * kPartStride;
        out[d] = num;
        if (d == 0) out[kHeadDim] = s.head_max[h], out[kHeadDim + 1] = s.head_den[h];
    }
    // The pair's last split to finish merges them all.
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t *ticket = p.attn_ticket + b * p.num_kv_heads + kvh;
        s.last = atom_add_acq_rel(ticket, 1u) == (uint32_t)splits - 1;
        if (s.last) *ticket = 0;  // the next layer's splits of the pair start after this task's signal
    }
    __syncthreads();
    if (s.last) merge_splits(p, s, b, kvh, splits);
}

}  // namespace nmk::mk
