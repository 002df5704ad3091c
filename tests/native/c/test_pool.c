/* The KV block pool through the C ABI: sequences, block tables, windows, forks, reserves, prefix cache. */
#include <string.h>

#include "check.h"

enum { PS = 4, FULL = 0, SLIDING = 1 };

static nmk_kv_pool *make_pool(uint32_t pages, uint32_t window) {
    nmk_kv_pool *pool = NULL;
    nmk_kv_pool_params p = nmk_kv_pool_default_params();
    p.num_groups = 2;
    p.num_pages[FULL] = pages;
    p.num_pages[SLIDING] = pages;
    p.window[SLIDING] = window;
    p.page_size = PS;
    p.max_seq_len = 64;
    p.max_rows = 2;
    p.model_key = 42;
    CHECK_OK(nmk_kv_pool_create(&p, &pool));
    return pool;
}

static void check_usage(nmk_kv_pool *pool, uint32_t group, uint32_t used, uint32_t cached, uint32_t free_) {
    nmk_kv_usage u;
    CHECK_OK(nmk_kv_pool_usage(pool, group, &u));
    CHECK(u.used == used && u.cached == cached && u.free == free_);
    CHECK(u.total == used + cached + free_);
}

static void test_append_and_tables(void) {
    nmk_kv_pool *pool = make_pool(8, 0);
    int32_t tokens[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    int32_t table[16];
    nmk_seq_id seq;
    size_t n = 99, cached = 99;
    const int32_t *dense;
    uint32_t rows, cols;

    CHECK_OK(nmk_kv_seq_create(pool, NULL, 0, &seq, &cached));
    CHECK(seq != 0 && cached == 0);
    CHECK_OK(nmk_kv_seq_append(pool, seq, tokens, 10));
    CHECK_OK(nmk_kv_seq_length(pool, seq, &n));
    CHECK(n == 10);
    CHECK_OK(nmk_kv_seq_block_table(pool, seq, FULL, table, 16, &n));
    CHECK(n == 3 && table[0] >= 0 && table[1] >= 0 && table[2] >= 0);
    check_usage(pool, FULL, 3, 0, 5);
    CHECK_STATUS(nmk_kv_seq_block_table(pool, seq, 7, table, 16, &n), NMK_ERR_INVALID_ARGUMENT);

    /* The dense table mirrors the sequence once bound, and clears on unbind. */
    CHECK_OK(nmk_kv_pool_block_table(pool, FULL, &dense, &rows, &cols));
    CHECK(rows == 2 && cols == 16);
    CHECK(dense[cols + 0] == NMK_KV_NO_PAGE);
    CHECK_OK(nmk_kv_pool_bind_row(pool, 1, seq));
    CHECK(dense[cols + 0] == table[0] && dense[cols + 2] == table[2] && dense[cols + 3] == NMK_KV_NO_PAGE);
    CHECK_OK(nmk_kv_seq_append(pool, seq, tokens, 3)); /* 13 tokens: a 4th page */
    CHECK(dense[cols + 3] >= 0);
    CHECK_STATUS(nmk_kv_pool_bind_row(pool, 0, seq), NMK_ERR_BAD_STATE);
    CHECK_STATUS(nmk_kv_seq_free(pool, seq), NMK_ERR_BAD_STATE);
    CHECK_OK(nmk_kv_pool_unbind_row(pool, 1));
    CHECK(dense[cols + 0] == NMK_KV_NO_PAGE);
    CHECK_STATUS(nmk_kv_pool_unbind_row(pool, 1), NMK_ERR_NOT_FOUND);

    /* No space: nothing changes. Too long: invalid. */
    {
        int32_t many[64] = {0};
        CHECK_STATUS(nmk_kv_seq_append(pool, seq, many, 30), NMK_ERR_NO_SPACE);
        CHECK_OK(nmk_kv_seq_length(pool, seq, &n));
        CHECK(n == 13);
        check_usage(pool, FULL, 4, 0, 4);
        CHECK_STATUS(nmk_kv_seq_append(pool, seq, many, 52), NMK_ERR_INVALID_ARGUMENT);
    }
    {
        int32_t negative = -5;
        CHECK_STATUS(nmk_kv_seq_append(pool, seq, &negative, 1), NMK_ERR_INVALID_ARGUMENT);
    }
    CHECK_OK(nmk_kv_seq_free(pool, seq));
    CHECK_STATUS(nmk_kv_seq_free(pool, seq), NMK_ERR_NOT_FOUND);
    CHECK_STATUS(nmk_kv_seq_length(pool, seq, &n), NMK_ERR_NOT_FOUND);
    nmk_kv_pool_destroy(pool);
}

static void test_sliding_window_release(void) {
    /* window 6: at next position 13 the window is [8, 13], so pages 0 and 1 are dead. */
    nmk_kv_pool *pool = make_pool(8, 6);
    int32_t tokens[14] = {0};
    int32_t table[16];
    nmk_seq_id seq;
    size_t n;
    CHECK_OK(nmk_kv_seq_create(pool, NULL, 0, &seq, NULL));
    CHECK_OK(nmk_kv_seq_append(pool, seq, tokens, 13));
    CHECK_OK(nmk_kv_seq_append(pool, seq, tokens, 1));
    CHECK_OK(nmk_kv_seq_block_table(pool, seq, SLIDING, table, 16, &n));
    CHECK(n == 4 && table[0] == NMK_KV_NO_PAGE && table[1] == NMK_KV_NO_PAGE && table[2] >= 0);
    CHECK_OK(nmk_kv_seq_block_table(pool, seq, FULL, table, 16, &n));
    CHECK(n == 4 && table[0] >= 0 && table[1] >= 0);
    check_usage(pool, SLIDING, 2, 2, 4); /* the released full pages stay cached */
    check_usage(pool, FULL, 4, 0, 4);
    CHECK_OK(nmk_kv_seq_free(pool, seq));
    nmk_kv_pool_destroy(pool);
}

static void test_fork(void) {
    nmk_kv_pool *pool = make_pool(8, 0);
    int32_t tokens[6] = {1, 2, 3, 4, 5, 6};
    int32_t parent[4], child_table[4];
    nmk_seq_id seq, child;
    nmk_kv_page_copy copies[NMK_KV_MAX_GROUPS];
    size_t n, n_copies;
    CHECK_OK(nmk_kv_seq_create(pool, NULL, 0, &seq, NULL));
    CHECK_OK(nmk_kv_seq_append(pool, seq, tokens, 6));
    CHECK_STATUS(nmk_kv_seq_fork(pool, seq, &child, copies, 1, &n_copies), NMK_ERR_INVALID_ARGUMENT);
    CHECK_OK(nmk_kv_seq_fork(pool, seq, &child, copies, NMK_KV_MAX_GROUPS, &n_copies));
    CHECK(n_copies == 2 && copies[0].group == 0 && copies[1].group == 1);
    CHECK_OK(nmk_kv_seq_block_table(pool, seq, FULL, parent, 4, &n));
    CHECK_OK(nmk_kv_seq_block_table(pool, child, FULL, child_table, 4, &n));
    CHECK(n == 2 && child_table[0] == parent[0]);                 /* full page shared */
    CHECK(copies[0].src == parent[1] && copies[0].dst == child_table[1] && child_table[1] != parent[1]);
    check_usage(pool, FULL, 3, 0, 5);
    CHECK_OK(nmk_kv_seq_length(pool, child, &n));
    CHECK(n == 6);
    CHECK_OK(nmk_kv_seq_free(pool, seq));
    check_usage(pool, FULL, 2, 0, 6); /* page 0 still held by the child */
    CHECK_OK(nmk_kv_seq_free(pool, child));
    check_usage(pool, FULL, 0, 1, 7);
    nmk_kv_pool_destroy(pool);
}

static void test_reserve(void) {
    nmk_kv_pool *pool = make_pool(2, 0);
    int32_t tokens[4] = {1, 2, 3, 4};
    int32_t before[2], after[2];
    nmk_seq_id seq;
    size_t n;
    CHECK_OK(nmk_kv_seq_create(pool, NULL, 0, &seq, NULL));
    CHECK_OK(nmk_kv_seq_append(pool, seq, tokens, PS)); /* page 0 full */
    CHECK_OK(nmk_kv_seq_reserve(pool, seq, 1));          /* position PS's page, ahead */
    check_usage(pool, FULL, 2, 0, 0);
    CHECK_OK(nmk_kv_seq_block_table(pool, seq, FULL, before, 2, &n));
    CHECK(n == 2);
    CHECK_OK(nmk_kv_seq_append(pool, seq, tokens, 1)); /* takes the reserved page, no other */
    CHECK_OK(nmk_kv_seq_block_table(pool, seq, FULL, after, 2, &n));
    CHECK(n == 2 && after[1] == before[1]);
    CHECK_OK(nmk_kv_seq_append(pool, seq, tokens, 0));
    CHECK_STATUS(nmk_kv_seq_reserve(pool, seq, PS), NMK_ERR_NO_SPACE); /* a third page: none left */
    CHECK_STATUS(nmk_kv_seq_reserve(pool, seq, 64), NMK_ERR_INVALID_ARGUMENT);
    CHECK_STATUS(nmk_kv_seq_reserve(NULL, seq, 1), NMK_ERR_INVALID_ARGUMENT);
    check_usage(pool, FULL, 2, 0, 0);
    CHECK_OK(nmk_kv_seq_free(pool, seq));
    nmk_kv_pool_destroy(pool);
}

static void test_prefix_cache(void) {
    nmk_kv_pool *pool = make_pool(4, 0);
    int32_t prompt[9] = {5, 6, 7, 8, 9, 10, 11, 12, 13};
    int32_t other[9] = {5, 6, 7, 8, 0, 0, 0, 0, 1};
    int32_t a_table[3], b_table[3];
    nmk_seq_id a, b, c;
    size_t n, cached;
    nmk_kv_prefix_stats stats;

    CHECK_OK(nmk_kv_seq_create(pool, prompt, 9, &a, &cached));
    CHECK(cached == 0);
    CHECK_OK(nmk_kv_seq_append(pool, a, prompt, 9));
    CHECK_OK(nmk_kv_prefix_lookup(pool, prompt, 9, &cached));
    CHECK(cached == 8);
    CHECK_OK(nmk_kv_prefix_lookup(pool, prompt, 8, &cached)); /* leaves one token to compute */
    CHECK(cached == 4);
    CHECK_OK(nmk_kv_prefix_lookup(pool, other, 9, &cached));
    CHECK(cached == 4);

    CHECK_OK(nmk_kv_seq_create(pool, prompt, 9, &b, &cached));
    CHECK(cached == 8);
    CHECK_OK(nmk_kv_seq_length(pool, b, &n));
    CHECK(n == 8);
    CHECK_OK(nmk_kv_seq_block_table(pool, a, FULL, a_table, 3, &n));
    CHECK_OK(nmk_kv_seq_block_table(pool, b, FULL, b_table, 3, &n));
    CHECK(n == 2 && a_table[0] == b_table[0] && a_table[1] == b_table[1]);
    CHECK_OK(nmk_kv_pool_prefix_stats(pool, &stats));
    CHECK(stats.lookups == 2 && stats.query_tokens == 18 && stats.hit_tokens == 8 && stats.evictions == 0);

    /* Freed, the pages stay cached; a new allocation evicts them (oldest-released last page first). */
    CHECK_OK(nmk_kv_seq_free(pool, a));
    CHECK_OK(nmk_kv_seq_free(pool, b));
    check_usage(pool, FULL, 0, 2, 2);
    CHECK_OK(nmk_kv_seq_create(pool, NULL, 0, &c, NULL));
    CHECK_OK(nmk_kv_seq_append(pool, c, other, 9)); /* 3 pages: 2 free, 1 evicted */
    CHECK_OK(nmk_kv_pool_prefix_stats(pool, &stats));
    CHECK(stats.evictions == 2); /* one page in each of the two groups */
    CHECK_OK(nmk_kv_prefix_lookup(pool, prompt, 9, &cached));
    CHECK(cached == 4);
    CHECK_OK(nmk_kv_seq_free(pool, c));
    nmk_kv_pool_destroy(pool);
}

int main(void) {
    test_append_and_tables();
    test_sliding_window_release();
    test_fork();
    test_reserve();
    test_prefix_cache();
    puts("test_pool: ok");
    return 0;
}
