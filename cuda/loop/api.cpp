// extern "C" shims of the decode loop.
#include "internal.hpp"
#include "loop/loop.hpp"

#define NMK_REQUIRE_LOOP(loop) NMK_REQUIRE((loop) != nullptr, "%s: loop is NULL", __func__)

extern "C" {

NMK_API nmk_loop_params nmk_loop_default_params(void) {
    nmk_loop_params p{};
    p.max_rows = 8;
    p.ring_capacity = 4096;
    return p;
}

NMK_API nmk_status nmk_loop_create(nmk_kv_pool *pool, const nmk_loop_params *params, nmk_loop **out) {
    NMK_REQUIRE(pool && params && out, "nmk_loop_create: pool, params and out must not be NULL");
    return nmk::guard(__func__, [&] {
        *out = new nmk_loop(*pool, *params);
        return NMK_OK;
    });
}

NMK_API void nmk_loop_destroy(nmk_loop *loop) { delete loop; }

NMK_API int nmk_loop_fd(const nmk_loop *loop) { return loop ? loop->fd() : -1; }

NMK_API nmk_status nmk_loop_get_state(nmk_loop *loop, nmk_loop_state *state, nmk_status *park_status) {
    NMK_REQUIRE_LOOP(loop);
    loop->state(state, park_status);
    return NMK_OK;
}

NMK_API size_t nmk_loop_park_message(nmk_loop *loop, char *buf, size_t size) {
    if (!loop) {
        if (buf && size) buf[0] = '\0';
        return 0;
    }
    return loop->park_message(buf, size);
}

NMK_API nmk_status nmk_loop_request_park(nmk_loop *loop) {
    NMK_REQUIRE_LOOP(loop);
    return nmk::guard(__func__, [&] {
        loop->request_park();
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_loop_park(nmk_loop *loop) {
    NMK_REQUIRE_LOOP(loop);
    return nmk::guard(__func__, [&] {
        loop->park();
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_loop_resume(nmk_loop *loop) {
    NMK_REQUIRE_LOOP(loop);
    return nmk::guard(__func__, [&] {
        loop->resume();
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_loop_drain(nmk_loop *loop, nmk_token_event *out, size_t cap, size_t *n) {
    NMK_REQUIRE_LOOP(loop);
    NMK_REQUIRE(n, "nmk_loop_drain: n is NULL");
    NMK_REQUIRE(out || cap == 0, "nmk_loop_drain: out is NULL but cap is %zu", cap);
    return nmk::guard(__func__, [&] {
        *n = loop->drain(out, cap);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_loop_add_row(nmk_loop *loop, const nmk_loop_row_params *row) {
    NMK_REQUIRE_LOOP(loop);
    NMK_REQUIRE(row, "nmk_loop_add_row: row is NULL");
    return nmk::guard(__func__, [&] {
        loop->add_row(*row);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_loop_remove_row(nmk_loop *loop, uint32_t slot) {
    NMK_REQUIRE_LOOP(loop);
    return nmk::guard(__func__, [&] {
        loop->remove_row(slot);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_loop_row(nmk_loop *loop, uint32_t slot, nmk_loop_row_info *out) {
    NMK_REQUIRE_LOOP(loop);
    NMK_REQUIRE(out, "nmk_loop_row: out is NULL");
    return nmk::guard(__func__, [&] {
        *out = loop->row(slot);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_loop_num_rows(nmk_loop *loop, uint32_t *out) {
    NMK_REQUIRE_LOOP(loop);
    NMK_REQUIRE(out, "nmk_loop_num_rows: out is NULL");
    *out = loop->num_rows();
    return NMK_OK;
}

}  // extern "C"
