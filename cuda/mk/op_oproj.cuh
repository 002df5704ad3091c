// NMK_OP_OPROJ: a tile of rows of o @ attn_out, the attention half of the residual.
#pragma once

#include "common.cuh"

namespace nmk::mk {

template <int B>
__device__ void run_oproj(const Params &p, int layer, int tile, char *smem) {
    const int Q = p.num_heads * kHeadDim, rows = p.plan.oproj_rows;
    const int r0 = tile * rows, n = min(rows, p.hidden - r0);
    bf16 *in = reinterpret_cast<bf16 *>(smem);
    stage_bf16(in, p.attn, B, Q, Q);
    __syncthreads();
    gemv_rows<B>(p.layers[layer].o + (size_t)r0 * Q, Q, n, in, Q, [&](int r, const float *acc) {
        if ((threadIdx.x & 31) == 0)
            for (int b = 0; b < B; b++) p.o[(size_t)b * p.hidden + r0 + r] = round_bf16(acc[b]);
    });
}

}  // namespace nmk::mk
