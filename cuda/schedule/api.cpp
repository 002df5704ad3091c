// C ABI of the task schedule: nmk_schedule_* (see include/northmk.h).
#include "internal.hpp"
#include "schedule/schedule.hpp"

struct nmk_schedule {
    nmk::schedule::Schedule schedule;
    nmk::schedule::FlatSchedule flat;  // the lists, then the queues, in one array
};

namespace {

nmk::schedule::Geometry geometry_of(const nmk_mk_geometry *g) {
    try {
        return nmk::schedule::Geometry::from_abi(*g);
    } catch (const std::invalid_argument &e) {
        throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, e.what());
    }
}

}  // namespace

extern "C" {

NMK_API nmk_status nmk_schedule_create(const nmk_mk_geometry *geometry, uint32_t num_sms,
                                       const int32_t *context_lens, uint32_t batch, nmk_schedule **out) {
    NMK_REQUIRE(geometry && context_lens && out, "nmk_schedule_create: NULL argument");
    NMK_REQUIRE(num_sms >= 1 && num_sms <= 4096, "nmk_schedule_create: num_sms must be in [1, 4096], got %u", num_sms);
    NMK_REQUIRE(batch >= 1 && batch <= NMK_MK_MAX_BATCH, "nmk_schedule_create: batch must be in [1, %d], got %u",
                NMK_MK_MAX_BATCH, batch);
    return nmk::guard("nmk_schedule_create", [&] {
        auto g = geometry_of(geometry);
        auto s = std::make_unique<nmk_schedule>();
        try {
            s->schedule = nmk::schedule::build(g, static_cast<int>(num_sms),
                                               std::vector<int>(context_lens, context_lens + batch));
        } catch (const std::invalid_argument &e) {
            throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, e.what());
        }
        s->flat = nmk::schedule::flatten(s->schedule);
        *out = s.release();
        return NMK_OK;
    });
}

NMK_API void nmk_schedule_destroy(nmk_schedule *schedule) { delete schedule; }

NMK_API nmk_status nmk_schedule_plan(const nmk_schedule *schedule, nmk_plan *out) {
    NMK_REQUIRE(schedule && out, "nmk_schedule_plan: NULL argument");
    *out = schedule->schedule.plan;
    return NMK_OK;
}

NMK_API nmk_status nmk_schedule_tasks(const nmk_schedule *schedule, const nmk_task **tasks,
                                      const uint32_t **sm_offsets, uint32_t *num_sms) {
    NMK_REQUIRE(schedule && tasks && sm_offsets && num_sms, "nmk_schedule_tasks: NULL argument");
    *tasks = schedule->flat.tasks.data();
    *sm_offsets = schedule->flat.sm_offsets.data();
    *num_sms = static_cast<uint32_t>(schedule->schedule.per_sm.size());
    return NMK_OK;
}

NMK_API nmk_status nmk_schedule_queues(const nmk_schedule *schedule, const uint32_t **queue_offsets,
                                       uint32_t *num_queues) {
    NMK_REQUIRE(schedule && queue_offsets && num_queues, "nmk_schedule_queues: NULL argument");
    *queue_offsets = schedule->flat.queue_offsets.data();
    *num_queues = static_cast<uint32_t>(schedule->schedule.queues.size());
    return NMK_OK;
}

// Both rules ask a GATE_UP task whether its layer is dense: one past the layer table is refused
// by name (not read past the table, nor taken for a sparse layer).
static void check_gate_up_layer(const nmk::schedule::Geometry &g, const nmk_task &t, size_t i) {
    if (t.op == NMK_OP_GATE_UP && t.layer >= g.num_layers)
        throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, "task " + std::to_string(i) + ": a GATE_UP of layer " +
                                                       std::to_string(t.layer) + " of " + std::to_string(g.num_layers));
}

NMK_API nmk_status nmk_schedule_wait_spans(const nmk_mk_geometry *geometry, const nmk_task *tasks, size_t count,
                                           uint32_t *spans) {
    NMK_REQUIRE(geometry && ((tasks && spans) || count == 0), "nmk_schedule_wait_spans: NULL argument");
    return nmk::guard("nmk_schedule_wait_spans", [&] {
        auto g = geometry_of(geometry);
        for (size_t i = 0; i < count; i++) {
            check_gate_up_layer(g, tasks[i], i);
            spans[i] = static_cast<uint32_t>(nmk::schedule::wait_span(g, tasks[i]));
        }
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_schedule_waits_in_run(const nmk_mk_geometry *geometry, uint32_t batch, const nmk_task *tasks,
                                             size_t count, uint8_t *inside) {
    NMK_REQUIRE(geometry && ((tasks && inside) || count == 0), "nmk_schedule_waits_in_run: NULL argument");
    NMK_REQUIRE(batch >= 1 && batch <= NMK_MK_MAX_BATCH, "nmk_schedule_waits_in_run: batch must be in [1, %d], got %u",
                NMK_MK_MAX_BATCH, batch);
    return nmk::guard("nmk_schedule_waits_in_run", [&] {
        auto g = geometry_of(geometry);
        for (size_t i = 0; i < count; i++) {
            const nmk_task &t = tasks[i];
            check_gate_up_layer(g, t, i);
            inside[i] = nmk::schedule::waits_in_run(t.op, static_cast<int>(batch), t.wait >= 0,
                                                    [&] { return g.dense[t.layer] != 0; });
        }
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_schedule_check(const nmk_mk_geometry *geometry, const nmk_plan *plan,
                                      const nmk_task *tasks, const uint32_t *sm_offsets, uint32_t num_sms,
                                      const uint32_t *queue_offsets) {
    NMK_REQUIRE(geometry && plan && tasks && sm_offsets, "nmk_schedule_check: NULL argument");
    NMK_REQUIRE(num_sms >= 1, "nmk_schedule_check: num_sms must be >= 1");
    NMK_REQUIRE(plan->num_queues >= 0 && plan->num_queues <= 65536,
                "nmk_schedule_check: plan->num_queues must be in [0, 65536], got %d", plan->num_queues);
    NMK_REQUIRE(queue_offsets || plan->num_queues == 0,
                "nmk_schedule_check: queue_offsets is NULL but plan->num_queues is %d", plan->num_queues);
    return nmk::guard("nmk_schedule_check", [&] {
        auto g = geometry_of(geometry);
        auto bad = [](const std::string &what) { throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, what); };
        if (sm_offsets[0] != 0) bad("sm_offsets[0] must be 0");
        nmk::schedule::TaskLists per_sm(num_sms), queues(plan->num_queues);
        for (uint32_t s = 0; s < num_sms; s++) {
            if (sm_offsets[s + 1] < sm_offsets[s]) bad("sm_offsets decrease at SM " + std::to_string(s));
            per_sm[s].assign(tasks + sm_offsets[s], tasks + sm_offsets[s + 1]);
        }
        if (queue_offsets && queue_offsets[0] != sm_offsets[num_sms])
            bad("queue_offsets[0] must equal sm_offsets[num_sms] (the queues follow the lists), got " +
                std::to_string(queue_offsets[0]) + " and " + std::to_string(sm_offsets[num_sms]));
        for (int q = 0; q < plan->num_queues; q++) {
            if (queue_offsets[q + 1] < queue_offsets[q]) bad("queue_offsets decrease at queue " + std::to_string(q));
            queues[q].assign(tasks + queue_offsets[q], tasks + queue_offsets[q + 1]);
        }
        try {
            nmk::schedule::check(g, *plan, per_sm, queues);
        } catch (const std::runtime_error &e) {
            throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, e.what());
        }
        return NMK_OK;
    });
}

}  // extern "C"
