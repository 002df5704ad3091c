// NMK_OP_GATE_UP and NMK_OP_DOWN: SwiGLU of one mlp slot, down(silu(gate(h)) * up(h)).
// A slot is one distinct routed expert (sparse layers) or the dense MLP (slot 0).
#pragma once

#include "op_router.cuh"

namespace nmk::mk {

struct SlotWeights {
    const bf16 *gate_up, *down;  // [2 inter, H] gate rows first; [H, inter]
    int inter;
};

__device__ __forceinline__ SlotWeights expert_weights(const Params &p, const Layer &L, int e) {
    if (e < 0) return {nullptr, nullptr, p.moe_inter};
    const size_t per = (size_t)2 * p.moe_inter * p.hidden;
    return {L.experts_gate_up + e * per, L.experts_down + e * per / 2, p.moe_inter};
}

// Slot y's activations, as DOWN's GEMV input image (in_offset): GATE_UP writes them there and
// DOWN stages them by one bulk copy.
__device__ __forceinline__ char *act_image(const Params &p, int y) {
    return reinterpret_cast<char *>(p.act) + (size_t)y * in_bytes(max(p.moe_inter, p.dense_inter));
}

// Sparse layers: the task takes the layer's routing (route(), computed once per CTA); task
// x = 0 of slot y publishes the slot's expert and rows for DOWN, and task (0, 0) the rows'
// weights for the next NORM.
template <int B>
__device__ void run_gate_up(const Params &p, int layer, int tile, int y, char *smem) {
    const Layer &L = p.layers[layer];
    const int H = p.hidden, cols = L.dense ? p.plan.dense_cols : p.plan.moe_cols;
    GemvSmem s(smem, H, 2 * cols);
    SlotWeights w{L.gate_up, L.down, p.dense_inter};
    if (!L.dense) {
        const Routing &r = route<B>(p, layer, smem);
        const int e = y < r.slots ? r.slot_expert[y] : -1;
        if (tile == 0 && threadIdx.x < B) {
            const int b = threadIdx.x;
            if (threadIdx.x == 0) p.slot_expert[y] = e;
            p.slot_k[y * B + b] = e < 0 ? -1 : r.k_of[b][e];
        }
        if (tile == 0 && y == 0)  // every (row, expert) pair by its own thread
#pragma unroll 1
            for (int i = threadIdx.x; i < B * p.num_experts; i += kThreads) {
                const int b = i / p.num_experts, f = i % p.num_experts, k = r.k_of[b][f];
                if (k < 0) continue;
                p.topk_weight[b * p.top_k + k] = round_bf16(1.f / (1.f + expf(-r.logit[b][f])));
                if (p.debug_experts) p.debug_experts[((size_t)layer * NMK_MK_MAX_BATCH + b) * p.top_k + k] = f;
            }
        w = expert_weights(p, L, e);
        if (!w.gate_up) return;
    }
    const int c0 = tile * cols, n = min(cols, w.inter - c0);  // a multiple of 16
    stage_normed<B>(smem, p, L.norm, layer);
    const bf16 *gate = w.gate_up + (size_t)c0 * H, *up = w.gate_up + (size_t)(w.inter + c0) * H;
    gemv([&](int r) { return r < n ? gate + (size_t)r * H : up + (size_t)(r - n) * H; }, 2 * n, s.in, H, s.out, s.red);
    char *act = act_image(p, y);
#pragma unroll 1
    for (int i = threadIdx.x; i < n * B; i += kThreads) {
        const int c = i / B, b = i % B;
        const float g = round_bf16(s.out[c * 8 + b]), silu = round_bf16(g / (1.f + expf(-g)));
        *reinterpret_cast<bf16 *>(act + in_offset(b, c0 + c)) =
            __float2bfloat16(silu * round_bf16(s.out[(n + c) * 8 + b]));
    }
}

template <int B>
__device__ void run_down(const Params &p, int layer, int tile, int y, char *smem) {
    const Layer &L = p.layers[layer];
    const SlotWeights w = L.dense ? SlotWeights{L.gate_up, L.down, p.dense_inter}
                                  : expert_weights(p, L, load_l2(p.slot_expert + y));
    if (!w.down) return;
    const int rows = L.dense ? p.plan.dense_down_rows : p.plan.moe_down_rows;
    const int r0 = tile * rows, n = min(rows, p.hidden - r0);
    GemvSmem s(smem, w.inter, rows);
    int *ks = reinterpret_cast<int *>(s.extra);
    if (threadIdx.x < B) ks[threadIdx.x] = L.dense ? 0 : load_l2(p.slot_k + y * B + threadIdx.x);
    const ImageCopy copy = stage_image(smem, s.in, reinterpret_cast<const bf16 *>(act_image(p, y)), in_bytes(w.inter));
    const bf16 *W = w.down + (size_t)r0 * w.inter;
    gemv([&](int r) { return W + (size_t)r * w.inter; }, n, s.in, w.inter, s.out, s.red,
         TileDot{copy.full, copy.parity});  // its closing barrier publishes ks too
    stage_image_end(smem, copy);
#pragma unroll 1
    for (int i = threadIdx.x; i < n * B; i += kThreads) {
        const int r = i / B, b = i % B;
        if (ks[b] >= 0) p.mlp[((size_t)b * p.top_k + ks[b]) * p.hidden + r0 + r] = round_bf16(s.out[r * 8 + b]);
    }
}

}  // namespace nmk::mk
