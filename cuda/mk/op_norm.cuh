// NMK_OP_NORM / NMK_OP_FINAL_NORM, tile x: hidden columns [x * norm_cols, ...) of every row.
// Closes the previous layer's parallel residual (x += o + sum_k w_k * expert_k, or the
// embedding at layer 0) and records the slice's sum of squares; the tasks that read the
// normed input apply the RMSNorm themselves (stage_normed). Roundings follow the bf16
// reference step by step: (x + o) then + mlp; the experts' weighted outputs summed in
// ascending expert id (the routing lists each row's picks that way).
#pragma once

#include "common.cuh"

namespace nmk::mk {

__device__ __forceinline__ float *debug_at(const Params &p, int layer, int stage, int b) {
    return p.debug + (((size_t)layer * NMK_MK_DEBUG_STAGES + stage) * NMK_MK_MAX_BATCH + b) * p.hidden;
}

// Thread t takes column t % 32 of the tile in row t / 32 (the 8 rows' loads in flight at once:
// loads first, then the sums); each row's sum of squares is one warp's.
template <int B>
__device__ void run_norm(const Params &p, int layer, bool final, int tile, char *smem) {
    constexpr int kCols = 32, kRowsPerPass = kThreads / kCols, kPasses = (B + kRowsPerPass - 1) / kRowsPerPass;
    static_assert(kThreads % kCols == 0 && kCols % 32 == 0, "NORM tiles are 32 columns (the checker's norm_cols)");
    static_assert(kMaxK / kCols <= kMaxNormTiles, "the widest hidden size's tiles fit in ss");
    const int prev = final ? p.num_layers - 1 : layer - 1, at = prev + 1;
    const int col = threadIdx.x % kCols, c = tile * kCols + col, r0 = threadIdx.x / kCols;
    const bool dense = prev >= 0 && p.layers[prev].dense;
    const int K = dense ? 1 : p.top_k;
    float *ss = reinterpret_cast<float *>(smem);  // [B][kCols / 32]
    constexpr int kGroup = 2;  // passes whose loads are in flight together
#pragma unroll
    for (int k0 = 0; k0 < kPasses; k0 += kGroup) {
        float x[kGroup] = {}, attn[kGroup] = {}, e[kGroup][kMaxTopK] = {};
#pragma unroll
        for (int k = 0; k < kGroup; k++) {
            const int b = r0 + (k0 + k) * kRowsPerPass;
            if (k0 + k >= kPasses || b >= B) continue;
            if (prev < 0) {
                x[k] = __bfloat162float(p.embed[tiled_index(p.tokens[b], c, p.hidden)]);
                continue;
            }
            x[k] = load_l2(p.x + (size_t)b * p.hidden + c);
            attn[k] = load_l2(p.o + (size_t)b * p.hidden + c);
            const float *m = p.mlp + (size_t)b * p.top_k * p.hidden + c;
#pragma unroll
            for (int j = 0; j < kMaxTopK; j++)
                if (j < K) e[k][j] = load_l2(m + j * p.hidden);
        }
#pragma unroll
        for (int k = 0; k < kGroup; k++) {
            const int b = r0 + (k0 + k) * kRowsPerPass;
            if (k0 + k >= kPasses || b >= B) continue;  // the same for the whole warp
            float v = x[k], mlp = 0.f, a = 0.f;
            if (prev >= 0) {
                // x + o, then + the experts' weighted outputs (DOWN weighs them) summed in
                // ascending expert id (the routing lists each row's picks that way); dense: the
                // MLP's output.
#pragma unroll
                for (int j = 0; j < kMaxTopK; j++)
                    if (j < K) mlp = dense ? e[k][0] : round_bf16(mlp + e[k][j]);
                a = attn[k];
                v = round_bf16(round_bf16(v + a) + mlp);
            }
            if (p.debug) {
                debug_at(p, at, NMK_MK_DEBUG_X, b)[c] = v;
                debug_at(p, at, NMK_MK_DEBUG_ATTN, b)[c] = a;
                debug_at(p, at, NMK_MK_DEBUG_MLP, b)[c] = mlp;
            }
            p.x[(size_t)b * p.hidden + c] = v;
            const float sq = warp_sum(v * v);
            if ((threadIdx.x & 31) == 0) ss[b * (kCols / 32) + col / 32] = sq;
        }
    }
    __syncthreads();
    if (threadIdx.x < B) {
        float sum = 0.f;
        for (int j = 0; j < kCols / 32; j++) sum += ss[threadIdx.x * (kCols / 32) + j];
        p.ss[threadIdx.x * kMaxNormTiles + tile] = sum;
    }
}

}  // namespace nmk::mk
