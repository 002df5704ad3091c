// NMK_OP_QKV: a tile of rows of qkv @ h; interleaved RoPE on q and k where the layer uses
// it; q to scratch, k and v into the paged cache at each row's position.
#pragma once

#include "common.cuh"

namespace nmk::mk {

template <int B>
__device__ void run_qkv(const Params &p, int layer, int tile, char *smem, const uint32_t *counter, uint32_t target) {
    const Layer &L = p.layers[layer];
    const int H = p.hidden, Q = p.num_heads * kHeadDim, KV = p.num_kv_heads * kHeadDim;
    const int rows = p.plan.qkv_rows, r0 = tile * rows, n = min(rows, Q + 2 * KV - r0);
    GemvSmem s(smem, H, rows);
    // Each row's page for its k and v, looked up while the GEMV streams (its barrier publishes them).
    int *page = reinterpret_cast<int *>(s.extra);
    if (r0 + n > Q && threadIdx.x < B) page[threadIdx.x] = kv_page(p, L.group, threadIdx.x, p.positions[threadIdx.x]);
    const bf16 *W = L.qkv + (size_t)r0 * H;
    gemv_normed<B>(smem, p, L.norm, layer, [&](int r) { return W + (size_t)r * H; }, n, s.in, H, s.out, s.red, counter,
                   target);
    const PostRms<B> rms(smem, p);
    // One thread per (row b, pair of adjacent outputs); r0 and rows are even.
#pragma unroll 1
    for (int i = threadIdx.x; i < B * n / 2; i += kThreads) {
        int b = i / (n / 2), r = r0 + 2 * (i % (n / 2));
        float v0 = round_bf16(s.out[(r - r0) * 8 + b] * rms(b)), v1 = round_bf16(s.out[(r - r0 + 1) * 8 + b] * rms(b));
        int pos = p.positions[b];
        if (L.rope && r < Q + KV) {
            int d = r % kHeadDim;  // even: the pair (d, d + 1)
            float freq = 1.f / powf(p.rope_theta, (float)d / kHeadDim);  // as the reference's inv_freq
            float sn, cs;
            sincosf(pos * freq, &sn, &cs);
            float a = v0 * cs - v1 * sn, e = v1 * cs + v0 * sn;
            v0 = round_bf16(a), v1 = round_bf16(e);
        }
        if (r < Q) {
            p.q[(size_t)b * Q + r] = v0;
            p.q[(size_t)b * Q + r + 1] = v1;
            continue;
        }
        int kv = r >= Q + KV, c = r - Q - kv * KV, head = c / kHeadDim, d = c % kHeadDim;
        bf16 *dst = L.kv + page[b] * L.page_stride +
                    ((size_t)(kv * p.num_kv_heads + head) * kPage + pos % kPage) * kHeadDim + d;
        *reinterpret_cast<uint32_t *>(dst) = pack_bf16(v0, v1);
    }
}

}  // namespace nmk::mk
