// NMK_OP_NORM / NMK_OP_FINAL_NORM: close the previous layer's parallel residual
// (x += o + sum_k w_k * expert_k, or the embedding at layer 0) and normalize into h.
// Roundings follow the bf16 reference step by step: (x + o) then + mlp; the experts'
// weighted outputs summed in ascending expert id (the router sorts each row's picks).
#pragma once

#include "common.cuh"

namespace nmk::mk {

// Residual contribution of layer `prev`'s MLP at hidden index i of row b.
__device__ __forceinline__ float mlp_out(const Params &p, int prev, int b, int i) {
    const float *m = p.mlp + (size_t)b * p.top_k * p.hidden + i;
    if (p.layers[prev].dense) return load_l2(m);
    float sum = 0.f;
    for (int k = 0; k < p.top_k; k++)
        sum = round_bf16(sum + round_bf16(load_l2(p.topk_weight + b * p.top_k + k) * load_l2(m + k * p.hidden)));
    return sum;
}

__device__ __forceinline__ float *debug_at(const Params &p, int layer, int stage, int b) {
    return p.debug + (((size_t)layer * NMK_MK_DEBUG_STAGES + stage) * NMK_MK_MAX_BATCH + b) * p.hidden;
}

__device__ void run_norm(const Params &p, int layer, bool final, char *smem) {
    float *scratch = reinterpret_cast<float *>(smem);
    const bf16 *weight = final ? p.final_norm : p.layers[layer].norm;
    const int prev = final ? p.num_layers - 1 : layer - 1, at = prev + 1;
    for (int b = 0; b < p.plan.batch; b++) {
        float *x = p.x + (size_t)b * p.hidden;
        float ss = 0.f;
        for (int i = threadIdx.x; i < p.hidden; i += kThreads) {
            float v, attn = 0.f, mlp = 0.f;
            if (prev < 0) {
                v = __bfloat162float(p.embed[(size_t)p.tokens[b] * p.hidden + i]);
            } else {
                attn = load_l2(p.o + (size_t)b * p.hidden + i);
                mlp = mlp_out(p, prev, b, i);
                v = round_bf16(round_bf16(load_l2(x + i) + attn) + mlp);
            }
            if (p.debug) {
                debug_at(p, at, NMK_MK_DEBUG_X, b)[i] = v;
                debug_at(p, at, NMK_MK_DEBUG_ATTN, b)[i] = attn;
                debug_at(p, at, NMK_MK_DEBUG_MLP, b)[i] = mlp;
            }
            x[i] = v;
            ss += v * v;
        }
        float rms = rsqrtf(block_sum(ss, scratch) / p.hidden + p.norm_eps);
        for (int i = threadIdx.x; i < p.hidden; i += kThreads) {
            float normed = round_bf16(x[i] * rms);
            p.h[(size_t)b * p.hidden + i] = __float2bfloat16(normed * __bfloat162float(weight[i]));
        }
        __syncthreads();
    }
}

}  // namespace nmk::mk
