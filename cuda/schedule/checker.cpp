// Proves a schedule safe to run on the megakernel (see check() in schedule.hpp).
#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <tuple>

#include "schedule.hpp"

namespace nmk::schedule {
namespace {

// Buffers of the step that stages share; each stage's reads and writes. SS: the NORM
// tiles' partial sums of squares, from which every reader of the normed input normalizes x.
enum Buffer : unsigned { X = 1, SS = 2, Q = 4, PART = 8, ATTN = 16, O = 32, RLOGITS = 64, ROUTE = 128, ACT = 256,
                         MLP = 512, LOGITS = 1024, TOKENS = 2048 };
struct Access {
    unsigned reads, writes;
};
Access access_of(uint8_t op, bool dense) {
    switch (op) {
        case NMK_OP_NORM: return {X | O | MLP | ROUTE, X | SS};
        case NMK_OP_QKV: return {X | SS, Q};
        case NMK_OP_ROUTER: return {X | SS, RLOGITS};
        case NMK_OP_ATTN: return {Q, PART | ATTN};
        case NMK_OP_OPROJ: return {ATTN, O};
        case NMK_OP_GATE_UP: return dense ? Access{X | SS, ACT} : Access{X | SS | RLOGITS, ACT | ROUTE};
        case NMK_OP_DOWN: return {ACT | ROUTE, MLP};
        case NMK_OP_FINAL_NORM: return {X | O | MLP | ROUTE, X | SS};
        case NMK_OP_LM_HEAD: return {X | SS, LOGITS};
        case NMK_OP_ARGMAX: return {LOGITS, TOKENS};
        default: return {0, 0};
    }
}

using Stage = std::pair<int, int>;  // (opcode, layer)
using Key = std::tuple<int, int, int, int, int>;

std::string describe(const nmk_task &t) {
    std::ostringstream s;
    s << "task(op=" << int(t.op) << " layer=" << int(t.layer) << " x=" << t.x << " y=" << t.y << " z=" << t.z
      << " wait=" << t.wait << " target=" << t.target << " signal=" << t.signal << ")";
    return s.str();
}

[[noreturn]] void fail(const std::string &what) { throw std::runtime_error("schedule: " + what); }

// Every task the step needs, exactly as build() names them, with the stages it reads.
struct Expected {
    std::set<Key> tasks;
    std::map<Stage, std::vector<Stage>> producers;
};

Expected expected_tasks(const Geometry &g, const nmk_plan &p, const std::map<Key, int> &attn_splits) {
    Expected e;
    auto need = [&](int op, int l, std::vector<Stage> from) { e.producers[{op, l}] = std::move(from); };
    for (int l = 0; l < g.num_layers; l++) {
        Stage prev_o{NMK_OP_OPROJ, l - 1}, prev_down{NMK_OP_DOWN, l - 1};
        need(NMK_OP_NORM, l, l ? std::vector<Stage>{prev_o, prev_down} : std::vector<Stage>{});
        need(NMK_OP_QKV, l, {{NMK_OP_NORM, l}});
        need(NMK_OP_ATTN, l, {{NMK_OP_QKV, l}});
        need(NMK_OP_OPROJ, l, {{NMK_OP_ATTN, l}});  // after every split, so after every merge
        need(NMK_OP_GATE_UP, l, {{g.dense[l] ? NMK_OP_NORM : NMK_OP_ROUTER, l}});
        need(NMK_OP_DOWN, l, {{NMK_OP_GATE_UP, l}});
        for (int x = 0; x < p.norm_tiles; x++) e.tasks.insert({NMK_OP_NORM, l, x, 0, 0});
        for (int x = 0; x < qkv_tiles(g, p); x++) e.tasks.insert({NMK_OP_QKV, l, x, 0, 0});
        if (!g.dense[l]) {
            need(NMK_OP_ROUTER, l, {{NMK_OP_NORM, l}});
            for (int x = 0; x < p.router_tiles; x++) e.tasks.insert({NMK_OP_ROUTER, l, x, 0, 0});
        }
        for (int y = 0; y < mlp_slots(g, p, l); y++) {
            for (int x = 0; x < gate_up_tiles(g, p, l); x++) e.tasks.insert({NMK_OP_GATE_UP, l, x, y, 0});
            for (int x = 0; x < down_tiles(g, p, l); x++) e.tasks.insert({NMK_OP_DOWN, l, x, y, 0});
        }
        for (int r = 0; r < p.batch; r++)
            for (int h = 0; h < g.num_kv_heads; h++) {
                // Every split of the pair says how many there are: the last to finish merges them all.
                auto it = attn_splits.find({NMK_OP_ATTN, l, r, h, 0});
                int n = it == attn_splits.end() ? 1 : it->second;
                for (int z = 0; z < n; z++) e.tasks.insert({NMK_OP_ATTN, l, r, h, z | (n << 8)});
            }
        for (int x = 0; x < oproj_tiles(g, p); x++) e.tasks.insert({NMK_OP_OPROJ, l, x, 0, 0});
    }
    int last = g.num_layers - 1;
    need(NMK_OP_FINAL_NORM, 0, {{NMK_OP_OPROJ, last}, {NMK_OP_DOWN, last}});
    need(NMK_OP_LM_HEAD, 0, {{NMK_OP_FINAL_NORM, 0}});
    need(NMK_OP_ARGMAX, 0, {{NMK_OP_LM_HEAD, 0}});
    for (int x = 0; x < p.norm_tiles; x++) e.tasks.insert({NMK_OP_FINAL_NORM, 0, x, 0, 0});
    for (int x = 0; x < p.lm_tiles; x++) e.tasks.insert({NMK_OP_LM_HEAD, 0, x, 0, 0});
    for (int r = 0; r < p.batch; r++) e.tasks.insert({NMK_OP_ARGMAX, 0, r, 0, 0});
    return e;
}

void check_fields(const nmk_plan &p, const std::vector<std::vector<nmk_task>> &per_sm) {
    for (const auto &list : per_sm)
        for (const nmk_task &t : list) {
            if (t.op == NMK_OP_COMBINE)
                fail("retired opcode COMBINE (ATTN merges its splits since v0.3) in " + describe(t));
            if (t.op < NMK_OP_NORM || t.op >= NMK_OP_END) fail("unknown opcode in " + describe(t));
            if (t.wait < -1 || t.wait >= p.num_counters || t.signal < -1 || t.signal >= p.num_counters)
                fail("counter out of range in " + describe(t));
            if (t.op == NMK_OP_ATTN) {
                int n = t.z >> 8;
                if (n < 1 || n > p.max_splits || (t.z & 0xff) >= n) fail("bad attention split in " + describe(t));
            }
        }
}

// Each expected task exactly once, nothing else.
void check_coverage(const Expected &e, const std::vector<std::vector<nmk_task>> &per_sm) {
    std::set<Key> seen;
    for (const auto &list : per_sm)
        for (const nmk_task &t : list) {
            Key k{t.op, t.layer, t.x, t.y, t.z};
            if (!e.tasks.count(k)) fail("unexpected " + describe(t));
            if (!seen.insert(k).second) fail("duplicate " + describe(t));
        }
    if (seen.size() != e.tasks.size()) {
        for (const Key &k : e.tasks)
            if (!seen.count(k)) {
                std::ostringstream s;
                s << "missing task op=" << std::get<0>(k) << " layer=" << std::get<1>(k) << " x=" << std::get<2>(k)
                  << " y=" << std::get<3>(k);
                fail(s.str());
            }
    }
}

// Counters: a wait must be for all of its signallers, and they must cover the stages the
// waiting task reads (the slot's own GATE_UP tiles for a DOWN task).
void check_counters(const Expected &e, const nmk_plan &p, const std::vector<std::vector<nmk_task>> &per_sm,
                    std::map<Stage, std::set<Stage>> &edges) {
    std::vector<std::map<Key, int>> signallers(p.num_counters);
    std::map<Key, int> stage_size;  // (op, layer, y or -1)
    for (const auto &list : per_sm)
        for (const nmk_task &t : list) {
            stage_size[{t.op, t.layer, -1, 0, 0}]++;
            stage_size[{t.op, t.layer, t.y, 0, 0}]++;
            if (t.signal >= 0) {
                signallers[t.signal][{t.op, t.layer, -1, 0, 0}]++;
                signallers[t.signal][{t.op, t.layer, t.y, 0, 0}]++;
            }
        }
    for (const auto &list : per_sm)
        for (const nmk_task &t : list) {
            const auto &needed = e.producers.at({t.op, t.layer});
            if (t.wait < 0) {
                if (!needed.empty()) fail("no wait, yet it reads earlier stages: " + describe(t));
                continue;
            }
            uint32_t total = 0;
            for (const auto &[stage, n] : signallers[t.wait])
                if (std::get<2>(stage) == -1) total += n;
            if (t.target != total) fail("target differs from the counter's signallers in " + describe(t));
            for (const Stage &s : needed) {
                int y = t.op == NMK_OP_DOWN ? t.y : -1;
                Key k{s.first, s.second, y, 0, 0};
                auto got = signallers[t.wait].find(k);
                if (got == signallers[t.wait].end() || got->second != stage_size[k])
                    fail("does not wait for all of a stage it reads: " + describe(t));
                edges[s].insert({t.op, t.layer});
            }
            for (const auto &[stage, n] : signallers[t.wait])
                edges[{std::get<0>(stage), std::get<1>(stage)}].insert({t.op, t.layer});
        }
}

// Two stages touching one buffer, one of them writing, must be ordered.
void check_hazards(const Geometry &g, const std::map<Stage, std::set<Stage>> &edges, const std::set<Stage> &stages) {
    std::map<Stage, std::set<Stage>> reach;
    for (const Stage &s : stages) {
        std::vector<Stage> todo{s};
        auto &r = reach[s];
        while (!todo.empty()) {
            Stage u = todo.back();
            todo.pop_back();
            auto it = edges.find(u);
            if (it == edges.end()) continue;
            for (const Stage &v : it->second)
                if (r.insert(v).second) todo.push_back(v);
        }
    }
    for (const Stage &a : stages)
        for (const Stage &b : stages) {
            if (!(a < b)) continue;
            Access x = access_of(a.first, g.dense[a.second]), y = access_of(b.first, g.dense[b.second]);
            bool conflict = (x.writes & (y.reads | y.writes)) || (y.writes & x.reads);
            if (conflict && !reach[a].count(b) && !reach[b].count(a)) {
                std::ostringstream s;
                s << "unordered stages share a buffer: op " << a.first << " layer " << a.second << " and op "
                  << b.first << " layer " << b.second;
                fail(s.str());
            }
        }
}

// Runs the step with every SM taking its next task as soon as it may; all must finish.
void check_progress(const nmk_plan &p, const std::vector<std::vector<nmk_task>> &per_sm) {
    std::vector<uint32_t> counters(p.num_counters, 0);
    std::vector<size_t> next(per_sm.size(), 0);
    for (bool moved = true; moved;) {
        moved = false;
        for (size_t sm = 0; sm < per_sm.size(); sm++)
            while (next[sm] < per_sm[sm].size()) {
                const nmk_task &t = per_sm[sm][next[sm]];
                if (t.wait >= 0 && counters[t.wait] < t.target) break;
                if (t.signal >= 0) counters[t.signal]++;
                next[sm]++;
                moved = true;
            }
    }
    for (size_t sm = 0; sm < per_sm.size(); sm++)
        if (next[sm] < per_sm[sm].size())
            fail("deadlock: SM " + std::to_string(sm) + " never gets past " + describe(per_sm[sm][next[sm]]));
}

}  // namespace

void check_plan(const Geometry &g, const nmk_plan &p) {
    auto need = [](bool ok, const std::string &what) {
        if (!ok) fail("plan: " + what);
    };
    need(p.batch >= 1 && p.batch <= NMK_MK_MAX_BATCH, "batch out of range");
    need(p.max_splits >= 1 && p.max_splits <= NMK_MK_MAX_SPLITS, "max_splits out of range");
    need(p.num_counters >= 0, "num_counters negative");
    need(p.expert_slots == std::min(p.batch * g.top_k, g.num_experts),
         "expert_slots must be min(batch * top_k, experts)");
    need(p.norm_cols == kNormCols && p.norm_tiles == g.hidden / kNormCols,
         "norm_cols must be 128 and norm_tiles hidden / 128");
    need(p.router_rows == kRouterRows && p.router_tiles == (g.num_experts + kRouterRows - 1) / kRouterRows,
         "router_rows must be 16 and router_tiles ceil(experts / 16)");
    const std::tuple<const char *, int, int> tiles[] = {
        {"qkv_rows", p.qkv_rows, kMaxQkvRows}, {"oproj_rows", p.oproj_rows, kMaxOprojRows},
        {"moe_cols", p.moe_cols, kMaxCols}, {"moe_down_rows", p.moe_down_rows, kMaxMoeDownRows},
        {"dense_cols", p.dense_cols, kMaxCols}, {"dense_down_rows", p.dense_down_rows, kMaxDenseDownRows},
        {"lm_rows", p.lm_rows, kMaxLmRows}};
    for (const auto &[name, value, most] : tiles)
        need(value > 0 && value % kTile == 0 && value <= most,
             std::string(name) + " must be a positive multiple of 16 up to " + std::to_string(most) + ", got " +
                 std::to_string(value));
    need(p.lm_tiles == (g.vocab + p.lm_rows - 1) / p.lm_rows, "lm_tiles must be ceil(vocab / lm_rows)");
}

void check(const Geometry &g, const nmk_plan &plan, const std::vector<std::vector<nmk_task>> &per_sm) {
    g.validate();
    check_plan(g, plan);
    check_fields(plan, per_sm);
    std::map<Key, int> attn_splits;
    std::set<Stage> stages;
    for (const auto &list : per_sm)
        for (const nmk_task &t : list) {
            stages.insert({t.op, t.layer});
            if (t.op == NMK_OP_ATTN) attn_splits[{NMK_OP_ATTN, t.layer, t.x, t.y, 0}] = t.z >> 8;
        }
    Expected e = expected_tasks(g, plan, attn_splits);
    check_coverage(e, per_sm);
    std::map<Stage, std::set<Stage>> edges;
    check_counters(e, plan, per_sm, edges);
    check_hazards(g, edges, stages);
    check_progress(plan, per_sm);
}

}  // namespace nmk::schedule
