// Lays a decode step out as per-SM task lists and per-layer work queues (see schedule.hpp).
#include <algorithm>
#include <stdexcept>

#include "schedule.hpp"

namespace nmk::schedule {
namespace {

int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Units per tile so that `units` spread over about `tasks` tiles; multiples of kTile, at
// most max_tile.
int tile_for(int units, int tasks, int max_tile) {
    int tile = ceil_div(ceil_div(units, tasks), kTile) * kTile;
    return std::clamp(tile, kTile, max_tile);
}

void require(bool ok, const std::string &what) {
    if (!ok) throw std::invalid_argument(what);
}

struct Builder {
    const Geometry &g;
    Schedule s;
    std::vector<uint32_t> signallers;  // per counter
    int cursor = 0;

    Builder(const Geometry &geometry, int num_sms) : g(geometry) { s.per_sm.resize(num_sms); }

    int counter() {
        signallers.push_back(0);
        return static_cast<int>(signallers.size()) - 1;
    }

    // n consecutive counters; returns the first.
    int counters(int n) {
        int first = counter();
        for (int i = 1; i < n; i++) counter();
        return first;
    }

    // A wait on a group of block counters takes one target for all: each must have as many signallers.
    void require_uniform(int first, int n) const {
        for (int i = 1; i < n; i++)
            if (signallers[first + i] != signallers[first])
                throw std::logic_error("the column blocks of a layer's input have different signaller counts");
    }

    nmk_task task(uint8_t op, int layer, int x, int y, int z, int wait, int signal) {
        nmk_task t{op, static_cast<uint8_t>(layer), static_cast<uint16_t>(x), static_cast<uint16_t>(y),
                   static_cast<uint16_t>(z), wait, wait < 0 ? 0u : signallers[wait], signal};
        if (signal >= 0) signallers[signal]++;
        return t;
    }

    // One task on the next SM in turn; it waits for everything that signals `wait`.
    void add(uint8_t op, int layer, int x, int y, int z, int wait, int signal) {
        s.per_sm[cursor].push_back(task(op, layer, x, y, z, wait, signal));
        cursor = (cursor + 1) % s.num_sms();
    }

    // One task at the end of queue q.
    void enqueue(int q, uint8_t op, int layer, int x, int y, int z, int wait, int signal) {
        s.queues[q].push_back(task(op, layer, x, y, z, wait, signal));
    }

    // Tasks made by task() (their counters already wired), at the end of queue q in order.
    void enqueue(int q, std::vector<nmk_task>::const_iterator first, std::vector<nmk_task>::const_iterator last) {
        s.queues[q].insert(s.queues[q].end(), first, last);
    }

    // A new queue, drained by every SM at this point of its list; returns its index.
    int drain(int layer) {
        int q = static_cast<int>(s.queues.size());
        s.queues.emplace_back();
        for (auto &list : s.per_sm) list.push_back(nmk_task{NMK_OP_DRAIN, static_cast<uint8_t>(layer),
                                                            static_cast<uint16_t>(q), 0, 0, -1, 0u, -1});
        return q;
    }
};

int splits_for(int keys, int page_size, int pages_per_split) {
    int pages = ceil_div(keys, page_size);
    return std::clamp(ceil_div(pages, pages_per_split), 1, static_cast<int>(NMK_MK_MAX_SPLITS));
}

// Pages per attention split. One layer's splits of all rows take a share of the SMs in
// proportion to their bytes against the MLP weights that stream beside them (the keys and
// values of every row's live pages against the layer's expert slots or dense MLP), and at
// least half of them: up to ~36K keys a row at batch 1 the experts outweigh attention and
// the splits fill half the SMs (attention alone draws ~3 TB/s from DRAM at batch 8); at
// longer contexts attention's share grows, so that the splits end about when the experts do
// (benchmarks/NOTES.md, session 26). And at least
// kMinSplitPages: a split's fixed work (its first page's round trips, queries, partials,
// ticket, signal: ~6.5 us at batch 1 in session 14; ~1.7 us past its bytes' time at 30 GB/s an
// SM in session 53) is worth several pages of its loop (0.74 us a page in session 14), so the
// SMs' summed time favours long splits, and attention's chain (QKV, the splits, the merge,
// o-proj), which ends the layer at batch 1, favours short ones. 12 pages from session 14 (10
// level in session 37); 10 since the routing got shorter and attention's chain with it holds
// the layer (session 51, batch 1 against 12: 10 +0.6%, 8, 9 and 11 +0.3-0.5%, 14 -0.9%;
// benchmarks/NOTES.md).
int pages_per_split(const Geometry &g, const nmk_plan &p, int num_sms, const std::vector<int> &lens, int layer) {
    constexpr double kBf16 = 2;  // bytes
    int work = 0;  // (page, kv head) pairs
    for (int len : lens) work += ceil_div(keys_seen(g, layer, len), g.page_size) * g.num_kv_heads;
    const double kv_bytes = 2 * kBf16 * work * g.page_size * g.head_dim;  // keys and values
    const int inter = g.dense[layer] ? g.dense_inter : g.moe_inter;
    const double mlp_bytes = 3 * kBf16 * mlp_slots(g, p, layer) * g.hidden * inter;  // gate, up, down
    const int share = std::max(num_sms / 2, static_cast<int>(num_sms * kv_bytes / (kv_bytes + mlp_bytes)));
    return std::max(kMinSplitPages, ceil_div(work, std::max(1, share)));
}

// Adds layer l's tasks. Its input's column blocks (kBlockCols hidden columns each) have a
// counter each, `input` the first: layer 0's NORM tiles signal them, and from layer 1 on the
// previous layer's o-proj and DOWN tiles, each the block its rows fall in. Layer 0's ROUTER and
// QKV tiles go to the lists; a later layer's at the end of the previous layer's queue (after its
// o-proj tiles), so that SMs free in that layer's tail take them while its last tiles run, and
// up to kStagedMaxBatch rows they stream each block of their input as soon as its counter is
// complete (the kernel's gemv_normed). The ROUTER tiles come before the QKV tiles: the routing
// starts the expert phase. Then the DRAIN of the layer's queue, which gets its GATE_UP, ATTN,
// DOWN and OPROJ tasks. Returns the first block counter of the next layer's input.
// A queue per layer, although from layer 1 on every list's DRAINs follow one another: the ~1.1
// us from a drain running dry to the next one's first task is slack. One queue for the whole
// step removed it and measured -0.5% at batch 1 (the SMs reached the GATE_UP tiles sooner, to
// wait there for the routing beside the last QKV tiles); a drain that claims the next queue's
// first task as it runs dry measured -1.5% (benchmarks/NOTES.md, session 42).
int add_layer(Builder &b, int l, int input, const std::vector<int> &lens, int num_sms) {
    const Geometry &g = b.g;
    const nmk_plan &p = b.s.plan;
    const int blocks = g.hidden / kBlockCols;
    if (l == 0) {
        input = b.counters(blocks);
        for (int x = 0; x < p.norm_tiles; x++)
            b.add(NMK_OP_NORM, l, x, 0, 0, -1, input + x * p.norm_cols / kBlockCols);
    }
    b.require_uniform(input, blocks);
    int qkv = b.counter(), attn = b.counter();
    int routed = g.dense[l] ? input : b.counter();
    int next = b.counters(blocks);

    if (l == 0) {
        if (!g.dense[l])
            for (int x = 0; x < p.router_tiles; x++) b.add(NMK_OP_ROUTER, l, x, 0, 0, input, routed);
        for (int x = 0; x < qkv_tiles(g, p); x++) b.add(NMK_OP_QKV, l, x, 0, 0, input, qkv);
    } else {
        const int prev = static_cast<int>(b.s.queues.size()) - 1;
        if (!g.dense[l])
            for (int x = 0; x < p.router_tiles; x++) b.enqueue(prev, NMK_OP_ROUTER, l, x, 0, 0, input, routed);
        for (int x = 0; x < qkv_tiles(g, p); x++) b.enqueue(prev, NMK_OP_QKV, l, x, 0, 0, input, qkv);
    }
    int q = b.drain(l);

    // The attention splits go in after the first num_sms - splits expert tiles: the SMs that
    // reach the queue once QKV is done (most of them) start attention at once, the rest keep
    // streaming experts, and OPROJ's input is ready while DOWN still runs.
    std::vector<int> slot_ready;
    std::vector<nmk_task> gate_up;
    for (int y = 0; y < mlp_slots(g, p, l); y++) {
        slot_ready.push_back(b.counter());
        for (int x = 0; x < gate_up_tiles(g, p, l); x++)
            gate_up.push_back(b.task(NMK_OP_GATE_UP, l, x, y, 0, routed, slot_ready[y]));
    }
    std::vector<nmk_task> splits;
    int pps = pages_per_split(g, p, num_sms, lens, l);
    for (int r = 0; r < p.batch; r++) {
        int n = splits_for(keys_seen(g, l, lens[r]), g.page_size, pps);
        for (int h = 0; h < g.num_kv_heads; h++)
            for (int z = 0; z < n; z++) splits.push_back(b.task(NMK_OP_ATTN, l, r, h, z | (n << 8), qkv, attn));
    }
    const int free_sms = std::max(0, num_sms - static_cast<int>(splits.size()));
    const size_t lead = std::min(gate_up.size(), static_cast<size_t>(free_sms));
    b.enqueue(q, gate_up.cbegin(), gate_up.cbegin() + lead);
    b.enqueue(q, splits.cbegin(), splits.cend());
    b.enqueue(q, gate_up.cbegin() + lead, gate_up.cend());
    const int down_rows = g.dense[l] ? p.dense_down_rows : p.moe_down_rows;
    for (int y = 0; y < mlp_slots(g, p, l); y++)
        for (int x = 0; x < down_tiles(g, p, l); x++)
            b.enqueue(q, NMK_OP_DOWN, l, x, y, 0, slot_ready[y], next + x * down_rows / kBlockCols);
    for (int x = 0; x < oproj_tiles(g, p); x++)
        b.enqueue(q, NMK_OP_OPROJ, l, x, 0, 0, attn, next + x * p.oproj_rows / kBlockCols);
    return next;
}

// Rows per tile of a stage whose tiles signal the column block their rows fall in: tile_for's,
// rounded up to a power of two (at most kBlockCols), which divides the block.
int block_tile(int units, int tasks, int max_tile) {
    int tile = tile_for(units, tasks, max_tile), pow2 = kTile;
    while (pow2 < tile) pow2 *= 2;
    return std::min(pow2, std::min(max_tile, kBlockCols));
}

nmk_plan make_plan(const Geometry &g, int num_sms, const std::vector<int> &lens) {
    nmk_plan p{};
    p.batch = static_cast<int>(lens.size());
    p.expert_slots = std::min(p.batch * g.top_k, g.num_experts);
    p.norm_cols = kNormCols;
    p.norm_tiles = g.hidden / kNormCols;
    p.qkv_rows = tile_for((g.num_heads + 2 * g.num_kv_heads) * g.head_dim, num_sms, kMaxQkvRows);
    p.router_rows = kRouterRows;
    p.router_tiles = ceil_div(g.num_experts, kRouterRows);
    p.oproj_rows = block_tile(g.hidden, num_sms, kMaxOprojRows);
    // Expert tiles for 1.5x the SMs: attention takes SMs while the expert phase runs, and the
    // tiles left for a second round are then small (batch 1: 32 columns, not 48).
    p.moe_cols = tile_for(p.expert_slots * g.moe_inter, num_sms * 3 / 2, kMaxCols);
    p.moe_down_rows = block_tile(p.expert_slots * g.hidden, num_sms, kMaxMoeDownRows);
    p.dense_cols = tile_for(g.dense_inter, num_sms, kMaxCols);
    p.dense_down_rows = block_tile(g.hidden, num_sms, kMaxDenseDownRows);
    p.lm_rows = tile_for(g.vocab, 4 * num_sms, kMaxLmRows);
    p.lm_tiles = ceil_div(g.vocab, p.lm_rows);
    return p;
}

}  // namespace

void Geometry::validate() const {
    require(hidden > 0 && hidden % 256 == 0, "hidden_size must be a positive multiple of 256");
    require(num_layers > 0 && num_layers <= 255, "num_layers must be in [1, 255]");
    require(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
            "num_heads must be a positive multiple of num_kv_heads");
    require(head_dim == 128, "head_dim must be 128");
    require(num_heads / num_kv_heads <= 8, "at most 8 query heads per kv head");
    require(num_experts > 0 && num_experts <= 128 && top_k > 0 && top_k <= 8 && top_k <= num_experts,
            "need 1 <= top_k <= 8 and top_k <= num_experts <= 128");
    require(moe_inter > 0 && moe_inter % 32 == 0, "intermediate_size must be a positive multiple of 32");
    require(dense_inter > 0 && dense_inter % 32 == 0, "dense intermediate size must be a positive multiple of 32");
    require(num_heads * head_dim <= kMaxGemvInput,
            "num_heads * head_dim must be at most 4096 (the widest GEMV input the megakernel stages)");
    require(hidden <= kMaxGemvInput && moe_inter <= kMaxGemvInput && dense_inter <= kMaxGemvInput,
            "hidden_size and the intermediate sizes must be at most 4096 (the widest GEMV input the megakernel "
            "stages)");
    require(vocab > 0, "vocab_size must be positive");
    require(page_size == 64, "page_size must be 64");
    require(static_cast<int>(dense.size()) == num_layers && static_cast<int>(sliding.size()) == num_layers,
            "need a dense and a sliding flag per layer");
    bool any_sliding = std::any_of(sliding.begin(), sliding.end(), [](uint8_t s) { return s != 0; });
    require(!any_sliding || sliding_window > 0, "sliding_window must be positive when a layer slides");
}

Geometry Geometry::from_abi(const nmk_mk_geometry &a) {
    Geometry g;
    g.hidden = a.hidden;
    g.num_layers = a.num_layers;
    g.num_heads = a.num_heads;
    g.num_kv_heads = a.num_kv_heads;
    g.head_dim = a.head_dim;
    g.num_experts = a.num_experts;
    g.top_k = a.top_k;
    g.moe_inter = a.moe_inter;
    g.dense_inter = a.dense_inter;
    g.vocab = a.vocab;
    g.sliding_window = a.sliding_window;
    g.page_size = a.page_size;
    require(a.num_layers > 0 && a.num_layers <= 255, "num_layers must be in [1, 255]");
    require(a.dense && a.sliding && a.rope, "geometry needs dense, sliding and rope flags per layer");
    g.dense.assign(a.dense, a.dense + a.num_layers);
    g.sliding.assign(a.sliding, a.sliding + a.num_layers);
    g.validate();
    return g;
}

size_t Schedule::num_tasks() const {
    size_t n = 0;
    for (const auto &list : per_sm) n += list.size();
    for (const auto &queue : queues) n += queue.size();
    return n;
}

FlatSchedule flatten(const Schedule &s) {
    FlatSchedule f;
    f.tasks.reserve(s.num_tasks());
    f.sm_offsets.push_back(0);
    for (const auto &list : s.per_sm) {
        f.tasks.insert(f.tasks.end(), list.begin(), list.end());
        f.sm_offsets.push_back(static_cast<uint32_t>(f.tasks.size()));
    }
    f.queue_offsets.push_back(static_cast<uint32_t>(f.tasks.size()));
    for (const auto &queue : s.queues) {
        f.tasks.insert(f.tasks.end(), queue.begin(), queue.end());
        f.queue_offsets.push_back(static_cast<uint32_t>(f.tasks.size()));
    }
    return f;
}

bool block_waiter(const Geometry &g, int op, int layer) {
    return waits_on_blocks(op, [&] { return layer < g.num_layers && g.dense[layer]; });
}
int wait_span(const Geometry &g, const nmk_task &t) {
    return t.wait < 0 ? 0 : block_waiter(g, t.op, t.layer) ? g.hidden / kBlockCols : 1;
}

int qkv_tiles(const Geometry &g, const nmk_plan &p) {
    return ceil_div((g.num_heads + 2 * g.num_kv_heads) * g.head_dim, p.qkv_rows);
}
int oproj_tiles(const Geometry &g, const nmk_plan &p) { return ceil_div(g.hidden, p.oproj_rows); }
int mlp_slots(const Geometry &g, const nmk_plan &p, int layer) { return g.dense[layer] ? 1 : p.expert_slots; }
int gate_up_tiles(const Geometry &g, const nmk_plan &p, int layer) {
    return g.dense[layer] ? ceil_div(g.dense_inter, p.dense_cols) : ceil_div(g.moe_inter, p.moe_cols);
}
int down_tiles(const Geometry &g, const nmk_plan &p, int layer) {
    return ceil_div(g.hidden, g.dense[layer] ? p.dense_down_rows : p.moe_down_rows);
}
int keys_seen(const Geometry &g, int layer, int context_len) {
    return g.sliding[layer] ? std::min(context_len, g.sliding_window) : context_len;
}

Schedule build(const Geometry &g, int num_sms, const std::vector<int> &context_lens) {
    g.validate();
    require(num_sms > 0, "num_sms must be positive");
    int batch = static_cast<int>(context_lens.size());
    require(batch >= 1 && batch <= NMK_MK_MAX_BATCH, "batch must be in [1, NMK_MK_MAX_BATCH]");
    for (int len : context_lens) require(len >= 1, "every context length must be >= 1");

    Builder b(g, num_sms);
    b.s.plan = make_plan(g, num_sms, context_lens);
    int done = -1;  // the first block counter of the LM head's input
    for (int l = 0; l < g.num_layers; l++) done = add_layer(b, l, done, context_lens, num_sms);
    b.require_uniform(done, g.hidden / kBlockCols);
    int logits = b.counter();
    for (int x = 0; x < b.s.plan.lm_tiles; x++) b.add(NMK_OP_LM_HEAD, 0, x, 0, 0, done, logits);
    for (int r = 0; r < batch; r++) b.add(NMK_OP_ARGMAX, 0, r, 0, 0, logits, -1);

    int max_splits = 1;
    for (const auto &queue : b.s.queues)
        for (const nmk_task &t : queue)
            if (t.op == NMK_OP_ATTN) max_splits = std::max(max_splits, t.z >> 8);
    b.s.plan.max_splits = max_splits;
    b.s.plan.num_counters = static_cast<int>(b.signallers.size());
    b.s.plan.num_queues = static_cast<int>(b.s.queues.size());
    return b.s;
}

}  // namespace nmk::schedule
