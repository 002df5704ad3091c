// Task schedule of one decode step: per-SM task lists, device work queues and dependency
// counters.
//
// build() lays the forward pass out as stages (norm at layer 0; qkv, router, gate_up,
// attention, down, o-proj per layer; then lm_head, argmax) and splits each stage into tiles.
// The lists get layer 0's NORM, ROUTER and QKV tiles dealt round-robin, then per layer l
// DRAIN(l) on every SM; queue l holds the layer's GATE_UP (slot-major; the ATTN tasks (row, kv
// head, split) after its first num_sms - splits), DOWN (slot-major) and OPROJ tasks, then
// layer l + 1's ROUTER and QKV tiles, which the SMs drain by work stealing. LM_HEAD and ARGMAX
// are dealt to the lists after the last layer. Each stage waits on the counters of the stages
// it reads; a layer's input has one per column block (kBlockCols columns), which the previous
// layer's o-proj and DOWN tiles (layer 0's NORM tiles) signal, each its own block's, and its
// readers wait on all of them (block_waiter). check() proves a schedule safe to run.
// Semantics: v0.6 tasks, ABI v3 queues (northmk.h).

#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "northmk.h"
#include "schedule/block_wait.hpp"

namespace nmk::schedule {

// Tiles of the kernel (v0.3): row and column tiles are multiples of kTile (tensor-core
// tiles) up to the sizes it reserves shared memory for; GEMV inputs are staged whole.
constexpr int kTile = 16;
constexpr int kNormCols = 32;
constexpr int kRouterRows = 16;
constexpr int kMaxQkvRows = 128, kMaxOprojRows = 128, kMaxCols = 128, kMaxDenseDownRows = 128;
constexpr int kMaxMoeDownRows = 256, kMaxLmRows = 512;
constexpr int kMaxGemvInput = 4096;  // widest input [8, K] bf16 a GEMV stages
constexpr int kMinSplitPages = 10;   // an attention split covers at least this many pages
// A layer's input has a counter per block of kBlockCols hidden columns (hidden % 256 == 0).
constexpr int kBlockCols = NMK_MK_BLOCK_COLS;

struct Geometry {
    int hidden = 0;
    int num_layers = 0;
    int num_heads = 0;
    int num_kv_heads = 0;
    int head_dim = 0;
    int num_experts = 0;
    int top_k = 0;
    int moe_inter = 0;
    int dense_inter = 0;
    int vocab = 0;
    int sliding_window = 0;  // keys seen by a sliding layer, the current one included
    int page_size = 0;
    std::vector<uint8_t> dense;    // per layer: dense MLP (else routed experts)
    std::vector<uint8_t> sliding;  // per layer: sliding-window attention (else full)

    void validate() const;  // throws std::invalid_argument naming the field

    static Geometry from_abi(const nmk_mk_geometry &g);  // validated
};

using TaskLists = std::vector<std::vector<nmk_task>>;

struct Schedule {
    nmk_plan plan{};
    TaskLists per_sm;  // SM s runs per_sm[s], DRAIN entries included
    TaskLists queues;  // plan.num_queues of them

    int num_sms() const { return static_cast<int>(per_sm.size()); }
    size_t num_tasks() const;  // lists and queues, DRAIN entries included
};

// The schedule as the kernel and the C ABI hold it: the lists, then the queues, in one array.
// SM s runs tasks[sm_offsets[s] .. sm_offsets[s + 1]); queue q is tasks[queue_offsets[q] ..
// queue_offsets[q + 1]), queue_offsets[0] == sm_offsets[num_sms].
struct FlatSchedule {
    std::vector<nmk_task> tasks;
    std::vector<uint32_t> sm_offsets;     // [num_sms + 1]
    std::vector<uint32_t> queue_offsets;  // [num_queues + 1]
};
FlatSchedule flatten(const Schedule &s);

// context_lens[r]: tokens row r will see this step, its new token included (>= 1).
// The schedule stays valid for any step whose lengths are <= these.
Schedule build(const Geometry &g, int num_sms, const std::vector<int> &context_lens);

// Throws std::runtime_error describing the first violation, in this order:
//  - a plan check_plan refuses, or queues.size() != plan.num_queues;
//  - unknown or retired (COMBINE) opcodes, counters or attention splits out of range;
//  - a malformed DRAIN: in a queue, of an unknown queue, with y, z, wait, target or signal
//    not 0 / -1, or a list without exactly one DRAIN(q) for some queue q;
//  - a task missing, unexpected or present twice (across lists and queues);
//  - a counter waited on whose target differs from its number of signallers, a wait that
//    misses a stage the task reads, or a block counter of a layer's input signalled by a task
//    that is not one of its writers or writes columns outside its block;
//  - two stages touching one buffer unordered;
//  - a wait that may deadlock under some claim order. The rule: the must-finish-before
//    relation is acyclic. Its edges: (i) consecutive entries of a list; (ii) consecutive
//    tasks of a queue; (iii) in each list, the entry before DRAIN(q) -> q's first task and
//    q's last task -> DRAIN(q) (the list runs all of q in place of DRAIN(q)); (iv) every
//    signaller of a counter -> every task that waits on it (on any counter of its group,
//    for a block waiter); (v) every other ROUTER tile of a layer -> its routing tile (the
//    last, which polls their logits: no counter carries that wait). Why it suffices: in a stuck
//    state, a CTA waits on an unfinished signaller, a list entry on the one before it, an
//    unclaimed queue task on every CTA (none has passed DRAIN(q): each is stuck before it,
//    or at it holding an earlier task of q), a task claimed ahead on its CTA's current one
//    (earlier in the queue); following these backwards never ends, so it closes a cycle. Named special cases, checked first: a task of queue q
//    may wait only on counters whose signallers are (a) earlier tasks of q, (b) list tasks
//    before DRAIN(q) in their own list, or (c) tasks of a queue q' whose DRAIN comes before
//    DRAIN(q) in every list; a list task waiting on a counter that a task of queue q
//    signals must come after DRAIN(q) in its list;
//  - a step that does not finish when every SM takes its next task as soon as it may (an SM
//    at DRAIN(q) claims the next task of q and holds it until it can run).
void check(const Geometry &g, const nmk_plan &plan, const TaskLists &per_sm, const TaskLists &queues);

// Throws std::runtime_error when the plan's tiles do not fit the geometry, the batch or
// the kernel's limits.
void check_plan(const Geometry &g, const nmk_plan &plan);

// Whether tasks of op at layer read that layer's input (LM_HEAD: the last layer's output) and
// so wait on its block counters, hidden / kBlockCols of them from their wait (v0.6:
// waits_on_blocks). wait_span: how many counters a task waits on (0: none).
bool block_waiter(const Geometry &g, int op, int layer);
int wait_span(const Geometry &g, const nmk_task &t);

// Number of tiles of each stage, as build() makes them and the kernel expects them.
int qkv_tiles(const Geometry &g, const nmk_plan &p);
int oproj_tiles(const Geometry &g, const nmk_plan &p);
int gate_up_tiles(const Geometry &g, const nmk_plan &p, int layer);
int down_tiles(const Geometry &g, const nmk_plan &p, int layer);
int mlp_slots(const Geometry &g, const nmk_plan &p, int layer);
int keys_seen(const Geometry &g, int layer, int context_len);

}  // namespace nmk::schedule
