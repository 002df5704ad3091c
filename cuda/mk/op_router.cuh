// NMK_OP_ROUTER, tile x: router rows [x * router_rows, ...) -> router_logits, rounded to bf16
// (up to kStagedMaxBatch rows the GEMV's sums scaled by each row's rms first: gemv_normed,
// northmk.h's task semantics v0.6). Each tile also writes its share of the layer's normed
// input, as a GEMV image, to normed_image, which the sparse GATE_UP tasks stage by one bulk
// copy. The last tile to finish routes the layer from all the logits (top-k by raw logit,
// ties to the lower id, weight = sigmoid(logit) with no renormalization, picks in ascending
// expert id, one mlp slot per distinct expert) and publishes slot_k and slot_w (DOWN, which
// weighs its outputs), then slot_expert (GATE_UP, DOWN) tagged with the layer, before its
// signal: a sparse GATE_UP task polls its slot's expert there rather than the signal's counter
// (op_mlp's slot_expert_of) and streams its weights while its input lands. Each CTA routing
// the layer for itself in its first GATE_UP or DOWN (no ticket, no table) had the routing done
// 2.3 us sooner but lost 2.6% at batch 1: the first GATE_UP on each SM ran ~1 us longer, and
// the SMs reach it only after the layer's last QKV tiles anyway (benchmarks/NOTES.md, session 42).
// Every tile storing its logits as tagged words and routing the layer itself (no ticket, the
// slot words carrying their rows, DOWN weighing from the words) was level at batch 1: the first
// GATE_UP ended 0.6 us sooner, but the eight tiles each wait for the last one's words (session 43).
#pragma once

#include "common.cuh"

namespace nmk::mk {

// The layer's routing, in shared memory.
struct Routing {
    float logit[NMK_MK_MAX_BATCH][128];
    uint8_t picked[NMK_MK_MAX_BATCH][128];
    int8_t k_of[NMK_MK_MAX_BATCH][128];  // index of expert e in row b's ascending picks, -1: not picked
    int16_t slot_expert[128];            // the distinct picked experts in ascending id
    int warp_count[kWarps];
    int slots;                           // how many there are
};

static_assert(kTaskSmemBytes + sizeof(Kept) + sizeof(Routing) <= kSmemBytes, "the routing must fit past Kept");

// The routing of `layer` from router_logits (every tile's, acquired by the caller's ticket),
// computed in shared memory past Kept and published for the layer's GATE_UP and DOWN tasks.
template <int B>
__device__ void route(const Params &p, int layer, char *smem) {
    Routing &r = *reinterpret_cast<Routing *>(smem + kTaskSmemBytes + sizeof(Kept));
    const int E = p.num_experts, K = p.top_k, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned below = (1u << lane) - 1;
    // Every logit's load in flight at once (up to four a thread at batch 8), then the stores.
    constexpr int kLoads = (B * 128 + kThreads - 1) / kThreads;
    float v[kLoads] = {};
#pragma unroll
    for (int j = 0; j < kLoads; j++)
        if (threadIdx.x + j * kThreads < B * E) v[j] = load_l2(p.router_logits + threadIdx.x + j * kThreads);
#pragma unroll
    for (int j = 0; j < kLoads; j++) {
        const int i = threadIdx.x + j * kThreads;
        if (i < B * E) r.logit[i / E][i % E] = v[j];
    }
    __syncthreads();
    // Warp b picks row b's K experts: those that fewer than K experts beat (a larger logit, or
    // equal and a lower id), one max over the warp per pick (lane l holds experts l + 32 i). The
    // logits are bf16 values, so a 32-bit key orders them as `better` does: the logit's 16 bits
    // made monotonic (-0 as +0), then 0xffff - id; one redux.sync per pick.
    if (warp < B) {
        uint32_t key[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int e = lane + 32 * i;
            const uint32_t bits = __float_as_uint(e < E ? r.logit[warp][e] + 0.f : 0.f);
            const uint32_t ordered = (bits & 0x80000000u ? ~bits : bits | 0x80000000u) >> 16;
            key[i] = e < E ? ordered << 16 | (0xffffu - e) : 0u;  // real keys are > 0
        }
        unsigned mine = 0;  // bit i: expert lane + 32 i is picked
        for (int pick = 0; pick < K; pick++) {
            uint32_t best = 0;
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (!(mine >> i & 1)) best = max(best, key[i]);
            const int e = 0xffff - (__reduce_max_sync(0xffffffffu, best) & 0xffff);
            if ((e & 31) == lane) mine |= 1u << (e >> 5);
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
    }
    __syncthreads();
    // Slot y's expert (-1 past the distinct picks), which of each row's picks it is and its weight.
#pragma unroll 1
    for (int i = threadIdx.x; i < p.plan.expert_slots * (B + 1); i += kThreads) {
        const int y = i / (B + 1), b = i % (B + 1), e = y < r.slots ? r.slot_expert[y] : -1;
        if (b == B) continue;
        const int k = e < 0 ? -1 : r.k_of[b][e];
        p.slot_k[y * B + b] = k;
        p.slot_w[y * B + b] = k < 0 ? 0.f : round_bf16(1.f / (1.f + expf(-r.logit[b][e])));
    }
    __syncthreads();  // the slots' rows and weights, then their experts' words (slot_expert_of)
    if (threadIdx.x < p.plan.expert_slots) {
        const int e = threadIdx.x < r.slots ? r.slot_expert[threadIdx.x] : -1;
        st_release(reinterpret_cast<uint32_t *>(p.slot_expert) + threadIdx.x,
                   ((uint32_t)layer + 1) << 16 | ((uint32_t)e & 0xffffu));
    }
    if (p.debug_experts)
#pragma unroll 1
        for (int i = threadIdx.x; i < B * E; i += kThreads) {  // every (row, expert) pair by its own thread
            const int b = i / E, f = i % E, k = r.k_of[b][f];
            if (k >= 0) p.debug_experts[((size_t)layer * NMK_MK_MAX_BATCH + b) * p.top_k + k] = f;
        }
}

template <int B>
__device__ void run_router(const Params &p, int layer, int tile, char *smem, const uint32_t *counter, uint32_t target) {
    const int H = p.hidden, E = p.num_experts, r0 = tile * p.plan.router_rows;
    const int n = min(p.plan.router_rows, E - r0);
    GemvSmem s(smem, H, p.plan.router_rows);
    const bf16 *W = p.layers[layer].router + (size_t)r0 * H, *norm = p.layers[layer].norm;
    // This tile's share of the image: whole 32-wide k blocks, chunks [c0, c1) of 8 columns.
    const int blocks = H / 32, b0 = tile * blocks / p.plan.router_tiles;
    const int b1 = (tile + 1) * blocks / p.plan.router_tiles, c0 = 4 * b0, c1 = 4 * b1;
    // Up to kStagedMaxBatch rows the staged input is not the normed one (gemv_normed): the staging
    // keeps the share's rounded x and norm weight past `last` in the task's extra bytes, where
    // they fit, and the image is normed from them once the rms is known.
    uint4 *stash = reinterpret_cast<uint4 *>(s.extra + 16);
    const bool stashed = (c1 - c0) * (B + 1) * 16 + 16 <= kGemvExtraBytes;
    gemv_normed<B>(smem, p, norm, layer, [&](int r) { return W + (size_t)r * H; }, n, s.in, H, s.out, s.red, counter,
                   target, stash, stashed ? c0 : 0, stashed ? c1 : 0);
    const PostRms<B> rms(smem, p);
    if constexpr (B <= kStagedMaxBatch) {
        // the exact normed image (store_normed_chunk), from the stash or the residual's sums
#pragma unroll 1
        for (int c = c0 + threadIdx.x; c < c1; c += kThreads) {
            float4 xa[B], xb[B];
            uint4 w;
            if (stashed) {
#pragma unroll
                for (int b = 0; b < B; b++) {
                    float x[8];
                    unpack8(stash[(c - c0) * (B + 1) + b], x);
                    xa[b] = make_float4(x[0], x[1], x[2], x[3]), xb[b] = make_float4(x[4], x[5], x[6], x[7]);
                }
                w = stash[(c - c0) * (B + 1) + B];
            } else {
                load_x_chunk<B>(p, layer, c, xa, xb);
#pragma unroll
                for (int b = 0; b < B; b++) xa[b] = round_bf16(xa[b]), xb[b] = round_bf16(xb[b]);
                w = reinterpret_cast<const uint4 *>(norm)[c];
            }
            store_normed_chunk<B>(p.normed_image, c, xa, xb, rms.rms, w);
        }
    } else {  // the staged input is the normed one: copy the share
        const uint4 *src = reinterpret_cast<const uint4 *>(smem + b0 * kInBlockBytes);
        uint4 *dst = reinterpret_cast<uint4 *>(reinterpret_cast<char *>(p.normed_image) + b0 * kInBlockBytes);
#pragma unroll 1
        for (int i = threadIdx.x; i < (b1 - b0) * kInBlockBytes / 16; i += kThreads) dst[i] = src[i];
    }
#pragma unroll 1
    for (int i = threadIdx.x; i < n * B; i += kThreads)
        p.router_logits[(i % B) * E + r0 + i / B] = round_bf16(s.out[(i / B) * 8 + i % B] * rms(i % B));
    // The layer's last tile to finish routes it.
    int &last = *reinterpret_cast<int *>(s.extra);
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atom_add_acq_rel(p.route_ticket, 1u) == (uint32_t)p.plan.router_tiles - 1;
        if (last) *p.route_ticket = 0;  // the next layer's tiles start after this task's signal
    }
    __syncthreads();
    if (last) route<B>(p, layer, smem);
}

}  // namespace nmk::mk
