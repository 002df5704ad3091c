// C ABI of the task schedule: nmk_schedule_* (see include/northmk.h).
#include "internal.hpp"
#include "schedule/schedule.hpp"

struct nmk_schedule {
    nmk::schedule::Schedule schedule;
    std::vector<nmk_task> tasks;        // per-SM lists, concatenated
    std::vector<uint32_t> sm_offsets;   // [num_sms + 1]
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
        s->sm_offsets.push_back(0);
        for (const auto &list : s->schedule.per_sm) {
            s->tasks.insert(s->tasks.end(), list.begin(), list.end());
            s->sm_offsets.push_back(static_cast<uint32_t>(s->tasks.size()));
        }
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
    *tasks = schedule->tasks.data();
    *sm_offsets = schedule->sm_offsets.data();
    *num_sms = static_cast<uint32_t>(schedule->schedule.per_sm.size());
    return NMK_OK;
}

NMK_API nmk_status nmk_schedule_check(const nmk_mk_geometry *geometry, const nmk_plan *plan,
                                      const nmk_task *tasks, const uint32_t *sm_offsets, uint32_t num_sms) {
    NMK_REQUIRE(geometry && plan && tasks && sm_offsets, "nmk_schedule_check: NULL argument");
    NMK_REQUIRE(num_sms >= 1, "nmk_schedule_check: num_sms must be >= 1");
    return nmk::guard("nmk_schedule_check", [&] {
        auto g = geometry_of(geometry);
        std::vector<std::vector<nmk_task>> per_sm(num_sms);
        for (uint32_t s = 0; s < num_sms; s++) {
            if (sm_offsets[s + 1] < sm_offsets[s]) throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, "sm_offsets decrease");
            per_sm[s].assign(tasks + sm_offsets[s], tasks + sm_offsets[s + 1]);
        }
        try {
            nmk::schedule::check(g, *plan, per_sm);
        } catch (const std::runtime_error &e) {
            throw nmk::Error(NMK_ERR_INVALID_ARGUMENT, e.what());
        }
        return NMK_OK;
    });
}

}  // extern "C"
