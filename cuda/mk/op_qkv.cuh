// NMK_OP_QKV: a tile of rows of qkv @ h; interleaved RoPE on q and k where the layer uses
// it; q to scratch, k and v into the paged cache at each row's position.
#pragma once

#include "common.cuh"

namespace nmk::mk {

template <int B>
__device__ void run_qkv(const Params &p, int layer, int tile, char *smem) {
    const Layer &L = p.layers[layer];
    const int H = p.hidden, Q = p.num_heads * kHeadDim, KV = p.num_kv_heads * kHeadDim;
    const int rows = p.plan.qkv_rows, r0 = tile * rows, n = min(rows, Q + 2 * KV - r0);
    bf16 *in = reinterpret_cast<bf16 *>(smem);
    float *out = reinterpret_cast<float *>(smem + B * H * sizeof(bf16));  // [B][rows]
    stage_bf16(in, p.h, B, H, H);
    __syncthreads();
    gemv_rows<B>(L.qkv + (size_t)r0 * H, H, n, in, H, [&](int r, const float *acc) {
        if ((threadIdx.x & 31) == 0)
            for (int b = 0; b < B; b++) out[b * rows + r] = round_bf16(acc[b]);
    });
    __syncthreads();
    // One thread per (row b, pair of adjacent outputs); r0 and rows are even.
    for (int i = threadIdx.x; i < B * n / 2; i += kThreads) {
        int b = i / (n / 2), r = r0 + 2 * (i % (n / 2));
        float v0 = out[b * rows + r - r0], v1 = out[b * rows + r - r0 + 1];
        int pos = p.positions[b];
        if (L.rope && r < Q + KV) {
            int d = r % kHeadDim;  // even: the pair (d, d + 1)
            float freq = 1.f / powf(p.rope_theta, (float)d / kHeadDim);  // as the reference's inv_freq
            float s, c;
            sincosf(pos * freq, &s, &c);
            float a = v0 * c - v1 * s, e = v1 * c + v0 * s;
            v0 = round_bf16(a), v1 = round_bf16(e);
        }
        if (r < Q) {
            p.q[(size_t)b * Q + r] = v0;
            p.q[(size_t)b * Q + r + 1] = v1;
            continue;
        }
        int kv = r >= Q + KV, c = r - Q - kv * KV, head = c / kHeadDim, d = c % kHeadDim;
        bf16 *dst = L.kv + kv_page(p, L.group, b, pos) * L.page_stride +
                    ((size_t)(kv * p.num_kv_heads + head) * kPage + pos % kPage) * kHeadDim + d;
        dst[0] = __float2bfloat16(v0);
        dst[1] = __float2bfloat16(v1);
    }
}

}  // namespace nmk::mk
