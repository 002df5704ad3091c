// NMK_OP_NORM, tile x (layer 0 only): hidden columns [x * norm_cols, ...) of every row's token
// embedding, as the residual entering layer 0 (resid_of(0)); it also zeroes the same columns of
// layer 1's sums, which layer 0's o-proj and DOWN tiles add into. No task closes the residual
// after that: every layer's o-proj and DOWN tiles add their outputs into the next layer's sums
// (Params::resid), and the tasks that read a layer's normed input round those sums, and
// normalize them, themselves (stage_normed).
#pragma once

#include "common.cuh"

namespace nmk::mk {

__device__ __forceinline__ float *debug_at(const Params &p, int layer, int stage, int b) {
    return p.debug + (((size_t)layer * NMK_MK_DEBUG_STAGES + stage) * NMK_MK_MAX_BATCH + b) * p.hidden;
}

// Thread t takes column t % 32 of the tile in rows t / 32, t / 32 + 8, ...
template <int B>
__device__ void run_norm(const Params &p, int tile, char *) {
    constexpr int kCols = 32;
    static_assert(kThreads % kCols == 0, "NORM tiles are 32 columns (the checker's norm_cols)");
    const int c = tile * kCols + threadIdx.x % kCols;
    float *x = resid_of(p, 0), *next = resid_of(p, 1);
#pragma unroll 1
    for (int b = threadIdx.x / kCols; b < B; b += kThreads / kCols) {
        const float v = __bfloat162float(p.embed[tiled_index(p.tokens[b], c, p.hidden)]);
        x[(size_t)b * p.hidden + c] = v;
        next[(size_t)b * p.hidden + c] = 0.f;
        if (p.debug) debug_at(p, 0, NMK_MK_DEBUG_X, b)[c] = v;
    }
}

}  // namespace nmk::mk
