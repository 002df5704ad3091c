#include "kv/pool.hpp"

#include <algorithm>

namespace nmk::kv {

namespace {

uint64_t mix(uint64_t x) {  // splitmix64 finalizer
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Hash of a full page given its predecessor's hash: the chain makes it name the whole prefix.
uint64_t chain_hash(uint64_t parent, const int32_t *tokens, uint32_t n) {
    uint64_t h = mix(parent);
    for (uint32_t i = 0; i < n; ++i) h = mix(h ^ static_cast<uint32_t>(tokens[i]));
    return h;
}

[[noreturn]] void throw_error(nmk_status status, const std::string &message) {
    throw Error(status, message);
}

void check_tokens(const int32_t *tokens, size_t n) {
    for (size_t i = 0; i < n; ++i)
        if (tokens[i] < 0)
            throw_error(NMK_ERR_INVALID_ARGUMENT, "token " + std::to_string(i) + " is negative (" +
                        std::to_string(tokens[i]) + ")");
}

void validate(const nmk_kv_pool_params &p) {
    if (p.num_groups < 1 || p.num_groups > NMK_KV_MAX_GROUPS)
        throw_error(NMK_ERR_INVALID_ARGUMENT, "num_groups must be in [1, " +
                    std::to_string(NMK_KV_MAX_GROUPS) + "], got " + std::to_string(p.num_groups));
    for (uint32_t g = 0; g < p.num_groups; ++g)
        if (p.num_pages[g] < 1 || p.num_pages[g] > INT32_MAX)
            throw_error(NMK_ERR_INVALID_ARGUMENT, "num_pages[" + std::to_string(g) + "] must be >= 1");
    if (p.page_size < 1) throw_error(NMK_ERR_INVALID_ARGUMENT, "page_size must be >= 1");
    if (p.max_seq_len < 1) throw_error(NMK_ERR_INVALID_ARGUMENT, "max_seq_len must be >= 1");
    if (p.max_rows < 1) throw_error(NMK_ERR_INVALID_ARGUMENT, "max_rows must be >= 1");
}

}  // namespace

Pool::Pool(const nmk_kv_pool_params &params) : params_(params) {
    validate(params);
    cols_ = pages_for(params.max_seq_len);
    seed_ = mix(params.model_key ^ 0x6e6f7274686d6bull);  // "northmk"
    for (uint32_t g = 0; g < params.num_groups; ++g) {
        groups_.emplace_back(params.num_pages[g], params.page_size);
        dense_[g].assign(static_cast<size_t>(params.max_rows) * cols_, NMK_KV_NO_PAGE);
    }
    row_seq_.assign(params.max_rows, 0);
}

uint32_t Pool::pages_for(size_t tokens) const {
    return static_cast<uint32_t>((tokens + params_.page_size - 1) / params_.page_size);
}

// Leading pages of a sliding group that no position >= next_pos can see: a page is dead
// when its last position < next_pos - window + 1.
uint32_t Pool::dead_pages(uint32_t group, size_t next_pos) const {
    uint32_t w = params_.window[group];
    if (w == 0 || next_pos + 1 <= w) return 0;
    return static_cast<uint32_t>((next_pos + 1 - w) / params_.page_size);
}

Sequence &Pool::find(nmk_seq_id seq) {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) throw_error(NMK_ERR_NOT_FOUND, "no sequence " + std::to_string(seq));
    return it->second;
}

void Pool::check_group(uint32_t group) const {
    if (group >= params_.num_groups)
        throw_error(NMK_ERR_INVALID_ARGUMENT, "group " + std::to_string(group) + " out of range [0, " +
                    std::to_string(params_.num_groups) + ")");
}

void Pool::sync_row(const Sequence &s) {
    if (s.row < 0) return;
    for (uint32_t g = 0; g < params_.num_groups; ++g) {
        int32_t *row = &dense_[g][static_cast<size_t>(s.row) * cols_];
        std::fill(row, row + cols_, NMK_KV_NO_PAGE);
        std::copy(s.pages[g].begin(), s.pages[g].end(), row);
    }
}

void Pool::release_behind_window(Sequence &s, size_t next_pos) {
    for (uint32_t g = 0; g < params_.num_groups; ++g) {
        uint32_t dead = std::min<size_t>(dead_pages(g, next_pos), s.pages[g].size());
        for (uint32_t j = 0; j < dead; ++j) {
            if (s.pages[g][j] == NMK_KV_NO_PAGE) continue;
            groups_[g].release(s.pages[g][j]);
            s.pages[g][j] = NMK_KV_NO_PAGE;
        }
    }
}

// Hashes the pages that became full since old_len and offers them to the prefix cache.
void Pool::register_full_pages(Sequence &s, size_t old_len) {
    const uint32_t ps = params_.page_size;
    for (size_t j = old_len / ps; j < s.tokens.size() / ps; ++j) {
        const int32_t *page_tokens = &s.tokens[j * ps];
        uint64_t parent = j ? s.hashes[j - 1] : seed_;
        s.hashes.push_back(chain_hash(parent, page_tokens, ps));
        if (!params_.enable_prefix_cache) continue;
        for (uint32_t g = 0; g < params_.num_groups; ++g)
            if (s.pages[g][j] != NMK_KV_NO_PAGE)
                groups_[g].insert_cached(s.pages[g][j], s.hashes[j], parent, page_tokens);
    }
}

// Longest usable cached prefix (in pages) of tokens[0..n), at most n - 1 tokens. Full
// groups need every page; sliding groups only those inside the window of the next position.
size_t Pool::cached_prefix(const int32_t *tokens, size_t n, std::vector<uint64_t> &hashes,
                           std::array<std::vector<int32_t>, NMK_KV_MAX_GROUPS> &hits) const {
    const uint32_t ps = params_.page_size;
    size_t k = (n == 0 || !params_.enable_prefix_cache) ? 0 : (n - 1) / ps;
    uint64_t parent = seed_;
    for (size_t j = 0; j < k; ++j) {
        hashes.push_back(chain_hash(parent, tokens + j * ps, ps));
        for (uint32_t g = 0; g < params_.num_groups; ++g)
            hits[g].push_back(groups_[g].find_cached(hashes[j], parent, tokens + j * ps));
        parent = hashes[j];
    }
    for (uint32_t g = 0; g < params_.num_groups; ++g) {
        if (params_.window[g] != 0) continue;
        size_t m = 0;
        while (m < k && hits[g][m] != NMK_KV_NO_PAGE) ++m;
        k = m;
    }
    for (size_t m = k;; --m) {
        bool ok = true;
        for (uint32_t g = 0; g < params_.num_groups && ok; ++g) {
            if (params_.window[g] == 0) continue;
            for (size_t j = dead_pages(g, m * ps); j < m && ok; ++j) ok = hits[g][j] != NMK_KV_NO_PAGE;
        }
        if (ok || m == 0) return m;
    }
}

size_t Pool::lookup(const int32_t *tokens, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<uint64_t> hashes;
    std::array<std::vector<int32_t>, NMK_KV_MAX_GROUPS> hits;
    return cached_prefix(tokens, n, hashes, hits) * params_.page_size;
}

nmk_seq_id Pool::create(const int32_t *tokens, size_t n, size_t *n_cached) {
    std::lock_guard<std::mutex> lock(mu_);
    if (tokens) check_tokens(tokens, n);
    const uint32_t ps = params_.page_size;
    std::vector<uint64_t> hashes;
    std::array<std::vector<int32_t>, NMK_KV_MAX_GROUPS> hits;
    size_t m = tokens ? cached_prefix(tokens, n, hashes, hits) : 0;
    Sequence s;
    s.tokens.assign(tokens, tokens + m * ps);
    s.hashes.assign(hashes.begin(), hashes.begin() + m);
    for (uint32_t g = 0; g < params_.num_groups; ++g) {
        s.pages[g].assign(m, NMK_KV_NO_PAGE);
        for (size_t j = dead_pages(g, m * ps); j < m; ++j) {
            groups_[g].retain(hits[g][j]);
            s.pages[g][j] = hits[g][j];
        }
    }
    if (tokens) {
        ++stats_.lookups;
        stats_.query_tokens += n;
        stats_.hit_tokens += m * ps;
    }
    nmk_seq_id id = next_id_++;
    seqs_.emplace(id, std::move(s));
    if (n_cached) *n_cached = m * ps;
    return id;
}

void Pool::free(nmk_seq_id seq) {
    std::lock_guard<std::mutex> lock(mu_);
    Sequence &s = find(seq);
    if (s.row >= 0)
        throw_error(NMK_ERR_BAD_STATE, "sequence " + std::to_string(seq) + " is bound to row " +
                    std::to_string(s.row) + "; remove the row first");
    // Latest pages first: they reach the LRU tail first, so a prefix's head is evicted last.
    for (uint32_t g = 0; g < params_.num_groups; ++g)
        for (auto p = s.pages[g].rbegin(); p != s.pages[g].rend(); ++p)
            if (*p != NMK_KV_NO_PAGE) groups_[g].release(*p);
    seqs_.erase(seq);
}

void Pool::append(const Append *ops, size_t n_ops) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Sequence *> seqs;
    for (size_t i = 0; i < n_ops; ++i) {
        Sequence &s = find(ops[i].seq);
        if (ops[i].n && !ops[i].tokens) throw_error(NMK_ERR_INVALID_ARGUMENT, "tokens is NULL");
        check_tokens(ops[i].tokens, ops[i].n);
        if (s.tokens.size() + ops[i].n > params_.max_seq_len)
            throw_error(NMK_ERR_INVALID_ARGUMENT, "sequence " + std::to_string(ops[i].seq) + " would hold " +
                        std::to_string(s.tokens.size() + ops[i].n) + " tokens > max_seq_len " +
                        std::to_string(params_.max_seq_len));
        if (std::find(seqs.begin(), seqs.end(), &s) != seqs.end())
            throw_error(NMK_ERR_INVALID_ARGUMENT, "sequence " + std::to_string(ops[i].seq) + " listed twice");
        seqs.push_back(&s);
    }
    // Dead sliding pages go first: correct regardless, and they may be what makes room.
    for (Sequence *s : seqs) {
        release_behind_window(*s, s->tokens.size());
        sync_row(*s);
    }
    // Every group keeps one table entry per logical page, so each needs the same count; pages
    // reserved ahead (reserve) are already there.
    size_t need = 0;
    for (size_t i = 0; i < n_ops; ++i) {
        const size_t want = pages_for(seqs[i]->tokens.size() + ops[i].n), have = seqs[i]->pages[0].size();
        need += want > have ? want - have : 0;
    }
    for (uint32_t g = 0; g < params_.num_groups; ++g)
        if (need > groups_[g].available())
            throw_error(NMK_ERR_NO_SPACE, "group " + std::to_string(g) + " needs " + std::to_string(need) +
                        " pages, " + std::to_string(groups_[g].available()) + " available");
    for (size_t i = 0; i < n_ops; ++i) {
        Sequence &s = *seqs[i];
        size_t old_len = s.tokens.size();
        s.tokens.insert(s.tokens.end(), ops[i].tokens, ops[i].tokens + ops[i].n);
        for (uint32_t g = 0; g < params_.num_groups; ++g)
            while (s.pages[g].size() < pages_for(s.tokens.size())) s.pages[g].push_back(groups_[g].allocate());
        register_full_pages(s, old_len);
        sync_row(s);
    }
}

void Pool::reserve(nmk_seq_id seq, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    Sequence &s = find(seq);
    if (s.tokens.size() + n > params_.max_seq_len)
        throw_error(NMK_ERR_INVALID_ARGUMENT, "sequence " + std::to_string(seq) + " would reserve up to " +
                    std::to_string(s.tokens.size() + n) + " tokens > max_seq_len " +
                    std::to_string(params_.max_seq_len));
    const size_t want = pages_for(s.tokens.size() + n), have = s.pages[0].size();
    if (want <= have) return;
    for (uint32_t g = 0; g < params_.num_groups; ++g)
        if (want - have > groups_[g].available())
            throw_error(NMK_ERR_NO_SPACE, "group " + std::to_string(g) + " needs " + std::to_string(want - have) +
                        " pages, " + std::to_string(groups_[g].available()) + " available");
    for (uint32_t g = 0; g < params_.num_groups; ++g)
        while (s.pages[g].size() < want) s.pages[g].push_back(groups_[g].allocate());
    sync_row(s);
}

// Pages reserved past the sequence's tokens go back first: the token's own page is then its last.
void Pool::drop_reserved(Sequence &s) {
    const size_t keep = pages_for(s.tokens.size());
    for (uint32_t g = 0; g < params_.num_groups; ++g)
        while (s.pages[g].size() > keep) {
            if (s.pages[g].back() != NMK_KV_NO_PAGE) groups_[g].release(s.pages[g].back());
            s.pages[g].pop_back();
        }
}

void Pool::drop_last_token(const nmk_seq_id *ids, size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint32_t ps = params_.page_size;
    for (size_t i = 0; i < n; ++i) {
        Sequence &s = find(ids[i]);
        drop_reserved(s);
        if (s.tokens.empty()) {
            sync_row(s);
            continue;
        }
        size_t len = s.tokens.size();
        if (len % ps == 0) {  // the dropped token had filled its page: forget its cache entry
            for (uint32_t g = 0; g < params_.num_groups; ++g)
                if (s.pages[g].back() != NMK_KV_NO_PAGE) groups_[g].erase_cached(s.pages[g].back());
            s.hashes.pop_back();
        }
        s.tokens.pop_back();
        if ((len - 1) % ps == 0)
            for (uint32_t g = 0; g < params_.num_groups; ++g) {
                if (s.pages[g].back() != NMK_KV_NO_PAGE) groups_[g].release(s.pages[g].back());
                s.pages[g].pop_back();
            }
        sync_row(s);
    }
}

nmk_seq_id Pool::fork(nmk_seq_id src, nmk_kv_page_copy *copies, size_t cap, size_t *n_copies) {
    std::lock_guard<std::mutex> lock(mu_);
    Sequence &s = find(src);
    if (cap < params_.num_groups)
        throw_error(NMK_ERR_INVALID_ARGUMENT, "copies needs room for " + std::to_string(params_.num_groups) +
                    " entries, cap is " + std::to_string(cap));
    const bool partial = s.tokens.size() % params_.page_size != 0;
    for (uint32_t g = 0; partial && g < params_.num_groups; ++g)
        if (groups_[g].available() < 1)
            throw_error(NMK_ERR_NO_SPACE, "group " + std::to_string(g) + " has no page for the fork's last page");
    Sequence child;
    child.tokens = s.tokens;
    child.hashes = s.hashes;
    size_t n = 0;
    const size_t own = pages_for(s.tokens.size());  // not the pages reserved past them
    for (uint32_t g = 0; g < params_.num_groups; ++g) {
        child.pages[g].assign(s.pages[g].begin(), s.pages[g].begin() + own);
        size_t shared = partial ? child.pages[g].size() - 1 : child.pages[g].size();
        for (size_t j = 0; j < shared; ++j)
            if (child.pages[g][j] != NMK_KV_NO_PAGE) groups_[g].retain(child.pages[g][j]);
        if (!partial) continue;
        int32_t dst = groups_[g].allocate();
        copies[n++] = nmk_kv_page_copy{g, s.pages[g][own - 1], dst};
        child.pages[g].back() = dst;
    }
    nmk_seq_id id = next_id_++;
    seqs_.emplace(id, std::move(child));
    if (n_copies) *n_copies = n;
    return id;
}

size_t Pool::length(nmk_seq_id seq) {
    std::lock_guard<std::mutex> lock(mu_);
    return find(seq).tokens.size();
}

size_t Pool::block_table(nmk_seq_id seq, uint32_t group, int32_t *out, size_t cap) {
    std::lock_guard<std::mutex> lock(mu_);
    check_group(group);
    const auto &pages = find(seq).pages[group];
    if (out) std::copy(pages.begin(), pages.begin() + std::min(cap, pages.size()), out);
    return pages.size();
}

void Pool::bind_row(uint32_t row, nmk_seq_id seq) {
    std::lock_guard<std::mutex> lock(mu_);
    if (row >= params_.max_rows)
        throw_error(NMK_ERR_INVALID_ARGUMENT, "row " + std::to_string(row) + " >= max_rows " +
                    std::to_string(params_.max_rows));
    Sequence &s = find(seq);
    if (row_seq_[row] != 0)
        throw_error(NMK_ERR_BAD_STATE, "row " + std::to_string(row) + " is bound to sequence " +
                    std::to_string(row_seq_[row]));
    if (s.row >= 0)
        throw_error(NMK_ERR_BAD_STATE, "sequence " + std::to_string(seq) + " is already bound to row " +
                    std::to_string(s.row));
    s.row = static_cast<int32_t>(row);
    row_seq_[row] = seq;
    sync_row(s);
}

void Pool::unbind_row(uint32_t row) {
    std::lock_guard<std::mutex> lock(mu_);
    if (row >= params_.max_rows || row_seq_[row] == 0)
        throw_error(NMK_ERR_NOT_FOUND, "row " + std::to_string(row) + " is not bound");
    find(row_seq_[row]).row = -1;
    row_seq_[row] = 0;
    for (uint32_t g = 0; g < params_.num_groups; ++g)
        std::fill_n(&dense_[g][static_cast<size_t>(row) * cols_], cols_, NMK_KV_NO_PAGE);
}

nmk_kv_usage Pool::usage(uint32_t group) {
    std::lock_guard<std::mutex> lock(mu_);
    check_group(group);
    return groups_[group].usage();
}

nmk_kv_prefix_stats Pool::prefix_stats() {
    std::lock_guard<std::mutex> lock(mu_);
    nmk_kv_prefix_stats s = stats_;
    s.evictions = 0;
    for (const auto &g : groups_) s.evictions += g.evictions();
    return s;
}

}  // namespace nmk::kv
