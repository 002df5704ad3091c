// NMK_OP_ROUTER, tile x: router rows [x * router_rows, ...) -> the layer's router logits, rounded
// to bf16 (up to kStagedMaxBatch rows the GEMV's sums scaled by each row's rms first:
// gemv_normed, northmk.h's task semantics v0.6), stored as tagged words (router_words: the
// layer and the value in one word, by relaxed stores: no fence, no ticket). The layer's last
// tile (the routing tile) also writes the layer's normed input whole, as a GEMV image, to
// normed_image, which the sparse GATE_UP tasks stage by one bulk copy; then it polls every
// tile's words and routes the layer (top-k by raw logit, ties to the lower id, weight =
// sigmoid(logit) with no renormalization, picks in ascending expert id, one mlp slot per distinct
// expert) and publishes each slot's word (its expert and the rows that picked it, tagged with the
// layer) by a release, which the image's stores precede: the fence is issued as the polls begin,
// the store after the picks. A sparse GATE_UP task polls its slot's word rather than a counter
// (op_mlp's slot_expert_of) and streams its weights while its input lands; DOWN weighs its rows by
// the sigmoid of their logits' words. Against a ticket (an acq_rel add after every tile's image
// share and logits, the last tile loading them all) the routing tile ends ~1.2 us sooner (5.2 ->
// 4.0 us past the layer's input) and batch 1 runs 1.3% faster (benchmarks/NOTES.md, session 50).
// Each CTA routing the layer for itself in its first GATE_UP or DOWN (no ticket, no table) had
// the routing done 2.3 us sooner but lost 2.6% at batch 1: the first GATE_UP on each SM ran ~1 us
// longer (session 42). Every tile routing the layer itself from words stored by release (session
// 43) was level: each tile's release waited for its image share's stores.
#pragma once

#include "common.cuh"

namespace nmk::mk {

// The layer's routing, in shared memory.
struct Routing {
    uint8_t picked[NMK_MK_MAX_BATCH][128];
    int8_t k_of[NMK_MK_MAX_BATCH][128];  // index of expert e in row b's ascending picks, -1: not picked
    int16_t slot_expert[128];            // the distinct picked experts in ascending id
    int warp_count[kWarps];
    int slots;                           // how many there are
};

static_assert(kTaskSmemBytes + sizeof(Kept) + sizeof(Routing) <= kSmemBytes, "the routing must fit past Kept");

// The threads that store the slot words: the last two warps (a slot each).
constexpr int kFirstPublisher = kThreads - 64;
static_assert(NMK_MK_MAX_BATCH * kMaxTopK <= 64 && kFirstPublisher >= 0, "a publishing thread per slot");

// The routing of `layer` from every tile's logit words (polled here), computed in shared memory
// past Kept and published for the layer's GATE_UP and DOWN tasks.
template <int B>
__device__ void route(const Params &p, int layer, char *smem) {
    Routing &r = *reinterpret_cast<Routing *>(smem + kTaskSmemBytes + sizeof(Kept));
    const int E = p.num_experts, K = p.top_k, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned below = (1u << lane) - 1;
    // Every thread's image stores (run_router) are published by the slot words' stores of the
    // last two warps, each after its own fence issued here: the fence's round trip runs beside
    // the polls and the picks instead of after them.
    __syncthreads();
    if (threadIdx.x >= kFirstPublisher) fence_acq_rel();
    // Warp b polls row b's words (lane l: experts l + 32 i, four loads in flight) until they all
    // carry the layer: each word is its own flag, nothing else is read through it. Then it picks
    // the row's K experts: those that fewer than K experts beat (a larger logit, or equal and a
    // lower id), one max over the warp per pick. The logits are bf16 values, so a 32-bit key
    // orders them as `better` does: the logit's 16 bits made monotonic (-0 as +0), then
    // 0xffff - id; one redux.sync per pick.
    if (warp < B) {
        const uint32_t *row = p.router_words + warp * E;
        uint32_t word[4];
        for (bool done = false; !done;) {
#pragma unroll
            for (int i = 0; i < 4; i++)
                word[i] = lane + 32 * i < E ? load_relaxed(row + lane + 32 * i) : logit_word(layer, 0.f);
            done = true;
#pragma unroll
            for (int i = 0; i < 4; i++) done &= logit_word_of(word[i], layer);
        }
        uint32_t key[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int e = lane + 32 * i;
            const uint32_t bits = __float_as_uint(logit_of(word[i]) + 0.f);
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
            const int k = base + __popc(mask & below);
            r.picked[warp][32 * i + lane] = on;
            r.k_of[warp][32 * i + lane] = on ? k : -1;
            if (B == 1 && on) r.slot_expert[k] = 32 * i + lane;  // one row: its picks are the slots
            base += __popc(mask);
        }
        if (B == 1 && lane == 0) r.slots = base;
    }
    __syncthreads();
    if constexpr (B > 1) {  // the slots: the rows' distinct picks in ascending id
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
    }
    // Slot y's word (slot_expert_of): its expert (-1 past the distinct picks) and the rows that
    // picked it, by thread kFirstPublisher + y, whose fence above makes the store a release.
    const int y = threadIdx.x - kFirstPublisher;
    if (y >= 0 && y < p.plan.expert_slots) {
        const int e = y < r.slots ? r.slot_expert[y] : -1;
        uint32_t rows = 0;
#pragma unroll
        for (int b = 0; b < B; b++) rows |= (e >= 0 && r.k_of[b][e] >= 0 ? 1u : 0u) << b;
        st_relaxed(reinterpret_cast<uint32_t *>(p.slot_expert) + y, slot_word(layer, e, rows));
    }
    if (p.debug_experts)
#pragma unroll 1
        for (int i = threadIdx.x; i < B * E; i += kThreads) {  // every (row, expert) pair by its own thread
            const int b = i / E, f = i % E, k = r.k_of[b][f];
            if (k >= 0) p.debug_experts[((size_t)layer * NMK_MK_MAX_BATCH + b) * p.top_k + k] = f;
        }
}

// A ROUTER task's GEMV scratch (GemvSmem(smem, hidden, router_rows), 16 rows: the schedule's
// kRouterRows) and the routing tile's stash of the whole staged input, [hidden / 8][B + 1] chunks
// of 16 bytes, up to the widest input.
static_assert(in_bytes(kMaxK) + (16 * 8 + kMaxGemvItems * 128) * 4 + kMaxK / 8 * (kStagedMaxBatch + 1) * 16 <=
                  kTaskSmemBytes,
              "the routing tile's stash must fit in a task's scratch");

template <int B>
__device__ void run_router(const Params &p, int layer, int tile, char *smem, const uint32_t *counter, uint32_t target) {
    const int H = p.hidden, E = p.num_experts, r0 = tile * p.plan.router_rows;
    const int n = min(p.plan.router_rows, E - r0);
    GemvSmem s(smem, H, p.plan.router_rows);
    const bf16 *W = p.layers[layer].router + (size_t)r0 * H, *norm = p.layers[layer].norm;
    // The routing tile writes the layer's normed image. Up to kStagedMaxBatch rows the staged
    // input is not the normed one (gemv_normed): its staging keeps every chunk's rounded x and
    // norm weight in the task's scratch past `extra` (which holds them: static_assert above),
    // and the image is normed from them once the rms is known.
    const bool routes = tile == p.plan.router_tiles - 1;
    uint4 *stash = reinterpret_cast<uint4 *>(s.extra);
    const int chunks = H / 8;
    gemv_normed<B>(smem, p, norm, layer, [&](int r) { return W + (size_t)r * H; }, n, s.in, H, s.out, s.red, counter,
                   target, stash, 0, routes ? chunks : 0);
    const PostRms<B> rms(smem, p);
#pragma unroll 1
    for (int i = threadIdx.x; i < n * B; i += kThreads)
        st_relaxed(p.router_words + (i % B) * E + r0 + i / B,
                   logit_word(layer, round_bf16(s.out[(i / B) * 8 + i % B] * rms(i % B))));
    if (!routes) return;
    // The routing tile: the whole normed image, then the routing (whose release publishes it).
    if constexpr (B <= kStagedMaxBatch) {
        // the exact normed image (store_normed_chunk), from the stash
#pragma unroll 1
        for (int c = threadIdx.x; c < chunks; c += kThreads) {
            float4 xa[B], xb[B];
            uint4 w;
#pragma unroll
            for (int b = 0; b < B; b++) {
                float x[8];
                unpack8(stash[c * (B + 1) + b], x);
                xa[b] = make_float4(x[0], x[1], x[2], x[3]), xb[b] = make_float4(x[4], x[5], x[6], x[7]);
            }
            w = stash[c * (B + 1) + B];
            store_normed_chunk<B>(p.normed_image, c, xa, xb, rms.rms, w);
        }
    } else {  // the staged input is the normed one: copy it
        const uint4 *src = reinterpret_cast<const uint4 *>(smem);
        uint4 *dst = reinterpret_cast<uint4 *>(p.normed_image);
#pragma unroll 1
        for (int i = threadIdx.x; i < in_bytes(H) / 16; i += kThreads) dst[i] = src[i];
    }
    route<B>(p, layer, smem);
}

}  // namespace nmk::mk
