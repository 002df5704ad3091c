// extern "C" shims of the KV pool: argument checks, then nmk::kv::Pool under guard().
#include "internal.hpp"
#include "kv/pool.hpp"

#define NMK_REQUIRE_POOL(pool) NMK_REQUIRE((pool) != nullptr, "%s: pool is NULL", __func__)

extern "C" {

NMK_API nmk_kv_pool_params nmk_kv_pool_default_params(void) {
    nmk_kv_pool_params p{};
    p.num_groups = 1;
    p.num_pages[0] = 1024;
    p.page_size = 64;
    p.max_seq_len = 8192;
    p.max_rows = 8;
    p.enable_prefix_cache = 1;
    return p;
}

NMK_API nmk_status nmk_kv_pool_create(const nmk_kv_pool_params *params, nmk_kv_pool **out) {
    NMK_REQUIRE(params && out, "nmk_kv_pool_create: params and out must not be NULL");
    return nmk::guard(__func__, [&] {
        *out = new nmk_kv_pool(*params);
        return NMK_OK;
    });
}

NMK_API void nmk_kv_pool_destroy(nmk_kv_pool *pool) { delete pool; }

NMK_API nmk_status nmk_kv_seq_create(nmk_kv_pool *pool, const int32_t *tokens, size_t n,
                                     nmk_seq_id *out, size_t *n_cached) {
    NMK_REQUIRE_POOL(pool);
    NMK_REQUIRE(out, "nmk_kv_seq_create: out is NULL");
    NMK_REQUIRE(tokens || n == 0, "nmk_kv_seq_create: tokens is NULL but n is %zu", n);
    return nmk::guard(__func__, [&] {
        *out = pool->create(tokens, n, n_cached);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_prefix_lookup(nmk_kv_pool *pool, const int32_t *tokens, size_t n,
                                        size_t *n_cached) {
    NMK_REQUIRE_POOL(pool);
    NMK_REQUIRE(n_cached, "nmk_kv_prefix_lookup: n_cached is NULL");
    NMK_REQUIRE(tokens || n == 0, "nmk_kv_prefix_lookup: tokens is NULL but n is %zu", n);
    return nmk::guard(__func__, [&] {
        *n_cached = pool->lookup(tokens, n);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_seq_free(nmk_kv_pool *pool, nmk_seq_id seq) {
    NMK_REQUIRE_POOL(pool);
    return nmk::guard(__func__, [&] {
        pool->free(seq);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_seq_append(nmk_kv_pool *pool, nmk_seq_id seq, const int32_t *tokens, size_t n) {
    NMK_REQUIRE_POOL(pool);
    NMK_REQUIRE(tokens || n == 0, "nmk_kv_seq_append: tokens is NULL but n is %zu", n);
    return nmk::guard(__func__, [&] {
        nmk::kv::Append op{seq, tokens, n};
        pool->append(&op, 1);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_seq_reserve(nmk_kv_pool *pool, nmk_seq_id seq, size_t n) {
    NMK_REQUIRE_POOL(pool);
    return nmk::guard(__func__, [&] {
        pool->reserve(seq, n);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_seq_fork(nmk_kv_pool *pool, nmk_seq_id src, nmk_seq_id *child,
                                   nmk_kv_page_copy *copies, size_t cap, size_t *n_copies) {
    NMK_REQUIRE_POOL(pool);
    NMK_REQUIRE(child && n_copies, "nmk_kv_seq_fork: child and n_copies must not be NULL");
    NMK_REQUIRE(copies || cap == 0, "nmk_kv_seq_fork: copies is NULL but cap is %zu", cap);
    return nmk::guard(__func__, [&] {
        *child = pool->fork(src, copies, cap, n_copies);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_seq_length(nmk_kv_pool *pool, nmk_seq_id seq, size_t *out) {
    NMK_REQUIRE_POOL(pool);
    NMK_REQUIRE(out, "nmk_kv_seq_length: out is NULL");
    return nmk::guard(__func__, [&] {
        *out = pool->length(seq);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_seq_block_table(nmk_kv_pool *pool, nmk_seq_id seq, uint32_t group,
                                          int32_t *out, size_t cap, size_t *n_pages) {
    NMK_REQUIRE_POOL(pool);
    NMK_REQUIRE(n_pages, "nmk_kv_seq_block_table: n_pages is NULL");
    NMK_REQUIRE(out || cap == 0, "nmk_kv_seq_block_table: out is NULL but cap is %zu", cap);
    return nmk::guard(__func__, [&] {
        *n_pages = pool->block_table(seq, group, out, cap);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_pool_bind_row(nmk_kv_pool *pool, uint32_t row, nmk_seq_id seq) {
    NMK_REQUIRE_POOL(pool);
    return nmk::guard(__func__, [&] {
        pool->bind_row(row, seq);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_pool_unbind_row(nmk_kv_pool *pool, uint32_t row) {
    NMK_REQUIRE_POOL(pool);
    return nmk::guard(__func__, [&] {
        pool->unbind_row(row);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_pool_block_table(nmk_kv_pool *pool, uint32_t group, const int32_t **data,
                                           uint32_t *rows, uint32_t *cols) {
    NMK_REQUIRE_POOL(pool);
    NMK_REQUIRE(data && rows && cols, "nmk_kv_pool_block_table: data, rows and cols must not be NULL");
    NMK_REQUIRE(group < pool->params().num_groups, "nmk_kv_pool_block_table: group %u out of range [0, %u)",
                group, pool->params().num_groups);
    *data = pool->dense(group);
    *rows = pool->params().max_rows;
    *cols = pool->cols();
    return NMK_OK;
}

NMK_API nmk_status nmk_kv_pool_usage(nmk_kv_pool *pool, uint32_t group, nmk_kv_usage *out) {
    NMK_REQUIRE_POOL(pool);
    NMK_REQUIRE(out, "nmk_kv_pool_usage: out is NULL");
    return nmk::guard(__func__, [&] {
        *out = pool->usage(group);
        return NMK_OK;
    });
}

NMK_API nmk_status nmk_kv_pool_prefix_stats(nmk_kv_pool *pool, nmk_kv_prefix_stats *out) {
    NMK_REQUIRE_POOL(pool);
    NMK_REQUIRE(out, "nmk_kv_pool_prefix_stats: out is NULL");
    return nmk::guard(__func__, [&] {
        *out = pool->prefix_stats();
        return NMK_OK;
    });
}

}  // extern "C"
