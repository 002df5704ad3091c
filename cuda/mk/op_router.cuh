// NMK_OP_ROUTER: router logits (bf16, as the reference rounds them), top-k by raw logit,
// weight = sigmoid(logit) with no renormalization, picks in ascending expert id; then one
// mlp slot per distinct expert.
#pragma once

#include "common.cuh"

namespace nmk::mk {

// Orders one row's picks by ascending expert id, the order the reference sums experts in.
__device__ __forceinline__ void sort_picks(int *ids, float *logits, int K) {
    for (int i = 1; i < K; i++)
        for (int j = i; j > 0 && ids[j - 1] > ids[j]; j--) {
            int t = ids[j];
            ids[j] = ids[j - 1], ids[j - 1] = t;
            float v = logits[j];
            logits[j] = logits[j - 1], logits[j - 1] = v;
        }
}

template <int B>
__device__ void run_router(const Params &p, int layer, char *smem) {
    const int H = p.hidden, E = p.num_experts, K = p.top_k;
    bf16 *in = reinterpret_cast<bf16 *>(smem);
    float *logits = reinterpret_cast<float *>(smem + B * H * sizeof(bf16));  // [B][E]
    int *picked = reinterpret_cast<int *>(logits + B * E);                  // [B][K] expert ids
    float *weights = reinterpret_cast<float *>(picked + B * K);             // [B][K] their logits
    stage_bf16(in, p.h, B, H, H);
    __syncthreads();
    gemv_rows<B>(p.layers[layer].router, H, E, in, H, [&](int e, const float *acc) {
        if ((threadIdx.x & 31) == 0)
            for (int b = 0; b < B; b++) logits[b * E + e] = round_bf16(acc[b]);
    });
    __syncthreads();
    // Warp b picks row b's top-k: k rounds of a warp argmax (ties: lower expert id).
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < B) {
        float *row = logits + warp * E;
        int *ids = picked + warp * K;
        for (int k = 0; k < K; k++) {
            float best = -INFINITY;
            int arg = E;
            for (int e = lane; e < E; e += 32)
                if (row[e] > best || (row[e] == best && e < arg)) best = row[e], arg = e;
            for (int o = 16; o; o >>= 1) {
                float ob = __shfl_xor_sync(0xffffffffu, best, o);
                int oa = __shfl_xor_sync(0xffffffffu, arg, o);
                if (ob > best || (ob == best && oa < arg)) best = ob, arg = oa;
            }
            if (lane == 0) ids[k] = arg, weights[warp * K + k] = best;
            __syncwarp();
            if (lane == 0) row[arg] = -INFINITY;
            __syncwarp();
        }
        if (lane == 0) sort_picks(ids, weights + warp * K, K);
        __syncwarp();
        for (int k = lane; k < K; k += 32) {
            p.topk_weight[warp * K + k] = round_bf16(1.f / (1.f + expf(-weights[warp * K + k])));
            if (p.debug_experts) p.debug_experts[((size_t)layer * NMK_MK_MAX_BATCH + warp) * K + k] = ids[k];
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int slots = 0;
        for (int e = 0; e < E; e++) {
            int ks[NMK_MK_MAX_BATCH], used = 0;
            for (int b = 0; b < B; b++) {
                ks[b] = -1;
                for (int k = 0; k < K; k++)
                    if (picked[b * K + k] == e) ks[b] = k, used = 1;
            }
            if (!used) continue;
            p.slot_expert[slots] = e;
            for (int b = 0; b < B; b++) p.slot_k[slots * B + b] = ks[b];
            slots++;
        }
        for (; slots < p.plan.expert_slots; slots++) p.slot_expert[slots] = -1;
    }
}

}  // namespace nmk::mk
