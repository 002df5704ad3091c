/* Park/resume stress: admissions, cancellations, preemptions and park requests racing a
 * running loop, with a reader thread draining. Checks every row's token chain, that every
 * generated token was published exactly once, and that no page leaks.
 * Usage: stress [iterations] [seed] */
#define _POSIX_C_SOURCE 200809L
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "check.h"

enum { PS = 4, ROWS = 6, MAX_SEQS = 1 << 16, PROMPT = 24 };

static nmk_kv_pool *pool;
static nmk_loop *loop;
static pthread_mutex_t track_mu = PTHREAD_MUTEX_INITIALIZER;
static int32_t expected[MAX_SEQS]; /* next token each sequence must publish */
static uint32_t published[MAX_SEQS];
static pthread_mutex_t done_mu = PTHREAD_MUTEX_INITIALIZER;
static int done_flag;

static int done(void) {
    int d;
    pthread_mutex_lock(&done_mu);
    d = done_flag;
    pthread_mutex_unlock(&done_mu);
    return d;
}

static int step(void *user, const nmk_step_batch *b, nmk_step_result *r) {
    uint32_t i;
    (void)user;
    for (i = 0; i < b->num_rows; ++i) {
        const int32_t *row = b->block_tables[0] + (size_t)b->slots[i] * b->max_pages_per_seq;
        if (row[b->positions[i] / PS] < 0) return NMK_ERR_INTERNAL; /* page missing */
        r->tokens[i] = b->tokens[i] + 1;
        r->logprobs[i] = 0.0f;
    }
    return NMK_OK;
}

static void drain_and_check(void) {
    nmk_token_event ev[64];
    size_t n, i;
    pthread_mutex_lock(&track_mu);
    do {
        CHECK_OK(nmk_loop_drain(loop, ev, 64, &n));
        for (i = 0; i < n; ++i) {
            CHECK(ev[i].seq < MAX_SEQS);
            CHECK(ev[i].token == expected[ev[i].seq]);
            expected[ev[i].seq]++;
            published[ev[i].seq]++;
        }
    } while (n == 64);
    pthread_mutex_unlock(&track_mu);
}

static void *reader(void *arg) {
    struct pollfd pfd;
    (void)arg;
    while (!done()) {
        pfd.fd = nmk_loop_fd(loop);
        pfd.events = POLLIN;
        if (poll(&pfd, 1, 5) > 0) drain_and_check();
    }
    return NULL;
}

static void *parker(void *arg) {
    struct timespec ts = {0, 300000};
    (void)arg;
    while (!done()) {
        CHECK_OK(nmk_loop_request_park(loop));
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void remove_and_free(uint32_t slot) {
    nmk_loop_row_info info;
    CHECK_OK(nmk_loop_row(loop, slot, &info));
    CHECK_OK(nmk_loop_remove_row(loop, slot));
    drain_and_check();
    pthread_mutex_lock(&track_mu);
    CHECK(published[info.seq] == info.generated);
    pthread_mutex_unlock(&track_mu);
    CHECK_OK(nmk_kv_seq_free(pool, info.seq));
}

static void admit(uint32_t slot, unsigned *seed) {
    int32_t prompt[PROMPT];
    size_t len = 1 + (size_t)(rand_r(seed) % PROMPT), cached, i;
    nmk_seq_id seq;
    nmk_loop_row_params row;
    nmk_status st;
    int32_t stop = 1000 + rand_r(seed) % 40;
    for (i = 0; i < len; ++i) prompt[i] = i < 12 ? (int32_t)i : (int32_t)(rand_r(seed) % 3); /* shared prefixes */
    CHECK_OK(nmk_kv_seq_create(pool, prompt, len, &seq, &cached));
    CHECK(seq < MAX_SEQS && cached < len);
    st = nmk_kv_seq_append(pool, seq, prompt + cached, len - cached);
    if (st == NMK_ERR_NO_SPACE) {
        CHECK_OK(nmk_kv_seq_free(pool, seq));
        return;
    }
    CHECK_OK(st);
    memset(&row, 0, sizeof row);
    row.slot = slot, row.seq = seq, row.last_token = 1000, row.max_new_tokens = 1 + rand_r(seed) % 40;
    row.stop_token_ids = &stop, row.num_stop_token_ids = 1;
    pthread_mutex_lock(&track_mu);
    expected[seq] = 1001;
    pthread_mutex_unlock(&track_mu);
    CHECK_OK(nmk_loop_add_row(loop, &row));
}

int main(int argc, char **argv) {
    int iterations = argc > 1 ? atoi(argv[1]) : 2000;
    unsigned seed = argc > 2 ? (unsigned)atoi(argv[2]) : 1u;
    nmk_kv_pool_params pp = nmk_kv_pool_default_params();
    nmk_loop_params lp = nmk_loop_default_params();
    pthread_t threads[2];
    nmk_loop_state state;
    nmk_status status;
    nmk_kv_usage u;
    uint32_t slot, g;
    int it, no_space = 0;
    struct timespec ts = {0, 100000};

    pp.num_groups = 2, pp.num_pages[0] = 48, pp.num_pages[1] = 24, pp.window[1] = 16;
    pp.page_size = PS, pp.max_seq_len = 128, pp.max_rows = ROWS;
    CHECK_OK(nmk_kv_pool_create(&pp, &pool));
    lp.max_rows = ROWS, lp.ring_capacity = 16, lp.step = step;
    CHECK_OK(nmk_loop_create(pool, &lp, &loop));
    pthread_create(&threads[0], NULL, reader, NULL);
    pthread_create(&threads[1], NULL, parker, NULL);

    for (it = 0; it < iterations; ++it) {
        CHECK_OK(nmk_loop_park(loop));
        CHECK_OK(nmk_loop_get_state(loop, &state, &status));
        CHECK(state == NMK_LOOP_PARKED);
        CHECK(status == NMK_OK || status == NMK_ERR_NO_SPACE);
        if (status == NMK_ERR_NO_SPACE) { /* preempt the first row */
            ++no_space;
            for (slot = 0; slot < ROWS; ++slot) {
                nmk_loop_row_info info;
                if (nmk_loop_row(loop, slot, &info) == NMK_OK) break;
            }
            CHECK(slot < ROWS);
            remove_and_free(slot);
        }
        for (slot = 0; slot < ROWS; ++slot) {
            nmk_loop_row_info info;
            nmk_status st = nmk_loop_row(loop, slot, &info);
            if (st == NMK_OK && ((info.flags & NMK_TOKEN_FINISHED) || rand_r(&seed) % 8 == 0))
                remove_and_free(slot);
            else if (st == NMK_ERR_NOT_FOUND && rand_r(&seed) % 2 == 0)
                admit(slot, &seed);
        }
        CHECK_OK(nmk_loop_resume(loop));
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&done_mu);
    done_flag = 1;
    pthread_mutex_unlock(&done_mu);
    pthread_join(threads[0], NULL);
    pthread_join(threads[1], NULL);
    CHECK_OK(nmk_loop_park(loop));
    for (slot = 0; slot < ROWS; ++slot)
        if (nmk_loop_row(loop, slot, &(nmk_loop_row_info){0}) == NMK_OK) remove_and_free(slot);
    nmk_loop_destroy(loop);
    for (g = 0; g < 2; ++g) {
        CHECK_OK(nmk_kv_pool_usage(pool, g, &u));
        CHECK(u.used == 0 && u.total == u.cached + u.free);
    }
    nmk_kv_pool_destroy(pool);
    printf("stress: ok (%d iterations, %d no-space parks)\n", iterations, no_space);
    return 0;
}
