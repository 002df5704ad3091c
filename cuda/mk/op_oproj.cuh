// NMK_OP_OPROJ: a tile of rows of o @ attn_out, the attention half of the residual.
#pragma once

#include "common.cuh"

namespace nmk::mk {

template <int B>
__device__ void run_oproj(const Params &p, int layer, int tile, char *smem) {
    const int Q = p.num_heads * kHeadDim, rows = p.plan.oproj_rows;
    const int r0 = tile * rows, n = min(rows, p.hidden - r0);
    GemvSmem s(smem, Q, rows);
    const ImageCopy copy = stage_image(smem, s.in, p.attn, in_bytes(Q));
    const bf16 *W = p.layers[layer].o + (size_t)r0 * Q;
    gemv([&](int r) { return W + (size_t)r * Q; }, n, s.in, Q, s.out, s.red, TileDot{copy.full, copy.parity});
    stage_image_end(smem, copy);
#pragma unroll 1
    for (int i = threadIdx.x; i < n * B; i += kThreads)
        p.o[(size_t)(i % B) * p.hidden + r0 + i / B] = round_bf16(s.out[(i / B) * 8 + i % B]);
}

}  // namespace nmk::mk
