// NMK_OP_NORM / NMK_OP_FINAL_NORM, tile x: hidden columns [x * norm_cols, ...) of every row.
// Closes the previous layer's parallel residual (x += o + sum_k w_k * expert_k, or the
// embedding at layer 0) and records the slice's sum of squares; the tasks that read the
// normed input apply the RMSNorm themselves (stage_normed). Roundings follow the bf16
// reference step by step: (x + o) then + mlp; the experts' weighted outputs summed in
// ascending expert id (the routing lists each row's picks that way).
#pragma once

#include "common.cuh"

namespace nmk::mk {

// Residual contribution of layer `prev`'s MLP at hidden index i of row b.
__device__ __forceinline__ float mlp_out(const Params &p, int prev, int b, int i) {
    const float *m = p.mlp + (size_t)b * p.top_k * p.hidden + i;
    if (p.layers[prev].dense) return load_l2(m);
    float w[kMaxTopK], v[kMaxTopK];
#pragma unroll
    for (int k = 0; k < kMaxTopK; k++)
        if (k < p.top_k) w[k] = load_l2(p.topk_weight + b * p.top_k + k), v[k] = load_l2(m + k * p.hidden);
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxTopK; k++)
        if (k < p.top_k) sum = round_bf16(sum + round_bf16(w[k] * v[k]));
    return sum;
}

__device__ __forceinline__ float *debug_at(const Params &p, int layer, int stage, int b) {
    return p.debug + (((size_t)layer * NMK_MK_DEBUG_STAGES + stage) * NMK_MK_MAX_BATCH + b) * p.hidden;
}

__device__ void run_norm(const Params &p, int layer, bool final, int tile, char *smem) {
    const int prev = final ? p.num_layers - 1 : layer - 1, at = prev + 1;
    const int cols = p.plan.norm_cols, c0 = tile * cols, B = p.plan.batch;
    float *ss = reinterpret_cast<float *>(smem);  // [B][cols / 32]: per 32 columns, summed in order below
    // cols is a multiple of 32: the lanes of a warp share one row.
    for (int i = threadIdx.x; i < B * cols; i += kThreads) {
        const int b = i / cols, c = c0 + i % cols;
        float *x = p.x + (size_t)b * p.hidden + c;
        float v, attn = 0.f, mlp = 0.f;
        if (prev < 0) {
            v = __bfloat162float(p.embed[(size_t)p.tokens[b] * p.hidden + c]);
        } else {
            attn = load_l2(p.o + (size_t)b * p.hidden + c);
            mlp = mlp_out(p, prev, b, c);
            v = round_bf16(round_bf16(load_l2(x) + attn) + mlp);
        }
        if (p.debug) {
            debug_at(p, at, NMK_MK_DEBUG_X, b)[c] = v;
            debug_at(p, at, NMK_MK_DEBUG_ATTN, b)[c] = attn;
            debug_at(p, at, NMK_MK_DEBUG_MLP, b)[c] = mlp;
        }
        *x = v;
        const float sq = warp_sum(v * v);
        if ((threadIdx.x & 31) == 0) ss[i / 32] = sq;
    }
    __syncthreads();
    if (threadIdx.x < B) {
        float sum = 0.f;
        for (int j = 0; j < cols / 32; j++) sum += ss[threadIdx.x * (cols / 32) + j];
        p.ss[threadIdx.x * kMaxNormTiles + tile] = sum;
    }
}

}  // namespace nmk::mk
