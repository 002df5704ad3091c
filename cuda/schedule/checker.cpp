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

// Buffers of the step that stages share; each stage's reads, writes and adds. RES0..2: the
// residual sums, layer l's input in RES(l % 3), which layer l's o-proj and DOWN tiles add into
// for layer l + 1 (adds commute: two stages adding into one buffer need no order between them)
// and whose o-proj tiles zero for layer l + 2; NIMG: the normed input's image that a layer's
// routing tile (its last ROUTER tile) writes for the sparse GATE_UP tasks; ROUTE: the routing that
// the routing tile publishes.
enum Buffer : unsigned { RES0 = 1, RES1 = 2, RES2 = 4, Q = 8, PART = 16, ATTN = 32, RLOGITS = 64, ROUTE = 128,
                         ACT = 256, LOGITS = 1024, TOKENS = 2048, NIMG = 4096 };
unsigned res(int l) { return RES0 << (l % 3); }
struct Access {
    unsigned reads, writes, adds = 0;
};
Access access_of(const Geometry &g, uint8_t op, int l) {
    switch (op) {
        case NMK_OP_NORM: return {0, res(0) | res(1)};
        case NMK_OP_QKV: return {res(l), Q};
        case NMK_OP_ROUTER: return {res(l), RLOGITS | NIMG | ROUTE};
        case NMK_OP_ATTN: return {Q, PART | ATTN};
        case NMK_OP_OPROJ: return {ATTN | res(l), res(l + 2), res(l + 1)};
        case NMK_OP_GATE_UP: return g.dense[l] ? Access{res(l), ACT} : Access{res(l) | NIMG | ROUTE, ACT};
        case NMK_OP_DOWN: return {ACT | ROUTE, 0, res(l + 1)};
        case NMK_OP_LM_HEAD: return {res(g.num_layers), LOGITS};
        case NMK_OP_ARGMAX: return {LOGITS | res(g.num_layers), TOKENS};  // the debug capture's x
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

// One task where it lives: entry pos of SM list `owner`, or task pos of queue `owner`.
struct Entry {
    const nmk_task *t;
    bool queued;
    int owner, pos;
};

std::string where(const Entry &e) {
    return (e.queued ? "queue " : "SM ") + std::to_string(e.owner) + " #" + std::to_string(e.pos);
}
std::string describe(const Entry &e) { return where(e) + " " + describe(*e.t); }

// The schedule as the checks read it: every entry of the lists and queues, the tasks (all but
// DRAIN entries) and where each list drains each queue.
struct View {
    const TaskLists &per_sm, &queues;
    std::vector<Entry> tasks;
    std::vector<std::vector<int>> drain_at;  // [sm][queue]: position of DRAIN(queue), -1 if none

    View(const TaskLists &lists, const TaskLists &qs) : per_sm(lists), queues(qs) {
        for (size_t s = 0; s < per_sm.size(); s++)
            for (size_t k = 0; k < per_sm[s].size(); k++)
                if (per_sm[s][k].op != NMK_OP_DRAIN) tasks.push_back({&per_sm[s][k], false, int(s), int(k)});
        for (size_t q = 0; q < queues.size(); q++)
            for (size_t i = 0; i < queues[q].size(); i++) tasks.push_back({&queues[q][i], true, int(q), int(i)});
    }
};

// Every task the step needs, exactly as build() names them, with the stages it reads.
struct Expected {
    std::set<Key> tasks;
    std::map<Stage, std::vector<Stage>> producers;
};

Expected expected_tasks(const Geometry &g, const nmk_plan &p, const std::map<Key, int> &attn_splits) {
    Expected e;
    auto need = [&](int op, int l, std::vector<Stage> from) { e.producers[{op, l}] = std::move(from); };
    // The stages whose outputs make layer l's input: the embedding (layer 0's NORM), or every
    // o-proj and DOWN tile of layer l - 1.
    auto input_of = [](int l) {
        if (l == 0) return std::vector<Stage>{{NMK_OP_NORM, 0}};
        return std::vector<Stage>{{NMK_OP_OPROJ, l - 1}, {NMK_OP_DOWN, l - 1}};
    };
    need(NMK_OP_NORM, 0, {});
    for (int x = 0; x < p.norm_tiles; x++) e.tasks.insert({NMK_OP_NORM, 0, x, 0, 0});
    for (int l = 0; l < g.num_layers; l++) {
        need(NMK_OP_QKV, l, input_of(l));
        need(NMK_OP_ATTN, l, {{NMK_OP_QKV, l}});
        need(NMK_OP_OPROJ, l, {{NMK_OP_ATTN, l}});  // after every split, so after every merge
        need(NMK_OP_GATE_UP, l, g.dense[l] ? input_of(l) : std::vector<Stage>{{NMK_OP_ROUTER, l}});
        need(NMK_OP_DOWN, l, {{NMK_OP_GATE_UP, l}});
        for (int x = 0; x < qkv_tiles(g, p); x++) e.tasks.insert({NMK_OP_QKV, l, x, 0, 0});
        if (!g.dense[l]) {
            need(NMK_OP_ROUTER, l, input_of(l));
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
    need(NMK_OP_LM_HEAD, 0, input_of(g.num_layers));
    need(NMK_OP_ARGMAX, 0, {{NMK_OP_LM_HEAD, 0}});
    for (int x = 0; x < p.lm_tiles; x++) e.tasks.insert({NMK_OP_LM_HEAD, 0, x, 0, 0});
    for (int r = 0; r < p.batch; r++) e.tasks.insert({NMK_OP_ARGMAX, 0, r, 0, 0});
    return e;
}

void check_task_fields(const Geometry &g, const nmk_plan &p, const Entry &e) {
    const nmk_task &t = *e.t;
    if (t.op == NMK_OP_COMBINE)
        fail("retired opcode COMBINE (ATTN merges its splits since v0.3) in " + describe(e));
    if (t.op == NMK_OP_FINAL_NORM)
        fail("retired opcode FINAL_NORM (the LM head normalizes the last layer's sums since v0.5) in " + describe(e));
    if (t.op < NMK_OP_NORM || t.op >= NMK_OP_END) fail("unknown opcode in " + describe(e));
    if (t.op == NMK_OP_DRAIN) {
        if (e.queued) fail("DRAIN inside a queue (queues hold ordinary tasks only): " + describe(e));
        if (t.x >= p.num_queues)
            fail("DRAIN of unknown queue " + std::to_string(t.x) + " (plan.num_queues = " +
                 std::to_string(p.num_queues) + "): " + describe(e));
        if (t.y || t.z || t.wait != -1 || t.target || t.signal != -1)
            fail("DRAIN must have y = z = 0, wait = -1, target = 0 and signal = -1: " + describe(e));
    }
    if (t.wait < -1 || t.wait + std::max(1, wait_span(g, t)) > p.num_counters || t.signal < -1 ||
        t.signal >= p.num_counters)
        fail("counter out of range in " + describe(e) +
             (wait_span(g, t) > 1 ? " (it waits on " + std::to_string(wait_span(g, t)) + " block counters)" : ""));
    if (t.op == NMK_OP_ATTN) {
        int n = t.z >> 8;
        if (n < 1 || n > p.max_splits || (t.z & 0xff) >= n) fail("bad attention split in " + describe(e));
    }
}

// Fields in range; well-formed DRAIN entries, exactly one per queue in every list.
void check_fields(const Geometry &g, const nmk_plan &p, View &v) {
    v.drain_at.assign(v.per_sm.size(), std::vector<int>(p.num_queues, -1));
    for (size_t s = 0; s < v.per_sm.size(); s++)
        for (size_t k = 0; k < v.per_sm[s].size(); k++) {
            const nmk_task &t = v.per_sm[s][k];
            check_task_fields(g, p, {&t, false, int(s), int(k)});
            if (t.op != NMK_OP_DRAIN) continue;
            int &at = v.drain_at[s][t.x];
            if (at >= 0)
                fail("SM " + std::to_string(s) + "'s list drains queue " + std::to_string(t.x) + " twice (#" +
                     std::to_string(at) + " and #" + std::to_string(k) + "); every list holds one DRAIN per queue");
            at = int(k);
        }
    for (size_t s = 0; s < v.per_sm.size(); s++)
        for (int q = 0; q < p.num_queues; q++)
            if (v.drain_at[s][q] < 0)
                fail("SM " + std::to_string(s) + "'s list has no DRAIN of queue " + std::to_string(q) +
                     "; every list holds one DRAIN per queue");
    for (size_t q = 0; q < v.queues.size(); q++)
        for (size_t i = 0; i < v.queues[q].size(); i++)
            check_task_fields(g, p, {&v.queues[q][i], true, int(q), int(i)});
}

// Each expected task exactly once across lists and queues, nothing else.
void check_coverage(const Expected &e, const View &v) {
    std::map<Key, const Entry *> seen;
    for (const Entry &en : v.tasks) {
        const nmk_task &t = *en.t;
        Key k{t.op, t.layer, t.x, t.y, t.z};
        if (!e.tasks.count(k)) fail("unexpected " + describe(en));
        auto [it, fresh] = seen.emplace(k, &en);
        if (!fresh) fail("duplicate " + describe(en) + ", also at " + where(*it->second));
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

// The counters a task waits on: wait_span of them from its wait.
std::vector<int> waited(const Geometry &g, const nmk_task &t) {
    std::vector<int> c(wait_span(g, t));
    for (size_t i = 0; i < c.size(); i++) c[i] = t.wait + int(i);
    return c;
}

// The hidden columns [lo, hi) of a layer's input (or the last layer's output) that a task
// writes or adds into: NORM, OPROJ, DOWN tiles; none (lo = hi = 0) for the others.
std::pair<int, int> input_columns(const Geometry &g, const nmk_plan &p, const nmk_task &t) {
    int rows = t.op == NMK_OP_NORM    ? p.norm_cols
               : t.op == NMK_OP_OPROJ ? p.oproj_rows
               : t.op == NMK_OP_DOWN  ? (g.dense[t.layer] ? p.dense_down_rows : p.moe_down_rows)
                                      : 0;
    return {t.x * rows, std::min(g.hidden, (t.x + 1) * rows)};
}

// Counters: a wait must be for all of its signallers, and they must cover the stages the
// waiting task reads (the slot's own GATE_UP tiles for a DOWN task). A block waiter's counters
// each need the same number of signallers, and each is signalled by writers of the stages the
// task reads, all of whose columns lie in its block: reading a block once its own counter is
// complete then reads only finished sums (the kernel's QKV and ROUTER tiles up to
// NMK_MK_POST_SCALED_MAX_BATCH rows do).
void check_counters(const Geometry &g, const Expected &e, const nmk_plan &p, const View &v,
                    std::map<Stage, std::set<Stage>> &edges) {
    std::vector<std::map<Key, int>> signallers(p.num_counters);
    std::vector<std::vector<const Entry *>> signalled_by(p.num_counters);
    std::map<Key, int> stage_size;  // (op, layer, y or -1)
    for (const Entry &en : v.tasks) {
        const nmk_task &t = *en.t;
        stage_size[{t.op, t.layer, -1, 0, 0}]++;
        stage_size[{t.op, t.layer, t.y, 0, 0}]++;
        if (t.signal >= 0) {
            signallers[t.signal][{t.op, t.layer, -1, 0, 0}]++;
            signallers[t.signal][{t.op, t.layer, t.y, 0, 0}]++;
            signalled_by[t.signal].push_back(&en);
        }
    }
    for (const Entry &en : v.tasks) {
        const nmk_task &t = *en.t;
        const auto &needed = e.producers.at({t.op, t.layer});
        if (t.wait < 0) {
            if (!needed.empty()) fail("no wait, yet it reads earlier stages: " + describe(en));
            continue;
        }
        const std::vector<int> counters = waited(g, t);
        const bool blocks = counters.size() > 1 || block_waiter(g, t.op, t.layer);
        std::map<Key, int> covered;  // signallers over the task's counters, per stage key
        for (size_t b = 0; b < counters.size(); b++) {
            const int c = counters[b];
            uint32_t total = 0;
            for (const auto &[stage, n] : signallers[c])
                if (std::get<2>(stage) == -1) total += n, covered[stage] += n;
                else covered[stage] += n;
            if (t.target != total)
                fail("target differs from the signallers of counter " + std::to_string(c) + " in " + describe(en));
            if (!blocks) continue;
            const int lo = int(b) * kBlockCols, hi = lo + kBlockCols;
            for (const Entry *w : signalled_by[c]) {
                const Stage ws{w->t->op, w->t->layer};
                if (std::find(needed.begin(), needed.end(), ws) == needed.end())
                    fail("block counter " + std::to_string(c) + " (columns " + std::to_string(lo) + ".." +
                         std::to_string(hi) + ") of " + describe(en) + " is signalled by " + describe(*w) +
                         ", which does not write the input it reads");
                const auto [c0, c1] = input_columns(g, p, *w->t);
                if (c0 < lo || c1 > hi || c0 >= c1)
                    fail("block counter " + std::to_string(c) + " (columns " + std::to_string(lo) + ".." +
                         std::to_string(hi) + ") of " + describe(en) + " is signalled by " + describe(*w) +
                         ", which writes columns " + std::to_string(c0) + ".." + std::to_string(c1));
            }
        }
        for (const Stage &s : needed) {
            int y = t.op == NMK_OP_DOWN ? t.y : -1;
            Key k{s.first, s.second, y, 0, 0};
            auto got = covered.find(k);
            if (got == covered.end() || got->second != stage_size[k])
                fail("does not wait for all of a stage it reads: " + describe(en));
            edges[s].insert({t.op, t.layer});
        }
        for (int c : counters)
            for (const auto &[stage, n] : signallers[c])
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
            Access x = access_of(g, a.first, a.second), y = access_of(g, b.first, b.second);
            bool conflict = (x.writes & (y.reads | y.writes | y.adds)) || (y.writes & (x.reads | x.adds)) ||
                            (x.adds & y.reads) || (y.adds & x.reads);
            if (conflict && !reach[a].count(b) && !reach[b].count(a)) {
                std::ostringstream s;
                s << "unordered stages share a buffer: op " << a.first << " layer " << a.second << " and op "
                  << b.first << " layer " << b.second;
                fail(s.str());
            }
        }
}

// The named cases of the must-finish-before rule (schedule.hpp): what a queue task may wait
// on, and where a list task waiting on a queue must stand.
void check_queue_waits(const Geometry &g, const nmk_plan &p, const View &v) {
    // Per counter: the last list position of a signaller per SM, the last index per queue.
    std::vector<std::map<int, int>> in_list(p.num_counters), in_queue(p.num_counters);
    for (const Entry &en : v.tasks) {
        if (en.t->signal < 0) continue;
        int &last = (en.queued ? in_queue : in_list)[en.t->signal].try_emplace(en.owner, en.pos).first->second;
        last = std::max(last, en.pos);
    }
    auto signaller = [&](bool queued, int owner, int pos) {
        const nmk_task &t = (queued ? v.queues : v.per_sm)[owner][pos];
        return describe(Entry{&t, queued, owner, pos});
    };
    for (const Entry &en : v.tasks)
        for (int c : waited(g, *en.t)) {
            // formatted only for a failure: every waiting task passes through here
            auto waiter = [&] {
                return "may deadlock: " + describe(en) + " waits on counter " + std::to_string(c) + ", which ";
            };
            if (!en.queued) {
                for (const auto &[q, i] : in_queue[c])
                    if (v.drain_at[en.owner][q] > en.pos)
                        fail(waiter() + signaller(true, q, i) + " signals, yet it comes before DRAIN(" +
                             std::to_string(q) + ") in its list");
                continue;
            }
            int q = en.owner;
            for (const auto &[s, k] : in_list[c])
                if (k > v.drain_at[s][q])
                    fail(waiter() + signaller(false, s, k) + " signals after DRAIN(" + std::to_string(q) +
                         ") in its list");
            for (const auto &[q2, i] : in_queue[c]) {
                if (q2 == q) {
                    if (i >= en.pos) fail(waiter() + signaller(true, q2, i) + " signals, not earlier in the queue");
                    continue;
                }
                for (size_t s = 0; s < v.per_sm.size(); s++)
                    if (v.drain_at[s][q2] > v.drain_at[s][q])
                        fail(waiter() + signaller(true, q2, i) + " signals, but DRAIN(" + std::to_string(q2) +
                             ") comes after DRAIN(" + std::to_string(q) + ") in SM " + std::to_string(s) + "'s list");
            }
        }
}

// The must-finish-before relation (schedule.hpp) must be acyclic. Nodes: list entries, queue
// tasks, counters (a counter stands for all of its signallers).
void check_acyclic(const Geometry &g, const nmk_plan &p, const View &v) {
    std::vector<int> list_base, queue_base;
    int n = 0;
    for (const auto &list : v.per_sm) list_base.push_back(n), n += int(list.size());
    for (const auto &queue : v.queues) queue_base.push_back(n), n += int(queue.size());
    const int counter_base = n;
    n += p.num_counters;
    std::vector<std::vector<int>> out(n), in(n);
    auto edge = [&](int a, int b) { out[a].push_back(b), in[b].push_back(a); };
    // (v): each layer's routing tile (its ROUTER tile x = router_tiles - 1) and its other tiles
    std::map<int, int> routing_node;
    std::map<int, std::vector<int>> router_nodes;
    auto task_edges = [&](int node, const nmk_task &t) {
        if (t.op == NMK_OP_ROUTER) {
            if (t.x == p.router_tiles - 1) routing_node[t.layer] = node;
            else router_nodes[t.layer].push_back(node);
        }
        for (int c : waited(g, t)) edge(counter_base + c, node);
        if (t.signal >= 0) edge(node, counter_base + t.signal);
    };
    for (size_t s = 0; s < v.per_sm.size(); s++)
        for (size_t k = 0; k < v.per_sm[s].size(); k++) {
            int node = list_base[s] + int(k);
            const nmk_task &t = v.per_sm[s][k];
            if (k) edge(node - 1, node);
            task_edges(node, t);
            if (t.op == NMK_OP_DRAIN && !v.queues[t.x].empty()) {
                if (k) edge(node - 1, queue_base[t.x]);
                edge(queue_base[t.x] + int(v.queues[t.x].size()) - 1, node);
            }
        }
    for (size_t q = 0; q < v.queues.size(); q++)
        for (size_t i = 0; i < v.queues[q].size(); i++) {
            int node = queue_base[q] + int(i);
            if (i) edge(node - 1, node);
            task_edges(node, v.queues[q][i]);
        }
    for (const auto &[layer, nodes] : router_nodes)
        if (auto it = routing_node.find(layer); it != routing_node.end())
            for (int u : nodes) edge(u, it->second);
    // Kahn's order; whatever it cannot reach lies on or behind a cycle.
    std::vector<int> pending(n), ready;
    for (int u = 0; u < n; u++)
        if (!(pending[u] = int(in[u].size()))) ready.push_back(u);
    int done = 0;
    while (!ready.empty()) {
        int u = ready.back();
        ready.pop_back();
        done++;
        for (int w : out[u])
            if (!--pending[w]) ready.push_back(w);
    }
    if (done == n) return;
    // Walk back along unfinished predecessors until a node repeats: it lies on a cycle. Report
    // the shortest cycle through it (breadth first among the unfinished nodes).
    int u = int(std::find_if(pending.begin(), pending.end(), [](int c) { return c > 0; }) - pending.begin());
    std::vector<char> walked(n, 0);
    while (!walked[u]) {
        walked[u] = 1;
        u = *std::find_if(in[u].begin(), in[u].end(), [&](int a) { return pending[a] > 0; });
    }
    std::vector<int> from(n, -1), frontier{u};
    for (size_t i = 0; i < frontier.size() && from[u] < 0; i++)
        for (int w : out[frontier[i]])
            if (pending[w] > 0 && from[w] < 0) {
                from[w] = frontier[i];
                frontier.push_back(w);
            }
    std::vector<int> cycle{u};
    for (int w = from[u]; w != u; w = from[w]) cycle.push_back(w);
    std::reverse(cycle.begin() + 1, cycle.end());  // u, then in must-finish-before order
    auto queue_of = [&](int node) {
        if (queue_base.empty() || node < queue_base[0] || node >= counter_base) return -1;
        return int(std::upper_bound(queue_base.begin(), queue_base.end(), node) - queue_base.begin()) - 1;
    };
    auto name = [&](int node) -> std::string {
        if (node >= counter_base) return "counter " + std::to_string(node - counter_base);
        int q = queue_of(node);
        if (q >= 0) return describe(Entry{&v.queues[q][node - queue_base[q]], true, q, node - queue_base[q]});
        int s = int(std::upper_bound(list_base.begin(), list_base.end(), node) - list_base.begin()) - 1;
        return describe(Entry{&v.per_sm[s][node - list_base[s]], false, s, node - list_base[s]});
    };
    cycle.push_back(u);
    std::vector<std::string> steps;
    for (size_t i = 0; i < cycle.size(); i++) {
        size_t j = i;  // a run along one queue's order prints as its ends
        while (j + 1 < cycle.size() && queue_of(cycle[j]) >= 0 && queue_of(cycle[j + 1]) == queue_of(cycle[j]) &&
               cycle[j + 1] == cycle[j] + 1)
            j++;
        steps.push_back(name(cycle[i]));
        if (j > i + 1) steps.push_back("(queue " + std::to_string(queue_of(cycle[i])) + " in order)");
        if (j > i) steps.push_back(name(cycle[j]));
        i = j;
    }
    std::string what = "deadlock possible under some claim order: a cycle of must-finish-before: ";
    for (size_t i = 0; i < steps.size(); i++) {
        if (steps.size() > 16 && i == 8) {
            what += "... -> ";
            i = steps.size() - 8;
        }
        what += steps[i] + (i + 1 < steps.size() ? " -> " : "");
    }
    fail(what);
}

// Runs the step with every SM taking its next task as soon as it may; an SM at DRAIN(q)
// claims the next task of q and holds it until it can run, and an SM at the list task before
// a DRAIN(q) claims q's next task as it reaches it (the kernel's run_list). All must finish.
void check_progress(const Geometry &g, const nmk_plan &p, const View &v) {
    std::vector<uint32_t> counters(p.num_counters, 0);
    std::vector<size_t> next(v.per_sm.size(), 0), head(v.queues.size(), 0);
    std::vector<long> held(v.per_sm.size(), -1);  // claimed task of the queue the SM drains
    std::map<int, int> routers_done;                 // per layer: its ROUTER tiles finished
    auto runnable = [&](const nmk_task &t) {
        // a layer's routing tile polls its other ROUTER tiles' logits
        if (t.op == NMK_OP_ROUTER && t.x == p.router_tiles - 1 && routers_done[t.layer] < p.router_tiles - 1)
            return false;
        for (int c : waited(g, t))
            if (counters[c] < t.target) return false;
        return true;
    };
    auto finish = [&](const nmk_task &t) {
        if (t.signal >= 0) counters[t.signal]++;
        if (t.op == NMK_OP_ROUTER) routers_done[t.layer]++;
    };
    for (bool moved = true; moved;) {
        moved = false;
        for (size_t sm = 0; sm < v.per_sm.size(); sm++)
            while (next[sm] < v.per_sm[sm].size()) {
                const nmk_task &t = v.per_sm[sm][next[sm]];
                if (t.op == NMK_OP_DRAIN) {
                    const auto &queue = v.queues[t.x];
                    if (held[sm] < 0) {
                        if (head[t.x] == queue.size()) {
                            next[sm]++;
                            moved = true;
                            continue;
                        }
                        held[sm] = long(head[t.x]++);
                        moved = true;
                    }
                    if (!runnable(queue[held[sm]])) break;
                    finish(queue[held[sm]]);
                    held[sm] = -1;
                    continue;
                }
                if (held[sm] < 0 && next[sm] + 1 < v.per_sm[sm].size()) {
                    const nmk_task &after = v.per_sm[sm][next[sm] + 1];
                    if (after.op == NMK_OP_DRAIN && head[after.x] < v.queues[after.x].size()) {
                        held[sm] = long(head[after.x]++);
                        moved = true;
                    }
                }
                if (!runnable(t)) break;
                finish(t);
                next[sm]++;
                moved = true;
            }
    }
    for (size_t sm = 0; sm < v.per_sm.size(); sm++) {
        if (next[sm] == v.per_sm[sm].size()) continue;
        const nmk_task &t = v.per_sm[sm][next[sm]];
        std::string stuck = t.op == NMK_OP_DRAIN
                                ? describe(Entry{&v.queues[t.x][held[sm]], true, t.x, int(held[sm])}) +
                                      ", claimed at its DRAIN(" + std::to_string(t.x) + ")"
                                : describe(Entry{&t, false, int(sm), int(next[sm])});
        fail("deadlock: SM " + std::to_string(sm) + " never gets past " + stuck);
    }
}

}  // namespace

void check_plan(const Geometry &g, const nmk_plan &p) {
    auto need = [](bool ok, const std::string &what) {
        if (!ok) fail("plan: " + what);
    };
    need(p.batch >= 1 && p.batch <= NMK_MK_MAX_BATCH, "batch out of range");
    need(p.max_splits >= 1 && p.max_splits <= NMK_MK_MAX_SPLITS, "max_splits out of range");
    need(p.num_counters >= 0, "num_counters negative");
    need(p.num_queues >= 0 && p.num_queues <= 65536, "num_queues must be in [0, 65536] (a DRAIN names its queue in x)");
    need(p.expert_slots == std::min(p.batch * g.top_k, g.num_experts),
         "expert_slots must be min(batch * top_k, experts)");
    need(p.norm_cols == kNormCols && p.norm_tiles == g.hidden / kNormCols,
         "norm_cols must be 32 and norm_tiles hidden / 32");
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
    // a writer of a layer's input signals the counter of its column block: its tile lies in one
    const std::pair<const char *, int> writers[] = {
        {"oproj_rows", p.oproj_rows}, {"moe_down_rows", p.moe_down_rows}, {"dense_down_rows", p.dense_down_rows}};
    for (const auto &[name, value] : writers)
        need(kBlockCols % value == 0, std::string(name) + " must divide NMK_MK_BLOCK_COLS (" +
                                          std::to_string(kBlockCols) + "), got " + std::to_string(value));
}

void check(const Geometry &g, const nmk_plan &plan, const TaskLists &per_sm, const TaskLists &queues) {
    g.validate();
    check_plan(g, plan);
    if (static_cast<int>(queues.size()) != plan.num_queues)
        fail("plan.num_queues is " + std::to_string(plan.num_queues) + " but " + std::to_string(queues.size()) +
             " queues were given");
    View v(per_sm, queues);
    check_fields(g, plan, v);
    std::map<Key, int> attn_splits;
    std::set<Stage> stages;
    for (const Entry &e : v.tasks) {
        stages.insert({e.t->op, e.t->layer});
        if (e.t->op == NMK_OP_ATTN) attn_splits[{NMK_OP_ATTN, e.t->layer, e.t->x, e.t->y, 0}] = e.t->z >> 8;
    }
    Expected e = expected_tasks(g, plan, attn_splits);
    check_coverage(e, v);
    std::map<Stage, std::set<Stage>> edges;
    check_counters(g, e, plan, v, edges);
    check_hazards(g, edges, stages);
    check_queue_waits(g, plan, v);
    check_acyclic(g, plan, v);
    check_progress(g, plan, v);
}

}  // namespace nmk::schedule
