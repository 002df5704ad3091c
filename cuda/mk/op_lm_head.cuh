// NMK_OP_LM_HEAD: a tile of vocab rows of the tied head, logits = (h @ embed.T) * scale,
// with the tile's best logit per row; NMK_OP_ARGMAX reduces those into the greedy token.
#pragma once

#include "op_norm.cuh"

namespace nmk::mk {

template <int B>
__device__ void run_lm_head(const Params &p, int tile, char *smem) {
    const int H = p.hidden, rows = p.plan.lm_rows, r0 = tile * rows, n = min(rows, p.vocab - r0);
    GemvSmem s(smem, H, rows);
    float *best = reinterpret_cast<float *>(s.extra + 64);  // [threads]: each thread's best of its row
    int *best_i = reinterpret_cast<int *>(best + kThreads);
    stage_normed<B>(smem, p, p.final_norm, p.num_layers);
    const bf16 *W = p.embed + (size_t)r0 * H;
    gemv([&](int r) { return W + (size_t)r * H; }, n, s.in, H, s.out, s.red);
    // Thread i < stride takes (vocab row, batch row b = i % B) pairs i, i + stride, ...
    const int b = threadIdx.x % B, stride = kThreads - kThreads % B;
    float bv = -INFINITY;
    int bi = p.vocab;
#pragma unroll 1
    for (int i = threadIdx.x; threadIdx.x < stride && i < n * B; i += stride) {
        const int r = i / B;
        const float logit = round_bf16(s.out[r * 8 + b]) * p.logit_scale;
        p.logits[(size_t)b * p.vocab + r0 + r] = logit;
        if (better(logit, r0 + r, bv, bi)) bv = logit, bi = r0 + r;
    }
    best[threadIdx.x] = bv, best_i[threadIdx.x] = bi;
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < B) {  // warp b: row b's best over the threads that took it (b, b + B, ... < stride)
        float v = -INFINITY;
        int i = p.vocab;
        for (int t = warp + B * lane; t < stride; t += 32 * B)
            if (better(best[t], best_i[t], v, i)) v = best[t], i = best_i[t];
        warp_best(v, i);
        if (lane == 0) {
            p.lm_best[warp * p.plan.lm_tiles + tile] = v;
            p.lm_best_index[warp * p.plan.lm_tiles + tile] = i;
        }
    }
}

__device__ inline void run_argmax(const Params &p, int b, char *smem) {
    float *vals = reinterpret_cast<float *>(smem);
    int *idx = reinterpret_cast<int *>(vals + kThreads);
    float v = -INFINITY;
    int i = p.vocab;
    for (int t = threadIdx.x; t < p.plan.lm_tiles; t += kThreads) {
        float tv = load_l2(p.lm_best + b * p.plan.lm_tiles + t);
        int ti = load_l2(p.lm_best_index + b * p.plan.lm_tiles + t);
        if (better(tv, ti, v, i)) v = tv, i = ti;
    }
    warp_best(v, i);
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) vals[warp] = v, idx[warp] = i;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < kWarps; w++)
            if (better(vals[w], idx[w], v, i)) v = vals[w], i = idx[w];
        p.next_tokens[b] = i;
    }
    if (p.debug) {  // the residual entering the final norm
        const float *x = resid_of(p, p.num_layers) + (size_t)b * p.hidden;
        for (int c = threadIdx.x; c < p.hidden; c += kThreads)
            debug_at(p, p.num_layers, NMK_MK_DEBUG_X, b)[c] = round_bf16(load_l2(x + c));
    }
}

}  // namespace nmk::mk
