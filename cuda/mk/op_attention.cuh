// NMK_OP_ATTN: one split of one (row, kv head): the row's live keys are cut into `splits`
// page ranges at run time; each warp walks keys with an online softmax for the group's
// query heads, then the warps merge. NMK_OP_COMBINE merges the splits into attn_out.
#pragma once

#include "common.cuh"

namespace nmk::mk {

constexpr int kDimsPerLane = kHeadDim / 32;
constexpr int kPartStride = kHeadDim + 2;  // acc[head_dim], max, sum

__device__ __forceinline__ float *part_of(const Params &p, int b, int kvh, int split, int g) {
    int group = p.num_heads / p.num_kv_heads;
    return p.part + ((((size_t)b * p.num_kv_heads + kvh) * NMK_MK_MAX_SPLITS + split) * group + g) * kPartStride;
}

__device__ void run_attention(const Params &p, int layer, int b, int kvh, int split, int splits, char *smem) {
    const Layer &L = p.layers[layer];
    const int G = p.num_heads / p.num_kv_heads, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int pos = p.positions[b];
    const int lo = L.sliding ? max(0, pos - p.sliding_window + 1) : 0;
    const int first_page = lo / kPage, pages = pos / kPage - first_page + 1;
    const int key0 = max(lo, (first_page + split * pages / splits) * kPage);
    const int key1 = min(pos + 1, (first_page + (split + 1) * pages / splits) * kPage);
    const float scale = rsqrtf((float)kHeadDim);

    float q[kMaxGroup][kDimsPerLane], acc[kMaxGroup][kDimsPerLane], m[kMaxGroup], l[kMaxGroup];
#pragma unroll
    for (int g = 0; g < kMaxGroup; g++) {
        m[g] = -INFINITY, l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < kDimsPerLane; j++) {
            acc[g][j] = 0.f;
            q[g][j] = g < G ? load_l2(p.q + (size_t)b * p.num_heads * kHeadDim + (kvh * G + g) * kHeadDim +
                                      lane * kDimsPerLane + j) * scale
                            : 0.f;
        }
    }
    for (int key = key0 + warp; key < key1; key += kWarps) {
        const bf16 *base = L.kv + kv_page(p, L.group, b, key) * L.page_stride +
                           ((size_t)kvh * kPage + key % kPage) * kHeadDim + lane * kDimsPerLane;
        const bf16 *vbase = base + (size_t)p.num_kv_heads * kPage * kHeadDim;
        uint2 kr = __ldcg(reinterpret_cast<const uint2 *>(base)), vr = __ldcg(reinterpret_cast<const uint2 *>(vbase));
        float k[4], v[4];
        const __nv_bfloat162 *k2 = reinterpret_cast<const __nv_bfloat162 *>(&kr), *v2 = reinterpret_cast<const __nv_bfloat162 *>(&vr);
        float2 a = __bfloat1622float2(k2[0]), c = __bfloat1622float2(k2[1]);
        k[0] = a.x, k[1] = a.y, k[2] = c.x, k[3] = c.y;
        a = __bfloat1622float2(v2[0]), c = __bfloat1622float2(v2[1]);
        v[0] = a.x, v[1] = a.y, v[2] = c.x, v[3] = c.y;
#pragma unroll
        for (int g = 0; g < kMaxGroup; g++) {
            if (g >= G) break;
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < kDimsPerLane; j++) s = fmaf(q[g][j], k[j], s);
            s = warp_sum(s);
            float m_new = fmaxf(m[g], s), corr = __expf(m[g] - m_new), e = __expf(s - m_new);
            l[g] = l[g] * corr + e;
#pragma unroll
            for (int j = 0; j < kDimsPerLane; j++) acc[g][j] = fmaf(acc[g][j], corr, e * v[j]);
            m[g] = m_new;
        }
    }
    // Merge the warps: each writes its state, then thread t owns (head g, dim d) pairs.
    float *st = reinterpret_cast<float *>(smem);  // [warps][group][kPartStride]
#pragma unroll
    for (int g = 0; g < kMaxGroup; g++) {
        if (g >= G) break;
        float *s = st + (warp * G + g) * kPartStride;
#pragma unroll
        for (int j = 0; j < kDimsPerLane; j++) s[lane * kDimsPerLane + j] = acc[g][j];
        if (lane == 0) s[kHeadDim] = m[g], s[kHeadDim + 1] = l[g];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * (kHeadDim + 2); i += kThreads) {
        int g = i / (kHeadDim + 2), d = i % (kHeadDim + 2);
        float mx = -INFINITY;
        for (int w = 0; w < kWarps; w++) mx = fmaxf(mx, st[(w * G + g) * kPartStride + kHeadDim]);
        float out = d == kHeadDim ? mx : 0.f;
        if (d != kHeadDim)
            for (int w = 0; w < kWarps; w++) {
                const float *s = st + (w * G + g) * kPartStride;
                if (s[kHeadDim] != -INFINITY) out += s[d] * __expf(s[kHeadDim] - mx);
            }
        part_of(p, b, kvh, split, g)[d] = out;
    }
}

__device__ void run_combine(const Params &p, int layer, int b, int kvh, int splits) {
    (void)layer;
    const int G = p.num_heads / p.num_kv_heads;
    for (int i = threadIdx.x; i < G * kHeadDim; i += kThreads) {
        int g = i / kHeadDim, d = i % kHeadDim;
        float mx = -INFINITY;
        for (int s = 0; s < splits; s++) mx = fmaxf(mx, load_l2(part_of(p, b, kvh, s, g) + kHeadDim));
        float num = 0.f, den = 0.f;
        for (int s = 0; s < splits; s++) {
            const float *ps = part_of(p, b, kvh, s, g);
            float ms = load_l2(ps + kHeadDim);
            if (ms == -INFINITY) continue;
            float w = __expf(ms - mx);
            num += load_l2(ps + d) * w;
            den += load_l2(ps + kHeadDim + 1) * w;
        }
        p.attn[(size_t)b * p.num_heads * kHeadDim + (kvh * G + g) * kHeadDim + d] = __float2bfloat16(num / den);
    }
}

}  // namespace nmk::mk
