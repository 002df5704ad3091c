/* The decode loop through the C ABI, driven by a C step function. */
#define _POSIX_C_SOURCE 200809L
#include <poll.h>
#include <pthread.h>
#include <string.h>

#include "check.h"

enum { PS = 4, MAX_LEN = 32, MAX_EVENTS = 256 };

/* Next token = input token + 1; logprob = -position. Fails at step `fail_at` when >= 0. */
typedef struct {
    int calls;
    int fail_at;
    int missing_pages;
} stepper;

static pthread_mutex_t calls_mu = PTHREAD_MUTEX_INITIALIZER; /* calls is read while the loop runs */

static int calls(stepper *s) {
    int n;
    pthread_mutex_lock(&calls_mu);
    n = s->calls;
    pthread_mutex_unlock(&calls_mu);
    return n;
}

static int step(void *user, const nmk_step_batch *batch, nmk_step_result *result) {
    stepper *s = (stepper *)user;
    uint32_t i;
    pthread_mutex_lock(&calls_mu);
    s->calls++;
    pthread_mutex_unlock(&calls_mu);
    if (s->fail_at >= 0 && batch->step == (uint64_t)s->fail_at) return NMK_ERR_CUDA;
    for (i = 0; i < batch->num_rows; ++i) {
        const int32_t *row = batch->block_tables[0] + (size_t)batch->slots[i] * batch->max_pages_per_seq;
        if (row[batch->positions[i] / PS] < 0) s->missing_pages++;
        result->tokens[i] = batch->tokens[i] + 1;
        result->logprobs[i] = -(float)batch->positions[i];
    }
    return NMK_OK;
}

typedef struct {
    nmk_token_event events[MAX_EVENTS];
    size_t n;
} collected;

static void drain(nmk_loop *loop, collected *c) {
    size_t n;
    CHECK_OK(nmk_loop_drain(loop, c->events + c->n, MAX_EVENTS - c->n, &n));
    c->n += n;
}

/* Waits on the fd, draining, until the loop is parked; returns the park status. */
static nmk_status wait_parked(nmk_loop *loop, collected *c) {
    nmk_loop_state state;
    nmk_status status;
    struct pollfd pfd;
    for (;;) {
        pfd.fd = nmk_loop_fd(loop);
        pfd.events = POLLIN;
        CHECK(poll(&pfd, 1, 5000) == 1);
        CHECK_OK(nmk_loop_get_state(loop, &state, &status)); /* before draining: nothing follows a park */
        drain(loop, c);
        if (state == NMK_LOOP_PARKED) return status;
    }
}

static int count_row(const collected *c, uint32_t slot) {
    int k = 0;
    size_t i;
    for (i = 0; i < c->n; ++i) k += c->events[i].slot == slot;
    return k;
}

static nmk_kv_pool *make_pool(uint32_t pages) {
    nmk_kv_pool *pool = NULL;
    nmk_kv_pool_params p = nmk_kv_pool_default_params();
    p.num_pages[0] = pages;
    p.page_size = PS;
    p.max_seq_len = MAX_LEN;
    p.max_rows = 4;
    CHECK_OK(nmk_kv_pool_create(&p, &pool));
    return pool;
}

static nmk_seq_id make_seq(nmk_kv_pool *pool, size_t len) {
    int32_t tokens[MAX_LEN] = {0};
    nmk_seq_id seq;
    CHECK_OK(nmk_kv_seq_create(pool, NULL, 0, &seq, NULL));
    CHECK_OK(nmk_kv_seq_append(pool, seq, tokens, len));
    return seq;
}

static nmk_loop *make_loop(nmk_kv_pool *pool, stepper *s) {
    nmk_loop *loop = NULL;
    nmk_loop_params p = nmk_loop_default_params();
    p.max_rows = 4;
    p.ring_capacity = 8;
    p.step = step;
    p.step_user = s;
    CHECK_OK(nmk_loop_create(pool, &p, &loop));
    return loop;
}

static nmk_loop_row_params row_params(uint32_t slot, nmk_seq_id seq, int32_t last, uint32_t budget) {
    nmk_loop_row_params r;
    memset(&r, 0, sizeof r);
    r.slot = slot, r.seq = seq, r.last_token = last, r.max_new_tokens = budget;
    return r;
}

static void test_rows_finish_on_stop_and_budget(void) {
    nmk_kv_pool *pool = make_pool(16);
    stepper s = {0, -1, 0};
    nmk_loop *loop = make_loop(pool, &s);
    nmk_seq_id a = make_seq(pool, 5), b = make_seq(pool, 2);
    int32_t stop = 13;
    nmk_loop_row_params ra = row_params(0, a, 10, 5), rb = row_params(2, b, 100, 3);
    nmk_loop_row_info info;
    nmk_loop_state state;
    nmk_status status;
    collected c = {{{0}}, 0};
    uint32_t rows;
    size_t len;
    char msg[64];

    CHECK(nmk_loop_fd(loop) >= 0);
    CHECK_OK(nmk_loop_get_state(loop, &state, &status));
    CHECK(state == NMK_LOOP_PARKED && status == NMK_OK);
    ra.stop_token_ids = &stop, ra.num_stop_token_ids = 1;
    CHECK_OK(nmk_loop_add_row(loop, &ra));
    CHECK_OK(nmk_loop_add_row(loop, &rb));
    CHECK_STATUS(nmk_loop_add_row(loop, &rb), NMK_ERR_BAD_STATE);
    rb.slot = 9;
    CHECK_STATUS(nmk_loop_add_row(loop, &rb), NMK_ERR_INVALID_ARGUMENT);
    CHECK_OK(nmk_loop_num_rows(loop, &rows));
    CHECK(rows == 2);
    CHECK_OK(nmk_loop_row(loop, 0, &info));
    CHECK(info.seq == a && info.position == 5 && info.remaining == 5 && info.generated == 0);

    CHECK_OK(nmk_loop_resume(loop));
    CHECK_STATUS(nmk_loop_resume(loop), NMK_ERR_BAD_STATE);
    CHECK_STATUS(nmk_loop_add_row(loop, &ra), NMK_ERR_BAD_STATE);
    while (count_row(&c, 0) < 3 || count_row(&c, 2) < 3) {
        struct pollfd pfd = {0, POLLIN, 0};
        pfd.fd = nmk_loop_fd(loop);
        CHECK(poll(&pfd, 1, 5000) == 1);
        drain(loop, &c);
    }
    CHECK_OK(nmk_loop_park(loop));
    CHECK_OK(nmk_loop_park(loop)); /* already parked: no-op */
    drain(loop, &c);
    CHECK(c.n == 6 && s.missing_pages == 0);
    CHECK(c.events[0].slot == 0 && c.events[0].token == 11 && c.events[0].logprob == -5.0f);
    CHECK(c.events[0].seq == a && c.events[0].flags == 0);
    CHECK(c.events[4].token == 13 && c.events[4].flags == (NMK_TOKEN_FINISHED | NMK_TOKEN_STOP));
    CHECK(c.events[5].token == 103 && c.events[5].flags == (NMK_TOKEN_FINISHED | NMK_TOKEN_LENGTH));
    CHECK_OK(nmk_loop_get_state(loop, &state, &status));
    CHECK(state == NMK_LOOP_PARKED && status == NMK_OK);
    CHECK(nmk_loop_park_message(loop, msg, sizeof msg) == 0);

    /* The finished row stays, idle; the sampled stop token is not in the KV. */
    CHECK_OK(nmk_loop_row(loop, 0, &info));
    CHECK(info.generated == 3 && info.remaining == 2 && info.last_token == 13 && info.position == 8);
    CHECK(info.flags == (NMK_TOKEN_FINISHED | NMK_TOKEN_STOP));
    CHECK_OK(nmk_kv_seq_length(pool, a, &len));
    CHECK(len == 8);
    CHECK_OK(nmk_loop_remove_row(loop, 0));
    CHECK_STATUS(nmk_loop_remove_row(loop, 0), NMK_ERR_NOT_FOUND);
    CHECK_STATUS(nmk_loop_row(loop, 0, &info), NMK_ERR_NOT_FOUND);
    CHECK_OK(nmk_kv_seq_free(pool, a));
    nmk_loop_destroy(loop); /* unbinds slot 2 */
    CHECK_OK(nmk_kv_seq_free(pool, b));
    nmk_kv_pool_destroy(pool);
}

static void test_step_failure_parks_and_rolls_back(void) {
    nmk_kv_pool *pool = make_pool(16);
    stepper s = {0, 2, 0};
    nmk_loop *loop = make_loop(pool, &s);
    nmk_seq_id a = make_seq(pool, 3);
    nmk_loop_row_params ra = row_params(0, a, 1, 10);
    collected c = {{{0}}, 0};
    char msg[128];
    size_t len;
    nmk_kv_usage u;

    CHECK_OK(nmk_loop_add_row(loop, &ra));
    CHECK_OK(nmk_loop_resume(loop));
    CHECK(wait_parked(loop, &c) == NMK_ERR_STEP_FAILED);
    CHECK(c.n == 2); /* steps 0 and 1 published; step 2 failed */
    CHECK(nmk_loop_park_message(loop, msg, sizeof msg) > 0 && strstr(msg, "NMK_ERR_CUDA") != NULL);
    CHECK_OK(nmk_kv_seq_length(pool, a, &len));
    CHECK(len == 5); /* position 5's append was undone */
    CHECK_OK(nmk_kv_pool_usage(pool, 0, &u));
    CHECK(u.used == 2);

    s.fail_at = -1; /* retry: continues from the same position */
    CHECK_OK(nmk_loop_resume(loop));
    while (c.n < 10) {
        struct pollfd pfd = {0, POLLIN, 0};
        pfd.fd = nmk_loop_fd(loop);
        CHECK(poll(&pfd, 1, 5000) == 1);
        drain(loop, &c);
    }
    CHECK(c.events[2].token == 4 && c.events[2].logprob == -5.0f);
    CHECK(c.events[9].flags == (NMK_TOKEN_FINISHED | NMK_TOKEN_LENGTH));
    nmk_loop_destroy(loop);
    nmk_kv_pool_destroy(pool);
}

static void test_no_space_parks_until_pages_return(void) {
    nmk_kv_pool *pool = make_pool(3);
    stepper s = {0, -1, 0};
    nmk_loop *loop = make_loop(pool, &s);
    nmk_seq_id a = make_seq(pool, 4), hog = make_seq(pool, 4);
    nmk_loop_row_params ra = row_params(1, a, 1, 20);
    collected c = {{{0}}, 0};
    char msg[128];

    CHECK_OK(nmk_loop_add_row(loop, &ra));
    CHECK_OK(nmk_loop_resume(loop));
    CHECK(wait_parked(loop, &c) == NMK_ERR_NO_SPACE); /* positions 4..7 fit in the third page */
    CHECK(c.n == 4);
    CHECK(nmk_loop_park_message(loop, msg, sizeof msg) > 0 && strstr(msg, "needs 1 pages") != NULL);
    CHECK_OK(nmk_kv_seq_free(pool, hog));
    CHECK_OK(nmk_loop_resume(loop));
    CHECK(wait_parked(loop, &c) == NMK_ERR_NO_SPACE);
    CHECK(c.n == 8 && c.events[4].token == 6);
    nmk_loop_destroy(loop);
    nmk_kv_pool_destroy(pool);
}

static void test_min_tokens_and_max_seq_len(void) {
    nmk_kv_pool *pool = make_pool(16);
    stepper s = {0, -1, 0};
    nmk_loop *loop = make_loop(pool, &s);
    nmk_seq_id a = make_seq(pool, 1), b = make_seq(pool, MAX_LEN - 2);
    int32_t stops[2] = {2, 3};
    nmk_loop_row_params ra = row_params(0, a, 1, 10), rb = row_params(1, b, 50, 10);
    collected c = {{{0}}, 0};
    ra.stop_token_ids = stops, ra.num_stop_token_ids = 2, ra.min_new_tokens = 2;
    CHECK_OK(nmk_loop_add_row(loop, &ra));
    CHECK_OK(nmk_loop_add_row(loop, &rb));
    CHECK_OK(nmk_loop_resume(loop));
    while (count_row(&c, 0) < 2 || count_row(&c, 1) < 2) {
        struct pollfd pfd = {0, POLLIN, 0};
        pfd.fd = nmk_loop_fd(loop);
        CHECK(poll(&pfd, 1, 5000) == 1);
        drain(loop, &c);
    }
    CHECK_OK(nmk_loop_park(loop));
    drain(loop, &c);
    CHECK(c.n == 4);
    CHECK(c.events[0].token == 2 && c.events[0].flags == 0); /* stop ignored before min_new_tokens */
    CHECK(c.events[2].token == 3 && c.events[2].flags == (NMK_TOKEN_FINISHED | NMK_TOKEN_STOP));
    CHECK(c.events[3].token == 52 && c.events[3].flags == (NMK_TOKEN_FINISHED | NMK_TOKEN_LENGTH));
    nmk_loop_destroy(loop);
    nmk_kv_pool_destroy(pool);
}

static void test_request_park_and_partial_drain(void) {
    nmk_kv_pool *pool = make_pool(16);
    stepper s = {0, -1, 0};
    nmk_loop *loop = make_loop(pool, &s);
    nmk_seq_id a = make_seq(pool, 1);
    nmk_loop_row_params ra = row_params(0, a, 1, 8);
    nmk_loop_params bad = nmk_loop_default_params();
    nmk_loop *other = NULL;
    nmk_token_event ev[3];
    collected c = {{{0}}, 0};
    size_t n;
    struct pollfd pfd = {0, POLLIN, 0};

    CHECK_STATUS(nmk_loop_create(pool, &bad, &other), NMK_ERR_INVALID_ARGUMENT); /* no step */
    bad.step = step, bad.max_rows = 5;
    CHECK_STATUS(nmk_loop_create(pool, &bad, &other), NMK_ERR_INVALID_ARGUMENT); /* > pool rows */
    CHECK(other == NULL);

    CHECK_OK(nmk_loop_request_park(loop)); /* parked already: no-op */
    CHECK_OK(nmk_loop_add_row(loop, &ra));
    CHECK_OK(nmk_loop_resume(loop));
    /* The ring holds 8 entries: with nobody draining, the loop fills it and waits. */
    while (calls(&s) < 8) {
        pfd.fd = nmk_loop_fd(loop);
        CHECK(poll(&pfd, 1, 5000) == 1);
    }
    CHECK_OK(nmk_loop_drain(loop, ev, 3, &n));
    CHECK(n == 3 && ev[0].token == 2 && ev[2].token == 4);
    pfd.fd = nmk_loop_fd(loop);
    CHECK(poll(&pfd, 1, 0) == 1); /* re-signalled: entries remain */
    CHECK_OK(nmk_loop_request_park(loop));
    CHECK(wait_parked(loop, &c) == NMK_OK);
    CHECK(c.n == 5 && c.events[4].flags == (NMK_TOKEN_FINISHED | NMK_TOKEN_LENGTH));
    nmk_loop_destroy(loop);
    nmk_kv_pool_destroy(pool);
}

/* A consumer reads the state (running), the loop parks, the consumer drains: the drain
 * consumes the park's signal, so the fd must signal again until the state reports the park. */
static void test_a_park_between_state_and_drain_still_signals(void) {
    nmk_kv_pool *pool = make_pool(16);
    stepper s = {0, -1, 0};
    nmk_loop *loop = make_loop(pool, &s);
    nmk_seq_id a = make_seq(pool, 1);
    nmk_loop_row_params ra = row_params(0, a, 1, 4);
    nmk_loop_state state;
    nmk_status status;
    nmk_token_event ev[MAX_EVENTS];
    size_t n;
    struct pollfd pfd = {0, POLLIN, 0};
    pfd.fd = nmk_loop_fd(loop);

    CHECK_OK(nmk_loop_add_row(loop, &ra));
    CHECK_OK(nmk_loop_resume(loop));
    CHECK_OK(nmk_loop_get_state(loop, &state, &status));
    CHECK(state == NMK_LOOP_RUNNING);
    CHECK_OK(nmk_loop_park(loop)); /* parks after the state was read */
    do CHECK_OK(nmk_loop_drain(loop, ev, MAX_EVENTS, &n)); while (n > 0);
    CHECK(poll(&pfd, 1, 0) == 1); /* the park is not reported yet: still signalled */
    CHECK_OK(nmk_loop_get_state(loop, &state, &status));
    CHECK(state == NMK_LOOP_PARKED && status == NMK_OK);
    CHECK_OK(nmk_loop_drain(loop, ev, MAX_EVENTS, &n));
    CHECK(n == 0 && poll(&pfd, 1, 0) == 0); /* reported: quiet while parked */
    nmk_loop_destroy(loop);
    nmk_kv_pool_destroy(pool);
}

static void test_destroy_while_running(void) {
    nmk_kv_pool *pool = make_pool(16);
    stepper s = {0, -1, 0};
    nmk_loop *loop = make_loop(pool, &s);
    nmk_seq_id a = make_seq(pool, 1);
    nmk_loop_row_params ra = row_params(3, a, 1, 30);
    const int32_t *dense;
    uint32_t rows, cols;
    CHECK_OK(nmk_loop_add_row(loop, &ra));
    CHECK_OK(nmk_loop_resume(loop));
    nmk_loop_destroy(loop);
    CHECK_OK(nmk_kv_pool_block_table(pool, 0, &dense, &rows, &cols));
    CHECK(dense[3 * cols] == NMK_KV_NO_PAGE); /* row unbound */
    CHECK_OK(nmk_kv_seq_free(pool, a));
    nmk_kv_pool_destroy(pool);
}

int main(void) {
    test_rows_finish_on_stop_and_budget();
    test_step_failure_parks_and_rolls_back();
    test_no_space_parks_until_pages_return();
    test_min_tokens_and_max_seq_len();
    test_request_park_and_partial_drain();
    test_a_park_between_state_and_drain_still_signals();
    test_destroy_while_running();
    puts("test_loop: ok");
    return 0;
}
