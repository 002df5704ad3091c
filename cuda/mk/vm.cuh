// The persistent VM: each CTA walks its SM's task list; a task waits on a counter in
// global memory, runs, and signals. No grid-wide barrier. A schedule's counters come in two
// sets that its launches take in turn: each launch zeroes, beside its first tasks, the set the
// launch before it used (which has ended: stream order), so that nothing runs after the step's
// last task.
#pragma once

#include "op_attention.cuh"
#include "op_lm_head.cuh"
#include "op_mlp.cuh"
#include "op_norm.cuh"
#include "op_oproj.cuh"
#include "op_qkv.cuh"
#include "op_router.cuh"
#include "schedule/block_wait.hpp"

namespace nmk::mk {

// Waits until counter `c` reaches target: thread 0 polls with acquire loads, then a barrier.
// Counters only grow during a step, so once the CTA has acquired a counter at a target (the
// last such wait, in Kept) a wait for no more than that passes without a poll: the writes it
// orders were acquired then (queue tasks of one opcode wait on one counter: o-proj's on
// attention).
__device__ __forceinline__ void wait_for(const Params &p, int c, uint32_t target, char *smem) {
    Kept &k = kept(smem);
    if (c == k.seen && target <= k.seen_target) return;  // every thread reads the same Kept
    if (threadIdx.x == 0)
        while (load_acquire(p.counters + c) < target) __nanosleep(20);
    __syncthreads();
    if (threadIdx.x == 0) k.seen = c, k.seen_target = target;  // the next wait reads it past run_one's barrier
}

// All threads' writes of the task are done (barrier), then one release-add.
__device__ __forceinline__ void signal(uint32_t *counter) {
    __syncthreads();
    if (threadIdx.x == 0) red_release(counter, 1u);
}

// Waits until counters c .. c + n - 1 (n <= 32) all reach target: thread i polls counter c + i
// with acquire loads, then a barrier. A layer's input has a counter per column block.
__device__ __forceinline__ void wait_for_blocks(const Params &p, int c, int n, uint32_t target) {
    if (threadIdx.x < n)  // lane i of warp 0 polls counter c + i: the n acquires at once
        while (load_acquire(p.counters + c + threadIdx.x) < target) __nanosleep(20);
    __syncthreads();
}

// Tasks that read a layer's input (or the last layer's output, the LM head) wait on its column
// blocks' counters, from t.wait (task semantics v0.6; the rule the schedule's builder uses).
__device__ __forceinline__ bool waits_for_blocks(const Params &p, const nmk_task &t) {
    return schedule::waits_on_blocks(t.op, [&] { return p.layers[t.layer].dense; });
}

// Tasks that wait for their input themselves, not the VM before they run (schedule::waits_in_run):
// QKV and ROUTER tiles up to kStagedMaxBatch rows, each chunk for its block after their first
// weight burst is issued (gemv_normed); a sparse layer's GATE_UP, which polls the routing's slot
// table (slot_expert_of); an attention split, once its page numbers are loaded (run_attention).
template <int B>
__device__ __forceinline__ bool own_wait(const Params &p, const nmk_task &t) {
    return schedule::waits_in_run(t.op, B, t.wait >= 0, [&] { return p.layers[t.layer].dense; });
}

template <int B>
__device__ __forceinline__ void run_task(const Params &p, const nmk_task &t, char *smem) {
    // Tasks other than these overwrite the normed input at offset 0 (the previous task's
    // barrier has passed: no thread still reads the flag).
    if (t.op != NMK_OP_QKV && t.op != NMK_OP_ROUTER && t.op != NMK_OP_GATE_UP && t.op != NMK_OP_LM_HEAD &&
        threadIdx.x == 0)
        kept(smem).normed = -1;
    switch (t.op) {
        case NMK_OP_NORM: return run_norm<B>(p, t.x, smem);
        case NMK_OP_QKV:
            return run_qkv<B>(p, t.layer, t.x, smem, own_wait<B>(p, t) ? p.counters + t.wait : nullptr, t.target);
        case NMK_OP_ROUTER:
            return run_router<B>(p, t.layer, t.x, smem, own_wait<B>(p, t) ? p.counters + t.wait : nullptr, t.target);
        case NMK_OP_ATTN: return run_attention(p, t.layer, t.x, t.y, t.z & 0xff, t.z >> 8, smem, t.wait, t.target);
        case NMK_OP_OPROJ: return run_oproj<B>(p, t.layer, t.x, smem);
        case NMK_OP_GATE_UP: return run_gate_up<B>(p, t.layer, t.x, t.y, smem);
        case NMK_OP_DOWN: return run_down<B>(p, t.layer, t.x, t.y, smem);
        case NMK_OP_LM_HEAD: return run_lm_head<B>(p, t.x, smem);
        case NMK_OP_ARGMAX: return run_argmax(p, t.x, smem);
        default: __trap();
    }
}

// The VM's functions are force-inlined: left to itself, the front end outlined one of them once
// the tasks' code grew (session 33), and a call anywhere in the kernel makes ptxas serialize
// every wgmma (C7510): batch 1 -7%.
//
// Task i of the step's array (t, its descriptor): wait for its input, run, call claim()
// (the drain claims its next task there), signal, call fetch() (the drain loads the claimed
// task's descriptor there, beside the signal's fence); with timing on, record when it began
// waiting, ran and ended, and which SM ran it. Nothing is prefetched: L2 prefetches of the
// static weights before the wait cost 1-2.5% of the step, register preloads of a task's first
// burst 1-3%, a shared-memory preload of the next QKV or router tile's first rows 2-3%: reads
// added at a layer's tail slow its last tasks. A bulk L2 prefetch of the first burst after the
// wait, while the task stages its input, lost 2.5% too: the tasks got longer; so did one of the
// layer's keys and values by its QKV tiles (-3.4%: attention ran only ~0.5 us faster from L2)
// (benchmarks/NOTES.md).
template <int B, class Claim, class Fetch>
__device__ __forceinline__ void run_one(const Params &p, uint32_t i, const nmk_task &t, char *smem, Claim claim,
                                        Fetch fetch) {
    const bool timed = p.timing && i < p.timing_capacity;
    uint64_t waited = timed ? global_ns() : 0;
    if (t.wait >= 0 && !own_wait<B>(p, t)) {
        if (waits_for_blocks(p, t)) wait_for_blocks(p, t.wait, p.hidden / NMK_MK_BLOCK_COLS, t.target);
        else wait_for(p, t.wait, t.target, smem);
    }
    uint64_t started = timed ? global_ns() : 0;
    run_task<B>(p, t, smem);
    claim();
    if (t.signal >= 0) signal(p.counters + t.signal);
    else __syncthreads();
    fetch();
    if (timed && threadIdx.x == 0) {
        uint64_t *r = p.timing + 4 * (size_t)i;
        r[0] = waited, r[1] = started, r[2] = global_ns();
        r[3] = t.op | (uint32_t)t.layer << 8 | (uint64_t)blockIdx.x << 16;
    }
}

// DRAIN(q): claim queue q's tasks in order with an atomic head until it runs dry. Thread
// kClaimer claims the next task once the current one's work is done, before its signal, and
// loads the claimed task's descriptor after the signal's barrier: both round trips overlap
// thread 0's fence and release instead of following them. Within a queue a CTA never holds a
// task while it works on another (a held task would wait for this CTA however many SMs are
// idle). Holding a later task of the queue never blocks an earlier one: queue tasks wait only
// on earlier work.
// The list task before a DRAIN(q) (a layer's QKV or router tile, layer 0's NORM) claims q's
// first task as it begins (`ahead`, run_list) and keeps the claim and q's bounds in Kept, so
// that its SM enters the queue with no global load between the two tasks. It holds that task
// for one list task's run: the queue's first tasks (attention splits, GATE_UP tiles) wait for
// the layer's QKV or routing anyway, and a list task never waits on the queue of the DRAIN
// after it (the schedule checker's cycle rule). With the list's descriptors loaded as words
// (TaskWords), batch 1 +0.55% (benchmarks/NOTES.md, session 39).
constexpr int kClaimer = 32;  // lane 0 of warp 1: not thread 0, which signals

// Queue q's claim head: past the counters (Params::counters).
__device__ __forceinline__ uint32_t *claim_head(const Params &p, uint32_t q) {
    return p.counters + p.plan.num_counters + q;
}

template <int B>
__device__ __forceinline__ void drain(const Params &p, int q, char *smem, bool ahead) {
    const uint32_t first = ahead ? kept(smem).ahead_first : p.queue_offsets[q];
    const uint32_t count = ahead ? kept(smem).ahead_count : p.queue_offsets[q + 1] - first;
    uint32_t *head = claim_head(p, q);
    uint32_t &claimed = kept(smem).claimed;
    nmk_task &claimed_task = kept(smem).claimed_task;
    uint32_t next = 0;
    nmk_task desc{};
    auto claim = [&] {
        if (threadIdx.x == kClaimer) next = atomicAdd(head, 1u);
    };
    auto fetch = [&] {
        if (threadIdx.x == kClaimer && next < count) desc = p.tasks[first + next];
    };
    if (!ahead) claim(), fetch();
    else if (threadIdx.x == kClaimer) next = claimed, desc = claimed_task;  // its own stores (claim_ahead)
    for (;;) {
        if (threadIdx.x == kClaimer) claimed = next, claimed_task = desc;
        __syncthreads();
        const uint32_t j = claimed;
        const nmk_task t = claimed_task;
        __syncthreads();  // everyone has read them before the claimer rewrites them
        if (j >= count) return;
        run_one<B>(p, first + j, t, smem, claim, fetch);
    }
}

// Claim queue q's next task for the DRAIN(q) after the list task this CTA begins (kClaimer
// only): its index, its descriptor (when it is one of the queue's) and q's bounds, into Kept.
__device__ __forceinline__ void claim_ahead(const Params &p, uint32_t q, char *smem) {
    Kept &k = kept(smem);
    const uint32_t first = p.queue_offsets[q], count = p.queue_offsets[q + 1] - first;
    const uint32_t j = atomicAdd(claim_head(p, q), 1u);
    k.claimed = j, k.ahead_first = first, k.ahead_count = count;
    if (j < count) k.claimed_task = p.tasks[first + j];
}

// A list entry's descriptor as its five words (nmk_task's layout), loaded as words and unpacked
// by task_of where its task runs. Loaded as an nmk_task, the next entry had its byte fields
// unpacked right after the load, so the loop waited for that load before running the current
// task (an L2 round trip at every list entry whose line L1 no longer held).
struct TaskWords {
    uint32_t w[5];
};
static_assert(sizeof(nmk_task) == sizeof(TaskWords) && offsetof(nmk_task, layer) == 1 && offsetof(nmk_task, x) == 2 &&
                  offsetof(nmk_task, y) == 4 && offsetof(nmk_task, z) == 6 && offsetof(nmk_task, wait) == 8 &&
                  offsetof(nmk_task, target) == 12 && offsetof(nmk_task, signal) == 16,
              "task_of reads nmk_task's fields from these words (little-endian)");

__device__ __forceinline__ TaskWords task_words(const nmk_task *t) {
    const uint32_t *s = reinterpret_cast<const uint32_t *>(t);
    TaskWords r;
#pragma unroll
    for (int k = 0; k < 5; k++) r.w[k] = s[k];
    return r;
}

__device__ __forceinline__ nmk_task task_of(const TaskWords &r) {
    nmk_task t;
    t.op = static_cast<uint8_t>(r.w[0]), t.layer = static_cast<uint8_t>(r.w[0] >> 8);
    t.x = static_cast<uint16_t>(r.w[0] >> 16), t.y = static_cast<uint16_t>(r.w[1]);
    t.z = static_cast<uint16_t>(r.w[1] >> 16);
    t.wait = static_cast<int32_t>(r.w[2]), t.target = r.w[3], t.signal = static_cast<int32_t>(r.w[4]);
    return t;
}

// The SM's list in order. Each task's descriptor is loaded while the one before it runs: the
// acquiring polls invalidate L1, so a load after the task would be an L2 round trip before
// its wait. A list task followed by DRAIN(q) claims q's first task as it begins (drain's note);
// only the claimer waits for the next entry's descriptor to know q.
template <int B>
__device__ __forceinline__ void run_list(const Params &p, char *smem) {
    const uint32_t begin = p.sm_offsets[blockIdx.x], end = p.sm_offsets[blockIdx.x + 1];
    TaskWords cur = begin < end ? task_words(p.tasks + begin) : TaskWords{};
    bool ahead = false;  // the entry before this one was a list task: a DRAIN here was claimed ahead
    for (uint32_t i = begin; i < end; i++) {
        const TaskWords next = i + 1 < end ? task_words(p.tasks + i + 1) : TaskWords{};
        const nmk_task t = task_of(cur);
        if (t.op == NMK_OP_DRAIN) {
            drain<B>(p, t.x, smem, ahead);
            ahead = false;
        } else {
            ahead = true;
            const nmk_task after = task_of(next);
            if (threadIdx.x == kClaimer && after.op == NMK_OP_DRAIN) claim_ahead(p, after.x, smem);
            run_one<B>(p, i, t, smem, [] {}, [] {});
        }
        cur = next;
    }
}

// One decode step of batch B (kernel_batch.cuh instantiates each B in its own translation unit).
template <int B>
__global__ void __launch_bounds__(kThreads, 1) megakernel(const __grid_constant__ Params p) {
    // 1024-byte aligned (no static shared memory comes first): attention's ring takes TMA boxes
    // with the 128-byte swizzle there, whose pattern repeats every 1024 bytes.
    extern __shared__ __align__(1024) char smem[];
    if (threadIdx.x == 0) {
        if (smem_u32(smem) & 1023) __trap();
        kept_init(smem);
    }
    // The spare set: the counters, claim heads and slot table that the previous launch used and
    // the next one takes, zeroed here by every thread a word (nothing of this launch reads them).
    const int words = p.plan.num_counters + p.plan.num_queues, slots = route_table_words(p.top_k, p.num_experts);
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < words + slots; i += gridDim.x * kThreads) {
        if (i < words) p.spare_counters[i] = 0;
        else p.spare_slot_expert[i - words] = 0;  // no layer's routing or logits
    }
    __syncthreads();
    run_list<B>(p, smem);
}

}  // namespace nmk::mk
