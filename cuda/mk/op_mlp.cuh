// NMK_OP_GATE_UP and NMK_OP_DOWN: SwiGLU of one mlp slot, down(silu(gate(h)) * up(h)).
// A slot is one distinct routed expert (sparse layers) or the dense MLP (slot 0).
#pragma once

#include "common.cuh"

namespace nmk::mk {

struct SlotWeights {
    const bf16 *gate_up, *down;  // [2 inter, H] gate rows first; [H, inter]
    int inter;
};

// Weights of slot y this step; gate_up is null when no row routed to the slot.
__device__ __forceinline__ SlotWeights slot_weights(const Params &p, const Layer &L, int y) {
    if (L.dense) return {L.gate_up, L.down, p.dense_inter};
    int e = load_l2(p.slot_expert + y);
    if (e < 0) return {nullptr, nullptr, p.moe_inter};
    size_t per = (size_t)2 * p.moe_inter * p.hidden;
    return {L.experts_gate_up + e * per, L.experts_down + e * per / 2, p.moe_inter};
}

__device__ __forceinline__ int act_stride(const Params &p) { return max(p.moe_inter, p.dense_inter); }

template <int B>
__device__ void run_gate_up(const Params &p, int layer, int tile, int y, char *smem) {
    const Layer &L = p.layers[layer];
    SlotWeights w = slot_weights(p, L, y);
    if (!w.gate_up) return;
    const int H = p.hidden, cols = L.dense ? p.plan.dense_cols : p.plan.moe_cols;
    const int c0 = tile * cols, n = min(cols, w.inter - c0);
    bf16 *in = reinterpret_cast<bf16 *>(smem);
    stage_bf16(in, p.h, B, H, H);
    __syncthreads();
    bf16 *act = p.act + (size_t)y * NMK_MK_MAX_BATCH * act_stride(p);
    for (int c = threadIdx.x >> 5; c < n; c += kWarps) {
        const bf16 *rows[2] = {w.gate_up + (size_t)(c0 + c) * H, w.gate_up + (size_t)(w.inter + c0 + c) * H};
        float gu[2][B];  // gate, up
        rows_dot<B, 2>(rows, in, H, gu);
        if ((threadIdx.x & 31) == 0)
            for (int b = 0; b < B; b++) {
                float gb = round_bf16(gu[0][b]);
                float silu = round_bf16(gb / (1.f + expf(-gb)));
                act[b * act_stride(p) + c0 + c] = __float2bfloat16(silu * round_bf16(gu[1][b]));
            }
    }
}

template <int B>
__device__ void run_down(const Params &p, int layer, int tile, int y, char *smem) {
    const Layer &L = p.layers[layer];
    SlotWeights w = slot_weights(p, L, y);
    if (!w.down) return;
    const int rows = L.dense ? p.plan.dense_down_rows : p.plan.moe_down_rows;
    const int r0 = tile * rows, n = min(rows, p.hidden - r0);
    bf16 *in = reinterpret_cast<bf16 *>(smem);
    int *ks = reinterpret_cast<int *>(smem + B * w.inter * sizeof(bf16));
    stage_bf16(in, p.act + (size_t)y * NMK_MK_MAX_BATCH * act_stride(p), B, w.inter, act_stride(p));
    if (threadIdx.x < B) ks[threadIdx.x] = L.dense ? 0 : load_l2(p.slot_k + y * B + threadIdx.x);
    __syncthreads();
    gemv_rows<B>(w.down + (size_t)r0 * w.inter, w.inter, n, in, w.inter, [&](int r, const float *acc) {
        if ((threadIdx.x & 31) == 0)
            for (int b = 0; b < B; b++)
                if (ks[b] >= 0) p.mlp[((size_t)b * p.top_k + ks[b]) * p.hidden + r0 + r] = round_bf16(acc[b]);
    });
}

}  // namespace nmk::mk
