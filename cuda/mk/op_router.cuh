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
#pragma unroll 1
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
#pragma unroll 1
    for (int i = threadIdx.x; i < B * E; i += kThreads) r.logit[i / E][i % E] = load_l2(p.router_logits + i);
    __syncthreads();
    // Warp b picks row b's K experts: those that fewer than K experts beat (a larger logit, or
    // equal and a lower id), one argmax over the warp per pick (lane l holds experts l + 32 i).
    if (warp < B) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = lane + 32 * i < E ? r.logit[warp][lane + 32 * i] : -INFINITY;
        unsigned mine = 0;  // bit i: expert lane + 32 i is picked
        for (int pick = 0; pick < K; pick++) {
            float bv = -INFINITY;
            int bi = 128;  // past every expert: any real one beats it
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int e = lane + 32 * i;
                if (e < E && !(mine >> i & 1) && (v[i] > bv || (v[i] == bv && e < bi))) bv = v[i], bi = e;
            }
#pragma unroll
            for (int o = 16; o; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
            }
            if (bi < 128 && (bi & 31) == lane) mine |= 1u << (bi >> 5);
        }
        int base = 0;  // the index of each pick in ascending id
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const bool on = mine >> i & 1;
            const unsigned mask = __ballot_sync(0xffffffffu, on);
            r.picked[warp][32 * i + lane] = on;
            r.k_of[warp][32 * i + lane] = on ? base + __popc(mask & below) : -1;
            base += __popc(mask);
        }
    }
    __syncthreads();
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
