#include "kv/page_set.hpp"

#include <cassert>
#include <cstring>

namespace nmk::kv {

PageSet::PageSet(uint32_t num_pages, uint32_t page_size)
    : page_size_(page_size),
      ref_(num_pages, 0),
      prev_(num_pages, NMK_KV_NO_PAGE),
      next_(num_pages, NMK_KV_NO_PAGE),
      cached_(num_pages, 0),
      hash_(num_pages, 0),
      parent_(num_pages, 0),
      tokens_(static_cast<size_t>(num_pages) * page_size, 0) {
    for (uint32_t p = 0; p < num_pages; ++p) link_tail(static_cast<int32_t>(p));
    num_free_ = num_pages;
}

nmk_kv_usage PageSet::usage() const {
    nmk_kv_usage u;
    u.total = total();
    u.used = num_used_;
    u.cached = num_cached_;
    u.free = num_free_;
    return u;
}

void PageSet::link_head(int32_t p) {
    prev_[p] = NMK_KV_NO_PAGE;
    next_[p] = head_;
    if (head_ != NMK_KV_NO_PAGE) prev_[head_] = p; else tail_ = p;
    head_ = p;
}

void PageSet::link_tail(int32_t p) {
    next_[p] = NMK_KV_NO_PAGE;
    prev_[p] = tail_;
    if (tail_ != NMK_KV_NO_PAGE) next_[tail_] = p; else head_ = p;
    tail_ = p;
}

void PageSet::unlink(int32_t p) {
    if (prev_[p] != NMK_KV_NO_PAGE) next_[prev_[p]] = next_[p]; else head_ = next_[p];
    if (next_[p] != NMK_KV_NO_PAGE) prev_[next_[p]] = prev_[p]; else tail_ = prev_[p];
    prev_[p] = next_[p] = NMK_KV_NO_PAGE;
}

int32_t PageSet::allocate() {
    assert(available() > 0);
    int32_t p = head_;
    if (cached_[p]) {
        ++evictions_;
        erase_cached(p);
    }
    unlink(p);
    --num_free_;
    ++num_used_;
    ref_[p] = 1;
    return p;
}

void PageSet::retain(int32_t p) {
    if (ref_[p]++ > 0) return;
    unlink(p);
    --num_cached_;  // only cached pages are ever revived
    ++num_used_;
}

void PageSet::release(int32_t p) {
    assert(ref_[p] > 0);
    if (--ref_[p] > 0) return;
    --num_used_;
    if (cached_[p]) {
        link_tail(p);
        ++num_cached_;
    } else {
        link_head(p);
        ++num_free_;
    }
}

void PageSet::insert_cached(int32_t p, uint64_t hash, uint64_t parent, const int32_t *tokens) {
    assert(ref_[p] > 0);
    if (cached_[p] || index_.count(hash)) return;
    index_.emplace(hash, p);
    cached_[p] = 1;
    hash_[p] = hash;
    parent_[p] = parent;
    std::memcpy(&tokens_[static_cast<size_t>(p) * page_size_], tokens, page_size_ * sizeof(int32_t));
}

int32_t PageSet::find_cached(uint64_t hash, uint64_t parent, const int32_t *tokens) const {
    auto it = index_.find(hash);
    if (it == index_.end()) return NMK_KV_NO_PAGE;
    int32_t p = it->second;
    bool same = parent_[p] == parent &&
                std::memcmp(&tokens_[static_cast<size_t>(p) * page_size_], tokens,
                            page_size_ * sizeof(int32_t)) == 0;
    return same ? p : NMK_KV_NO_PAGE;
}

void PageSet::erase_cached(int32_t p) {
    if (!cached_[p]) return;
    index_.erase(hash_[p]);
    cached_[p] = 0;
    if (ref_[p] == 0) {  // an unreferenced page moves from the cached to the free count
        --num_cached_;
        ++num_free_;
    }
}

}  // namespace nmk::kv
