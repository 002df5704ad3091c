// C ABI of the megakernel (nmk_mk_*): binds weights, owns the step's scratch, caches one
// schedule per (batch, context bucket) and launches one persistent kernel per step.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <memory>
#include <utility>
#include <vector>

#include "internal.hpp"
#include "mk/config.cuh"
#include "mk/kernels.hpp"
#include "schedule/schedule.hpp"

using nmk::mk::bf16;

namespace {

void cuda_check(cudaError_t e, const char *what) {
    if (e != cudaSuccess) throw nmk::Error(NMK_ERR_CUDA, std::string(what) + ": " + cudaGetErrorString(e));
}

template <class T>
T *device_alloc(size_t count, std::vector<void *> &owned) {
    void *p = nullptr;
    cuda_check(cudaMalloc(&p, count * sizeof(T)), "cudaMalloc");
    owned.push_back(p);
    return static_cast<T *>(p);
}

struct DeviceSchedule {
    nmk_plan plan;
    nmk_task *tasks;          // the lists, then the queues
    uint32_t *sm_offsets;
    uint32_t *queue_offsets;
    uint32_t *counters;       // two sets of the counters and the queues' claim heads
    uint64_t launches = 0;    // set launches % 2 is the next launch's; it zeroes the other one
};

// Attention splits are sized for this many keys; a step may see fewer.
int context_bucket(int len) {
    int b = 64;
    while (b < len) b *= 2;
    return b;
}

}  // namespace

struct nmk_mk {
    nmk::schedule::Geometry geometry;
    nmk::mk::Params params{};  // weights and scratch; per-step fields filled by step()
    int device = 0;
    int num_sms = 0;
    int num_groups = 0;  // KV page groups the layers use
    std::vector<void *> owned;
    std::map<std::pair<int, int>, DeviceSchedule> schedules;
    // schedules and owned, which nmk_mk_prepare fills from another thread; a schedule is built
    // outside it (a map entry stays where it is while others are added)
    std::mutex mu;
    cudaStream_t upload = nullptr;  // non-blocking: the uploads wait for no step
    uint64_t launches = 0;  // steps launched: slot table launches % 2 is the next one's

    ~nmk_mk() {
        if (upload) cudaStreamDestroy(upload);
        for (void *p : owned) cudaFree(p);
    }

    DeviceSchedule &schedule_for(int batch, int max_len) {
        auto key = std::make_pair(batch, context_bucket(max_len));
        {
            std::lock_guard<std::mutex> lock(mu);
            auto it = schedules.find(key);
            if (it != schedules.end()) return it->second;
        }
        nmk::schedule::Schedule s =
            nmk::schedule::build(geometry, num_sms, std::vector<int>(batch, key.second));
        nmk::schedule::check(geometry, s.plan, s.per_sm, s.queues);
        const nmk::schedule::FlatSchedule f = nmk::schedule::flatten(s);
        const size_t counters = 2 * static_cast<size_t>(s.plan.num_counters + s.plan.num_queues);
        cuda_check(cudaSetDevice(device), "cudaSetDevice");
        std::vector<void *> mine;
        DeviceSchedule d{};
        try {
            d = DeviceSchedule{s.plan, device_alloc<nmk_task>(f.tasks.size(), mine),
                               device_alloc<uint32_t>(f.sm_offsets.size(), mine),
                               device_alloc<uint32_t>(f.queue_offsets.size(), mine),
                               device_alloc<uint32_t>(counters, mine)};
            auto upload_bytes = [&](void *dst, const void *src, size_t bytes, const char *what) {
                cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, upload), what);
            };
            upload_bytes(d.tasks, f.tasks.data(), f.tasks.size() * sizeof(nmk_task), "copy tasks");
            upload_bytes(d.sm_offsets, f.sm_offsets.data(), f.sm_offsets.size() * sizeof(uint32_t),
                         "copy list offsets");
            upload_bytes(d.queue_offsets, f.queue_offsets.data(), f.queue_offsets.size() * sizeof(uint32_t),
                         "copy queue offsets");
            cuda_check(cudaMemsetAsync(d.counters, 0, counters * sizeof(uint32_t), upload), "zero counters");
            cuda_check(cudaStreamSynchronize(upload), "upload the schedule");
        } catch (...) {
            for (void *p : mine) cudaFree(p);
            throw;
        }
        std::lock_guard<std::mutex> lock(mu);
        auto [it, fresh] = schedules.emplace(key, d);
        if (fresh) owned.insert(owned.end(), mine.begin(), mine.end());
        else for (void *p : mine) cudaFree(p);  // another thread built it meanwhile
        return it->second;
    }
};

namespace {

void bind_layers(nmk_mk &mk, const nmk_mk_geometry &g, const nmk_mk_weights &w) {
    std::vector<nmk::mk::Layer> layers(g.num_layers);
    std::vector<int> per_group(NMK_KV_MAX_GROUPS, 0);
    for (int l = 0; l < g.num_layers; l++) {
        const nmk_mk_layer &s = w.layers[l];
        if (s.kv_group < 0 || s.kv_group >= NMK_KV_MAX_GROUPS || !w.kv_pages[s.kv_group])
            throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, "layer " + std::to_string(l) + ": bad kv_group or no pages");
        per_group[s.kv_group] = std::max(per_group[s.kv_group], s.kv_slot + 1);
        mk.num_groups = std::max(mk.num_groups, s.kv_group + 1);
        bool dense = g.dense[l];
        if (!s.norm || !s.qkv || !s.o || (dense && (!s.gate_up || !s.down)) ||
            (!dense && (!s.router || !s.experts_gate_up || !s.experts_down)))
            throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, "layer " + std::to_string(l) + ": missing weight pointer");
    }
    const int64_t tile = (int64_t)2 * g.num_kv_heads * nmk::mk::kPage * g.head_dim;  // one layer of a page
    for (int l = 0; l < g.num_layers; l++) {
        const nmk_mk_layer &s = w.layers[l];
        nmk::mk::Layer &d = layers[l];
        d.norm = static_cast<const bf16 *>(s.norm);
        d.qkv = static_cast<const bf16 *>(s.qkv);
        d.o = static_cast<const bf16 *>(s.o);
        d.gate_up = static_cast<const bf16 *>(s.gate_up);
        d.down = static_cast<const bf16 *>(s.down);
        d.router = static_cast<const bf16 *>(s.router);
        d.experts_gate_up = static_cast<const bf16 *>(s.experts_gate_up);
        d.experts_down = static_cast<const bf16 *>(s.experts_down);
        d.page_stride = tile * per_group[s.kv_group];
        d.kv = static_cast<bf16 *>(w.kv_pages[s.kv_group]) + tile * s.kv_slot;
        d.group = s.kv_group;
        d.kv_slot = s.kv_slot, d.kv_layers = per_group[s.kv_group];
        d.dense = g.dense[l] != 0, d.sliding = g.sliding[l] != 0, d.rope = g.rope[l] != 0;
    }
    for (int k = 0; k < NMK_KV_MAX_GROUPS; k++) {
        if (!per_group[k]) continue;
        const uint64_t pages = w.kv_num_pages[k];
        // attention's coordinates (page * layers + slot) are int32
        if (pages < 1 || pages * per_group[k] > INT32_MAX)
            throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, "KV group " + std::to_string(k) + ": kv_num_pages " +
                                                           std::to_string(pages) + " is not in [1, " +
                                                           std::to_string(INT32_MAX / per_group[k]) + "]");
        try {
            mk.params.kv_map[k] = nmk::mk::make_kv_map(w.kv_pages[k], pages, per_group[k], g.num_kv_heads,
                                                       nmk::mk::kPage, g.head_dim);
        } catch (const std::runtime_error &e) {
            throw nmk::Error(NMK_ERR_CUDA, e.what());
        }
    }
    std::copy(layers.begin(), layers.end(), mk.params.layers);
}

void alloc_scratch(nmk_mk &mk, const nmk_mk_geometry &g) {
    auto &p = mk.params;
    const size_t B = NMK_MK_MAX_BATCH, H = g.hidden, Q = (size_t)g.num_heads * g.head_dim;
    const size_t slots = nmk::mk::slot_table_words(g.top_k, g.num_experts);
    const size_t group = g.num_heads / g.num_kv_heads;
    p.resid = device_alloc<float>(3 * B * H, mk.owned);
    p.normed_image = device_alloc<bf16>(nmk::mk::in_bytes(static_cast<int>(H)) / sizeof(bf16), mk.owned);
    cuda_check(cudaMemset(p.normed_image, 0, nmk::mk::in_bytes(static_cast<int>(H))), "zero the normed image");
    p.attn_ticket = device_alloc<uint32_t>(B * g.num_kv_heads, mk.owned);
    cuda_check(cudaMemset(p.attn_ticket, 0, B * g.num_kv_heads * sizeof(uint32_t)), "zero attention tickets");
    p.q = device_alloc<float>(B * Q, mk.owned);
    p.part = device_alloc<float>(B * g.num_kv_heads * NMK_MK_MAX_SPLITS * group * (g.head_dim + 2), mk.owned);
    p.attn = device_alloc<bf16>(nmk::mk::in_bytes(static_cast<int>(Q)) / sizeof(bf16), mk.owned);
    cuda_check(cudaMemset(p.attn, 0, nmk::mk::in_bytes(static_cast<int>(Q))), "zero attention output");
    const size_t table = nmk::mk::route_table_words(g.top_k, g.num_experts);
    p.slot_expert = device_alloc<int32_t>(2 * table, mk.owned);  // a table a launch, in turn (nmk_mk_step)
    const size_t act_bytes = slots * nmk::mk::in_bytes(std::max(g.moe_inter, g.dense_inter));
    p.act = device_alloc<bf16>(act_bytes / sizeof(bf16), mk.owned);
    cuda_check(cudaMemset(p.act, 0, act_bytes), "zero activations");
    cuda_check(cudaMemset(p.slot_expert, 0, 2 * table * sizeof(int32_t)), "zero the routing tables (no layer's)");
    p.lm_best = device_alloc<float>(B * (g.vocab / 8 + 1), mk.owned);
    p.lm_best_index = device_alloc<int32_t>(B * (g.vocab / 8 + 1), mk.owned);
}

size_t debug_floats(const nmk::mk::Params &p) {
    return (size_t)(p.num_layers + 1) * NMK_MK_DEBUG_STAGES * NMK_MK_MAX_BATCH * p.hidden;
}

uint64_t debug_bytes(const nmk::mk::Params &p) {
    return debug_floats(p) * sizeof(float) + (uint64_t)p.num_layers * NMK_MK_MAX_BATCH * p.top_k * sizeof(int32_t);
}

void check_geometry(const nmk_mk_geometry &g) {
    auto bad = [](const std::string &m) { throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, m); };
    if (g.head_dim != nmk::mk::kHeadDim) bad("head_dim must be 128");
    if (g.num_heads / g.num_kv_heads > nmk::mk::kMaxGroup) bad("at most 8 query heads per kv head");
    if (g.top_k > nmk::mk::kMaxTopK) bad("top_k must be <= 8");
    if (g.num_experts > 128) bad("at most 128 experts");
    if (g.page_size != nmk::mk::kPage) bad("page_size must be 64");
    if (g.num_heads * g.head_dim > nmk::mk::kMaxK) bad("num_heads * head_dim must be <= 4096");
    if (g.moe_inter % 32 || g.dense_inter % 32) bad("intermediate sizes must be multiples of 32");
    if (std::max(g.moe_inter, g.dense_inter) > nmk::mk::kMaxK) bad("intermediate sizes must be <= 4096");
    if (g.num_layers > nmk::mk::kMaxLayers)
        bad("the megakernel takes at most " + std::to_string(nmk::mk::kMaxLayers) + " layers");
    if (g.hidden % 256 || g.hidden > nmk::mk::kMaxK)
        bad("hidden_size must be a multiple of 256, at most 4096");
}

}  // namespace

extern "C" {

NMK_API nmk_status nmk_mk_create(const nmk_mk_geometry *geometry, const nmk_mk_weights *weights, nmk_mk **out) {
    NMK_REQUIRE(geometry && weights && out && weights->layers, "nmk_mk_create: NULL argument");
    NMK_REQUIRE(weights->embed && weights->final_norm, "nmk_mk_create: embed and final_norm are required");
    return nmk::guard("nmk_mk_create", [&] {
        auto mk = std::make_unique<nmk_mk>();
        try {
            mk->geometry = nmk::schedule::Geometry::from_abi(*geometry);
        } catch (const std::invalid_argument &e) {
            throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, e.what());
        }
        check_geometry(*geometry);
        int device = 0;
        cuda_check(cudaGetDevice(&device), "cudaGetDevice");
        cudaDeviceProp prop{};
        cuda_check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
        if (prop.major != 9) throw nmk::Error(NMK_ERR_UNSUPPORTED, "the megakernel needs an sm_90 (Hopper) GPU");
        int per_sm = 1;
        for (int b = 1; b <= NMK_MK_MAX_BATCH; b++) {
            const void *kernel = nmk::mk::megakernel_for(b);
            cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            nmk::mk::smem_bytes(b)),
                       "cudaFuncSetAttribute");
            int fits = 0;
            cuda_check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fits, kernel, nmk::mk::kThreads,
                                                                     nmk::mk::smem_bytes(b)), "occupancy");
            per_sm = std::min(per_sm, fits);
        }
        if (per_sm < 1) throw nmk::Error(NMK_ERR_UNSUPPORTED, "the megakernel's CTA does not fit on an SM");
        mk->num_sms = prop.multiProcessorCount;
        mk->device = device;
        cuda_check(cudaStreamCreateWithFlags(&mk->upload, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
        auto &p = mk->params;
        p.hidden = geometry->hidden, p.num_layers = geometry->num_layers, p.num_heads = geometry->num_heads;
        p.num_kv_heads = geometry->num_kv_heads, p.num_experts = geometry->num_experts, p.top_k = geometry->top_k;
        p.moe_inter = geometry->moe_inter, p.dense_inter = geometry->dense_inter, p.vocab = geometry->vocab;
        p.sliding_window = geometry->sliding_window, p.rope_theta = geometry->rope_theta;
        p.norm_eps = geometry->norm_eps, p.logit_scale = geometry->logit_scale;
        p.embed = static_cast<const bf16 *>(weights->embed);
        p.final_norm = static_cast<const bf16 *>(weights->final_norm);
        bind_layers(*mk, *geometry, *weights);
        alloc_scratch(*mk, *geometry);
        *out = mk.release();
        return NMK_OK;
    });
}

NMK_API void nmk_mk_destroy(nmk_mk *mk) { delete mk; }

NMK_API nmk_status nmk_mk_num_sms(const nmk_mk *mk, uint32_t *out) {
    NMK_REQUIRE(mk && out, "nmk_mk_num_sms: NULL argument");
    *out = static_cast<uint32_t>(mk->num_sms);
    return NMK_OK;
}

NMK_API nmk_status nmk_mk_debug_bytes(const nmk_mk *mk, uint64_t *out) {
    NMK_REQUIRE(mk && out, "nmk_mk_debug_bytes: NULL argument");
    *out = debug_bytes(mk->params);
    return NMK_OK;
}

NMK_API nmk_status nmk_mk_set_debug(nmk_mk *mk, void *buffer, uint64_t bytes) {
    NMK_REQUIRE(mk, "nmk_mk_set_debug: NULL argument");
    NMK_REQUIRE(!buffer || bytes >= debug_bytes(mk->params), "nmk_mk_set_debug: need %llu bytes, got %llu",
                (unsigned long long)debug_bytes(mk->params), (unsigned long long)bytes);
    auto &p = mk->params;
    p.debug = static_cast<float *>(buffer);
    p.debug_experts = buffer ? reinterpret_cast<int32_t *>(p.debug + debug_floats(p)) : nullptr;
    return NMK_OK;
}

NMK_API nmk_status nmk_mk_set_timing(nmk_mk *mk, uint64_t *buffer, uint32_t capacity) {
    NMK_REQUIRE(mk, "nmk_mk_set_timing: NULL argument");
    NMK_REQUIRE(!buffer || capacity > 0, "nmk_mk_set_timing: capacity must be positive");
    mk->params.timing = buffer;
    mk->params.timing_capacity = buffer ? capacity : 0;
    return NMK_OK;
}

NMK_API nmk_status nmk_mk_prepare(nmk_mk *mk, uint32_t batch, int32_t max_len) {
    NMK_REQUIRE(mk, "nmk_mk_prepare: NULL argument");
    NMK_REQUIRE(batch >= 1 && batch <= NMK_MK_MAX_BATCH, "nmk_mk_prepare: batch must be in [1, %d], got %u",
                NMK_MK_MAX_BATCH, batch);
    NMK_REQUIRE(max_len >= 1, "nmk_mk_prepare: max_len must be >= 1, got %d", max_len);
    return nmk::guard("nmk_mk_prepare", [&] {
        mk->schedule_for(static_cast<int>(batch), max_len);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_mk_step(nmk_mk *mk, const nmk_mk_step_args *a, void *stream) {
    NMK_REQUIRE(mk && a && a->host_positions && a->tokens && a->logits && a->next_tokens,
                "nmk_mk_step: NULL argument");
    NMK_REQUIRE(a->batch >= 1 && a->batch <= NMK_MK_MAX_BATCH, "nmk_mk_step: batch must be in [1, %d], got %u",
                NMK_MK_MAX_BATCH, a->batch);
    int max_len = 0;
    for (uint32_t r = 0; r < a->batch; r++) {
        NMK_REQUIRE(a->host_positions[r] >= 0, "nmk_mk_step: negative position in row %u", r);
        NMK_REQUIRE((uint32_t)(a->host_positions[r] / nmk::mk::kPage) < a->table_cols,
                    "nmk_mk_step: row %u position %d is past the block table (%u pages)", r, a->host_positions[r],
                    a->table_cols);
        max_len = std::max(max_len, a->host_positions[r] + 1);
    }
    for (int g = 0; g < mk->num_groups; g++)
        NMK_REQUIRE(a->block_tables[g], "nmk_mk_step: no block table for KV group %d", g);
    return nmk::guard("nmk_mk_step", [&] {
        DeviceSchedule &s = mk->schedule_for(static_cast<int>(a->batch), max_len);
        nmk::mk::Params p = mk->params;
        p.plan = s.plan;
        p.tasks = s.tasks, p.sm_offsets = s.sm_offsets, p.queue_offsets = s.queue_offsets;
        // Two sets of counters and of slot tables, taken in turn: a launch zeroes the one the launch
        // before it used (the schedule's, for the counters), which the next launch takes.
        const size_t set = static_cast<size_t>(s.plan.num_counters + s.plan.num_queues);
        p.counters = s.counters + (s.launches & 1) * set, p.spare_counters = s.counters + (~s.launches & 1) * set;
        int32_t *const tables = mk->params.slot_expert;
        const size_t table = nmk::mk::route_table_words(p.top_k, p.num_experts);
        p.slot_expert = tables + (mk->launches & 1) * table, p.spare_slot_expert = tables + (~mk->launches & 1) * table;
        p.router_words = reinterpret_cast<uint32_t *>(p.slot_expert + nmk::mk::slot_table_words(p.top_k, p.num_experts));
        p.tokens = a->tokens;
        for (uint32_t r = 0; r < a->batch; r++) p.positions[r] = a->host_positions[r];
        for (int g = 0; g < NMK_KV_MAX_GROUPS; g++) p.tables[g] = a->block_tables[g];
        p.table_cols = static_cast<int>(a->table_cols);
        p.logits = a->logits, p.next_tokens = a->next_tokens;
        auto st = static_cast<cudaStream_t>(stream);
        // The mlp stages are sums of the DOWN tiles' adds (every other stage is written whole).
        if (p.debug)
            cuda_check(cudaMemsetAsync(p.debug, 0, debug_floats(p) * sizeof(float), st), "zero the debug capture");
        void *args[] = {&p};
        const int batch = static_cast<int>(a->batch);
        cuda_check(cudaLaunchKernel(nmk::mk::megakernel_for(batch), dim3(mk->num_sms), dim3(nmk::mk::kThreads), args,
                                    nmk::mk::smem_bytes(batch), st),
                   "megakernel launch");
        s.launches++, mk->launches++;
        return NMK_OK;
    });
}

}  // extern "C"
