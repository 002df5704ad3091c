// The paged KV block pool: page groups, sequences and their block tables, the prefix
// cache and the dense per-row block tables a decode step reads. See include/northmk.h for
// the contract. Every public method takes the pool mutex and throws nmk::Error.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "internal.hpp"
#include "kv/page_set.hpp"

namespace nmk::kv {

struct Sequence {
    std::vector<int32_t> tokens;                                // ids at positions 0..len-1
    std::vector<uint64_t> hashes;                               // chain hash per full page
    std::array<std::vector<int32_t>, NMK_KV_MAX_GROUPS> pages;  // logical -> physical
    int32_t row = -1;                                           // bound dense-table row
};

// One sequence's share of a batched append.
struct Append {
    nmk_seq_id seq;
    const int32_t *tokens;
    size_t n;
};

class Pool {
public:
    explicit Pool(const nmk_kv_pool_params &params);

    const nmk_kv_pool_params &params() const { return params_; }
    uint32_t cols() const { return cols_; }

    nmk_seq_id create(const int32_t *tokens, size_t n, size_t *n_cached);
    size_t lookup(const int32_t *tokens, size_t n);
    void free(nmk_seq_id seq);
    // All-or-nothing: NMK_ERR_NO_SPACE (thrown) records no token and takes no page.
    void append(const Append *ops, size_t n_ops);
    // Pages for positions [len, len + n) ahead of the append that records them; NMK_ERR_NO_SPACE
    // (thrown) takes none.
    void reserve(nmk_seq_id seq, size_t n);
    nmk_seq_id fork(nmk_seq_id src, nmk_kv_page_copy *copies, size_t cap, size_t *n_copies);
    // Undoes the append of each sequence's last token (the decode loop's failed step).
    void drop_last_token(const nmk_seq_id *seqs, size_t n);
    size_t length(nmk_seq_id seq);
    size_t block_table(nmk_seq_id seq, uint32_t group, int32_t *out, size_t cap);
    void bind_row(uint32_t row, nmk_seq_id seq);
    void unbind_row(uint32_t row);
    const int32_t *dense(uint32_t group) const { return dense_[group].data(); }
    nmk_kv_usage usage(uint32_t group);
    nmk_kv_prefix_stats prefix_stats();

private:
    Sequence &find(nmk_seq_id seq);
    uint32_t dead_pages(uint32_t group, size_t next_pos) const;
    uint32_t pages_for(size_t tokens) const;
    void release_behind_window(Sequence &s, size_t next_pos);
    void drop_reserved(Sequence &s);
    void register_full_pages(Sequence &s, size_t old_len);
    size_t cached_prefix(const int32_t *tokens, size_t n, std::vector<uint64_t> &hashes,
                         std::array<std::vector<int32_t>, NMK_KV_MAX_GROUPS> &hits) const;
    void sync_row(const Sequence &s);
    void check_group(uint32_t group) const;

    std::mutex mu_;
    nmk_kv_pool_params params_;
    uint32_t cols_;
    uint64_t seed_;
    std::vector<PageSet> groups_;
    std::unordered_map<nmk_seq_id, Sequence> seqs_;
    nmk_seq_id next_id_ = 1;
    std::array<std::vector<int32_t>, NMK_KV_MAX_GROUPS> dense_;  // [max_rows, cols]
    std::vector<nmk_seq_id> row_seq_;                            // 0 = unbound
    nmk_kv_prefix_stats stats_{};
};

}  // namespace nmk::kv

struct nmk_kv_pool : nmk::kv::Pool {
    using Pool::Pool;
};
