// NMK_OP_OPROJ: a tile of rows of o @ attn_out, the attention half of the residual, added with
// the layer's input x into the next layer's sums (Params::resid).
#pragma once

#include "op_norm.cuh"

namespace nmk::mk {

template <int B>
__device__ void run_oproj(const Params &p, int layer, int tile, char *smem) {
    const int Q = p.num_heads * kHeadDim, rows = p.plan.oproj_rows;
    const int r0 = tile * rows, n = min(rows, p.hidden - r0);
    GemvSmem s(smem, Q, rows);
    const int H = p.hidden;
    const float *x = resid_of(p, layer);
    float *next = resid_of(p, layer + 1), *later = resid_of(p, layer + 2);
    // The thread's first (row, batch row) pair's x, loaded while the GEMV streams.
    const float x0 = threadIdx.x < n * B ? load_l2(x + (size_t)(threadIdx.x % B) * H + r0 + threadIdx.x / B) : 0.f;
    const ImageCopy copy = stage_image(smem, s.in, p.attn, in_bytes(Q));
    const bf16 *W = p.layers[layer].o + (size_t)r0 * Q;
    using Dot = TileDotT<true, NoStaging, tail_burst<B>(16)>;  // a warp's share in one burst
    gemv([&](int r) { return W + (size_t)r * Q; }, n, s.in, Q, s.out, s.red, Dot{copy.full, copy.parity});
    stage_image_end(smem, copy);
    // x + attn, rounded as the reference rounds it, into the next layer's sums (the DOWN tiles add
    // the mlp half); the layer after next's sums, read last by the layer before this one, zeroed
    // for the next layer's adds (this task's signal orders both before them).
#pragma unroll 1
    for (int i = threadIdx.x; i < n * B; i += kThreads) {
        const int b = i % B, r = r0 + i / B;
        const float xv = round_bf16(i == threadIdx.x ? x0 : load_l2(x + (size_t)b * H + r));
        const float a = round_bf16(s.out[(i / B) * 8 + b]);
        atomicAdd(next + (size_t)b * H + r, round_bf16(xv + a));
        later[(size_t)b * H + r] = 0.f;
        if (p.debug) {
            debug_at(p, layer, NMK_MK_DEBUG_X, b)[r] = xv;
            debug_at(p, layer + 1, NMK_MK_DEBUG_ATTN, b)[r] = a;
        }
    }
}

}  // namespace nmk::mk
