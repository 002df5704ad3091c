// NMK_OP_GATE_UP and NMK_OP_DOWN: SwiGLU of one mlp slot, down(silu(gate(h)) * up(h)).
// A slot is one distinct routed expert (sparse layers) or the dense MLP (slot 0).
#pragma once

#include "op_norm.cuh"

namespace nmk::mk {

struct SlotWeights {
    const bf16 *gate_up, *down;  // [2 inter, H] gate rows first; [H, inter]; both tiled
    int inter;
};

__device__ __forceinline__ SlotWeights expert_weights(const Params &p, const Layer &L, int e) {
    if (e < 0) return {nullptr, nullptr, p.moe_inter};
    const size_t per = (size_t)2 * p.moe_inter * p.hidden;
    return {L.experts_gate_up + e * per, L.experts_down + e * per / 2, p.moe_inter};
}

// Slot y's expert in a sparse layer, as the layer's routing published it: the routing tile stores
// each slot's word (slot_word: its expert, the rows that picked it, layer + 1) by a
// release store, so a GATE_UP task polls the table itself instead of the routing's counter and
// then the table (one L2 round trip fewer before its weights stream); the next launch zeroes the
// words (launches take two tables in turn: vm.cuh's megakernel). The CTA's first GATE_UP or DOWN
// task of the layer loads the table into Kept; its later tasks of the layer read it there. DOWN
// runs after its slot's GATE_UP, and the next layer's routing after every DOWN of this one, so
// the table is the layer's for as long as a task of the layer reads it.
__device__ __forceinline__ int slot_expert_of(const Params &p, int layer, int y, char *smem) {
    Kept &k = kept(smem);
    if (k.slots_layer != layer) {  // every thread reads the same Kept
        if (threadIdx.x < p.plan.expert_slots) {
            const uint32_t *word = reinterpret_cast<const uint32_t *>(p.slot_expert) + threadIdx.x;
            uint32_t v;
            while (!slot_word_of(v = load_acquire(word), layer)) __nanosleep(20);
            k.slot_expert[threadIdx.x] = static_cast<int16_t>(v & 0xffffu);
            k.slot_rows[threadIdx.x] = static_cast<uint8_t>(v >> 16);
        }
        __syncthreads();
        if (threadIdx.x == 0) k.slots_layer = layer;  // every thread has read it: the barrier above
    }
    return k.slot_expert[y];
}

// Slot y's activations, as DOWN's GEMV input image (in_offset): GATE_UP writes them there and
// DOWN stages them by one bulk copy.
__device__ __forceinline__ char *act_image(const Params &p, int y) {
    return reinterpret_cast<char *>(p.act) + (size_t)y * in_bytes(max(p.moe_inter, p.dense_inter));
}

// Sparse layers: the slot's expert as the last ROUTER tile published it (none: nothing to
// do), and the normed input by one bulk copy of the router's image unless this CTA's last
// staging was the layer's; the warps' first weight burst is in flight before they wait for it.
template <int B>
__device__ void run_gate_up(const Params &p, int layer, int tile, int y, char *smem) {
    const Layer &L = p.layers[layer];
    const int H = p.hidden, cols = L.dense ? p.plan.dense_cols : p.plan.moe_cols;
    GemvSmem s(smem, H, 2 * cols);
    const SlotWeights w =
        L.dense ? SlotWeights{L.gate_up, L.down, p.dense_inter} : expert_weights(p, L, slot_expert_of(p, layer, y, smem));
    if (!w.gate_up) return;
    const int c0 = tile * cols, n = min(cols, w.inter - c0);  // a multiple of 16
    Kept &k = kept(smem);
    const bool copied = !L.dense && k.normed != layer;
    ImageCopy copy{nullptr, 0};
    if (copied) copy = stage_image(smem, s.in, p.normed_image, in_bytes(H));
    else stage_normed<B>(smem, p, L.norm, layer);  // nothing to do when the layer's input is there
    const bf16 *gate = w.gate_up + (size_t)c0 * H, *up = w.gate_up + (size_t)(w.inter + c0) * H;
    gemv([&](int r) { return r < n ? gate + (size_t)r * H : up + (size_t)(r - n) * H; }, 2 * n, s.in, H, s.out, s.red,
         TileDot{copy.full, copy.parity});
    if (copied) {
        stage_image_end(smem, copy);
        if (threadIdx.x == 0) k.normed = layer;  // every thread read it before the gemv's barrier
    }
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
                                  : expert_weights(p, L, slot_expert_of(p, layer, y, smem));
    if (!w.down) return;
    const int rows = L.dense ? p.plan.dense_down_rows : p.plan.moe_down_rows;
    const int r0 = tile * rows, n = min(rows, p.hidden - r0);
    GemvSmem s(smem, w.inter, rows);
    int *ks = reinterpret_cast<int *>(s.extra);
    float *kw = reinterpret_cast<float *>(ks + B);  // the rows' routing weights of the slot (dense: 1)
    if (threadIdx.x < B) {  // whether row b picked the slot's expert, and the pick's weight
        const int b = threadIdx.x;
        const bool picked = L.dense || (kept(smem).slot_rows[y] >> b & 1);
        float weight = L.dense ? 1.f : 0.f;
        if (!L.dense && picked) {  // the logit's word (logit_word), polled for the layer's
            const uint32_t *word = p.router_words + b * p.num_experts + kept(smem).slot_expert[y];
            uint32_t v;
            while (!logit_word_of(v = load_relaxed(word), layer)) __nanosleep(20);
            weight = round_bf16(1.f / (1.f + expf(-logit_of(v))));
        }
        ks[b] = picked ? 0 : -1, kw[b] = weight;
    }
    const ImageCopy copy = stage_image(smem, s.in, reinterpret_cast<const bf16 *>(act_image(p, y)), in_bytes(w.inter));
    const bf16 *W = w.down + (size_t)r0 * w.inter;
    using Dot = TileDotT<true, NoStaging, tail_burst<B>(12)>;  // an expert's 768 columns: two bursts
    gemv([&](int r) { return W + (size_t)r * w.inter; }, n, s.in, w.inter, s.out, s.red,
         Dot{copy.full, copy.parity});  // its closing barrier publishes ks and kw too
    stage_image_end(smem, copy);
    // Weighted as the reference weighs them, bf16(w * bf16(out)), into the next layer's sums:
    // each thread four rows of one batch row, by one vector reduction (n % 16 == 0).
    float *next = resid_of(p, layer + 1);
#pragma unroll 1
    for (int i = threadIdx.x; i < n / 4 * B; i += kThreads) {
        const int b = i % B, r = 4 * (i / B);
        if (ks[b] < 0) continue;
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; j++) v[j] = round_bf16(kw[b] * round_bf16(s.out[(r + j) * 8 + b]));
        const float4 sum = make_float4(v[0], v[1], v[2], v[3]);
        red_add4(next + (size_t)b * p.hidden + r0 + r, sum);
        if (p.debug) red_add4(debug_at(p, layer + 1, NMK_MK_DEBUG_MLP, b) + r0 + r, sum);
    }
}

}  // namespace nmk::mk
