// NMK_OP_ROUTER, tile x: router rows [x * router_rows, ...) -> router_logits (rounded to
// bf16 as the reference rounds them). The routing itself (top-k by raw logit, ties to the
// lower id, weight = sigmoid(logit) with no renormalization, picks in ascending expert id,
// one mlp slot per distinct expert) is computed from those logits by each SM that runs a
// GATE_UP task of the layer, once (route()), so no single SM sits between the router and
// the experts.
#pragma once

#include "common.cuh"

namespace nmk::mk {

template <int B>
__device__ void run_router(const Params &p, int layer, int tile, char *smem) {
    const int H = p.hidden, E = p.num_experts, r0 = tile * p.plan.router_rows;
    const int n = min(p.plan.router_rows, E - r0);
    GemvSmem s(smem, H, p.plan.router_rows);
    stage_normed<B>(smem, p, p.layers[layer].norm, layer);
    const bf16 *W = p.layers[layer].router + (size_t)r0 * H;
    gemv([&](int r) { return W + (size_t)r * H; }, n, s.in, H, s.out, s.red);
    for (int i = threadIdx.x; i < n * B; i += kThreads)
        p.router_logits[(i % B) * E + r0 + i / B] = round_bf16(s.out[(i / B) * 8 + i % B]);
}

// The layer's routing, in shared memory.
struct Routing {
    float logit[NMK_MK_MAX_BATCH][128];
    uint8_t picked[NMK_MK_MAX_BATCH][128];
    int8_t k_of[NMK_MK_MAX_BATCH][128];  // index of expert e in row b's ascending picks, -1: not picked
    int16_t slot_expert[128];            // the distinct picked experts in ascending id
    int warp_count[kWarps];
    int slots;                           // how many there are
};

static_assert(kTaskSmemBytes + sizeof(Kept) + sizeof(Routing) <= kSmemBytes, "the kept routing must fit");

// The routing of `layer` in the CTA's kept shared memory: computed from router_logits unless
// this CTA already did for the layer. Ends with a barrier when it computes.
template <int B>
__device__ const Routing &route(const Params &p, int layer, char *smem) {
    Kept &k = kept(smem);
    Routing &r = *reinterpret_cast<Routing *>(smem + kTaskSmemBytes + sizeof(Kept));
    if (k.routed == layer) return r;
    const int E = p.num_experts, K = p.top_k, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned below = (1u << lane) - 1;
    for (int i = threadIdx.x; i < B * E; i += kThreads) r.logit[i / E][i % E] = load_l2(p.router_logits + i);
    __syncthreads();
    // Row b picks expert e when fewer than K experts beat it (a larger logit, or equal and a lower id).
    for (int i = threadIdx.x; i < B * 128; i += kThreads) {
        const int b = i / 128, e = i % 128;
        int rank = K;
        if (e < E) {
            const float v = r.logit[b][e];
            rank = 0;
            for (int f = 0; f < E; f++) rank += r.logit[b][f] > v || (r.logit[b][f] == v && f < e);
        }
        r.picked[b][e] = rank < K;
    }
    __syncthreads();
    if (warp < B) {  // row `warp`: the index of each pick in ascending id
        int base = 0;
        for (int c = 0; c < 128; c += 32) {
            const bool on = r.picked[warp][c + lane];
            const unsigned mask = __ballot_sync(0xffffffffu, on);
            r.k_of[warp][c + lane] = on ? base + __popc(mask & below) : -1;
            base += __popc(mask);
        }
    }
    bool used = false;
    if (threadIdx.x < 128)
        for (int b = 0; b < B; b++) used |= r.picked[b][threadIdx.x] != 0;
    const unsigned mask = __ballot_sync(0xffffffffu, used);
    if (lane == 0) r.warp_count[warp] = __popc(mask);
    __syncthreads();
    if (used) {
        int slot = __popc(mask & below);
        for (int w = 0; w < warp; w++) slot += r.warp_count[w];
        r.slot_expert[slot] = threadIdx.x;
    }
    if (threadIdx.x == 0) {
        int n = 0;
        for (int w = 0; w < kWarps; w++) n += r.warp_count[w];
        r.slots = n;
        k.routed = layer;  // every thread read it above, before the barriers
    }
    __syncthreads();
    return r;
}

}  // namespace nmk::mk
