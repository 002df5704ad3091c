// NMK_OP_LM_HEAD: a tile of vocab rows of the tied head, logits = (h @ embed.T) * scale,
// with the tile's best logit per row; NMK_OP_ARGMAX reduces those into the greedy token.
#pragma once

#include "common.cuh"

namespace nmk::mk {

// (value, index) order of the argmax: larger value, then smaller index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

template <int B>
__device__ void run_lm_head(const Params &p, int tile, char *smem) {
    const int H = p.hidden, rows = p.plan.lm_rows, r0 = tile * rows, n = min(rows, p.vocab - r0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    bf16 *in = reinterpret_cast<bf16 *>(smem);
    float *best = reinterpret_cast<float *>(smem + B * H * sizeof(bf16));  // [warps][B]
    int *best_i = reinterpret_cast<int *>(best + kWarps * B);
    stage_bf16(in, p.h, B, H, H);
    __syncthreads();
    float bv[B];
    int bi[B];
#pragma unroll
    for (int b = 0; b < B; b++) bv[b] = -INFINITY, bi[b] = p.vocab;
    gemv_rows<B>(p.embed + (size_t)r0 * H, H, n, in, H, [&](int r, const float *acc) {
#pragma unroll
        for (int b = 0; b < B; b++) {
            float logit = round_bf16(acc[b]) * p.logit_scale;
            if (lane == 0) p.logits[(size_t)b * p.vocab + r0 + r] = logit;
            if (better(logit, r0 + r, bv[b], bi[b])) bv[b] = logit, bi[b] = r0 + r;
        }
    });
    if (lane == 0)
        for (int b = 0; b < B; b++) best[warp * B + b] = bv[b], best_i[warp * B + b] = bi[b];
    __syncthreads();
    if (threadIdx.x < B) {
        int b = threadIdx.x;
        float v = -INFINITY;
        int i = p.vocab;
        for (int w = 0; w < kWarps; w++)
            if (better(best[w * B + b], best_i[w * B + b], v, i)) v = best[w * B + b], i = best_i[w * B + b];
        p.lm_best[b * p.plan.lm_tiles + tile] = v;
        p.lm_best_index[b * p.plan.lm_tiles + tile] = i;
    }
}

__device__ void run_argmax(const Params &p, int b, char *smem) {
    float *vals = reinterpret_cast<float *>(smem);
    int *idx = reinterpret_cast<int *>(vals + kThreads);
    float v = -INFINITY;
    int i = p.vocab;
    for (int t = threadIdx.x; t < p.plan.lm_tiles; t += kThreads) {
        float tv = load_l2(p.lm_best + b * p.plan.lm_tiles + t);
        int ti = load_l2(p.lm_best_index + b * p.plan.lm_tiles + t);
        if (better(tv, ti, v, i)) v = tv, i = ti;
    }
    vals[threadIdx.x] = v, idx[threadIdx.x] = i;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int t = 1; t < kThreads; t++)
            if (better(vals[t], idx[t], v, i)) v = vals[t], i = idx[t];
        p.next_tokens[b] = i;
    }
}

}  // namespace nmk::mk
