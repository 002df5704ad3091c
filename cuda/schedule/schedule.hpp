// Task schedule of one decode step: per-SM task lists and dependency counters.
//
// build() lays the forward pass out as stages (norm, qkv, router, gate_up, attention, down,
// o-proj per layer; then final norm, lm_head, argmax), splits each stage into tiles, deals
// the tiles round-robin over the SMs stage by stage, and wires each stage to the counter of
// the stage it reads. check() proves a schedule safe to run. Semantics: v0.3 (northmk.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "northmk.h"

namespace nmk::schedule {

// Tiles of the kernel (v0.3): row and column tiles are multiples of kTile (tensor-core
// tiles) up to the sizes it reserves shared memory for; GEMV inputs are staged whole.
constexpr int kTile = 16;
constexpr int kNormCols = 128;
constexpr int kRouterRows = 16;
constexpr int kMaxQkvRows = 128, kMaxOprojRows = 128, kMaxCols = 128, kMaxDenseDownRows = 128;
constexpr int kMaxMoeDownRows = 256, kMaxLmRows = 512;
constexpr int kMaxGemvInput = 4096;  // widest input [8, K] bf16 a GEMV stages

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

struct Schedule {
    nmk_plan plan{};
    std::vector<std::vector<nmk_task>> per_sm;

    int num_sms() const { return static_cast<int>(per_sm.size()); }
    size_t num_tasks() const;
};

// context_lens[r]: tokens row r will see this step, its new token included (>= 1).
// The schedule stays valid for any step whose lengths are <= these.
Schedule build(const Geometry &g, int num_sms, const std::vector<int> &context_lens);

// Throws std::runtime_error describing the first violation: a plan check_plan refuses,
// unknown or retired (COMBINE) opcodes or fields out of range, a counter waited on whose
// target differs from its number of signallers, a task waiting on something not strictly
// before it (deadlock), a stage missing a producer it reads, two stages touching one buffer
// unordered, or a step that cannot finish.
void check(const Geometry &g, const nmk_plan &plan, const std::vector<std::vector<nmk_task>> &per_sm);

// Throws std::runtime_error when the plan's tiles do not fit the geometry, the batch or
// the kernel's limits.
void check_plan(const Geometry &g, const nmk_plan &plan);

// Number of tiles of each stage, as build() makes them and the kernel expects them.
int qkv_tiles(const Geometry &g, const nmk_plan &p);
int oproj_tiles(const Geometry &g, const nmk_plan &p);
int gate_up_tiles(const Geometry &g, const nmk_plan &p, int layer);
int down_tiles(const Geometry &g, const nmk_plan &p, int layer);
int mlp_slots(const Geometry &g, const nmk_plan &p, int layer);
int keys_seen(const Geometry &g, int layer, int context_len);

}  // namespace nmk::schedule
