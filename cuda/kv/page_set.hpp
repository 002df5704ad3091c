// The physical pages of one attention group: reference counts, the free list and the
// prefix-cache index.
//
// Unreferenced pages sit in one intrusive doubly-linked list. Pages without a cache entry
// go to the head, cached pages to the tail, and allocation pops the head: plain free pages
// are used first, then cached pages in least-recently-released order. A prefix-cache hit
// takes a cached page out of the middle in O(1).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "northmk.h"

namespace nmk::kv {

class PageSet {
public:
    PageSet(uint32_t num_pages, uint32_t page_size);

    uint32_t total() const { return static_cast<uint32_t>(ref_.size()); }
    uint32_t available() const { return num_free_ + num_cached_; }
    nmk_kv_usage usage() const;
    uint64_t evictions() const { return evictions_; }

    // A page with reference count 1 (evicting the oldest cached page when no free one is
    // left). Precondition: available() > 0.
    int32_t allocate();
    void retain(int32_t page);
    void release(int32_t page);
    uint32_t refs(int32_t page) const { return ref_[page]; }

    // Index a referenced full page under `hash` (its chain: parent hash + its tokens). No-op
    // when the hash already names a page.
    void insert_cached(int32_t page, uint64_t hash, uint64_t parent, const int32_t *tokens);
    // The cached page for this chain link, or NMK_KV_NO_PAGE. Verifies tokens and parent,
    // so a hash collision is a miss.
    int32_t find_cached(uint64_t hash, uint64_t parent, const int32_t *tokens) const;
    // Drops the page's cache entry if it has one.
    void erase_cached(int32_t page);

private:
    void link_head(int32_t page);
    void link_tail(int32_t page);
    void unlink(int32_t page);

    uint32_t page_size_;
    std::vector<uint32_t> ref_;
    std::vector<int32_t> prev_, next_;  // free list links, NMK_KV_NO_PAGE-terminated
    int32_t head_ = NMK_KV_NO_PAGE, tail_ = NMK_KV_NO_PAGE;
    std::vector<uint8_t> cached_;        // page has a cache entry
    std::vector<uint64_t> hash_, parent_;
    std::vector<int32_t> tokens_;        // [pages, page_size] token ids of cached pages
    std::unordered_map<uint64_t, int32_t> index_;
    uint32_t num_free_ = 0, num_cached_ = 0, num_used_ = 0;
    uint64_t evictions_ = 0;
};

}  // namespace nmk::kv
