#include "loop/loop.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace nmk::loop {

namespace {
[[noreturn]] void throw_error(nmk_status status, const std::string &message) { throw Error(status, message); }
}  // namespace

void Ring::push(const nmk_token_event &e) {
    slots_[(head_ + size_) % slots_.size()] = e;
    ++size_;
}

size_t Ring::pop(nmk_token_event *out, size_t cap) {
    size_t n = std::min(cap, size_);
    for (size_t i = 0; i < n; ++i) out[i] = slots_[(head_ + i) % slots_.size()];
    head_ = (head_ + n) % slots_.size();
    size_ -= n;
    return n;
}

Loop::Loop(nmk::kv::Pool &pool, const nmk_loop_params &params)
    : pool_(pool), params_(params), rows_(params.max_rows), ring_(params.ring_capacity) {
    if (!params.step) throw_error(NMK_ERR_INVALID_ARGUMENT, "params.step is NULL");
    if (params.max_rows < 1 || params.max_rows > pool.params().max_rows)
        throw_error(NMK_ERR_INVALID_ARGUMENT, "max_rows must be in [1, pool max_rows " +
                    std::to_string(pool.params().max_rows) + "], got " + std::to_string(params.max_rows));
    if (params.ring_capacity < params.max_rows)
        throw_error(NMK_ERR_INVALID_ARGUMENT, "ring_capacity " + std::to_string(params.ring_capacity) +
                    " < max_rows " + std::to_string(params.max_rows));
    fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd_ < 0) throw_error(NMK_ERR_UNSUPPORTED, std::string("eventfd: ") + std::strerror(errno));
    thread_ = std::thread([this] { run(); });
}

Loop::~Loop() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
    for (uint32_t s = 0; s < rows_.size(); ++s)
        if (rows_[s].used) pool_.unbind_row(s);
    close(fd_);
}

void Loop::signal() {
    uint64_t one = 1;
    ssize_t ignored = write(fd_, &one, sizeof one);  // fails only at counter overflow: still readable
    (void)ignored;
}

void Loop::check_caller() const {
    if (std::this_thread::get_id() == thread_.get_id())
        throw_error(NMK_ERR_BAD_STATE, "not callable from inside the step function");
}

void Loop::check_parked() const {
    if (state_ != NMK_LOOP_PARKED) throw_error(NMK_ERR_BAD_STATE, "the loop is running; park it first");
}

uint32_t Loop::num_active() const {
    return static_cast<uint32_t>(std::count_if(rows_.begin(), rows_.end(), [](const Row &r) { return r.active(); }));
}

void Loop::park_locked(nmk_status status, const std::string &message) {
    state_ = NMK_LOOP_PARKED;
    park_requested_ = false;
    park_status_ = status;
    park_message_ = message;
    park_unreported_ = true;
    signal();
    cv_.notify_all();
}

void Loop::run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
        cv_.wait(lock, [&] {
            if (stop_) return true;
            if (state_ != NMK_LOOP_RUNNING) return false;
            uint32_t active = num_active();
            return park_requested_ || (active > 0 && ring_.room() >= active);
        });
        if (stop_) return;
        if (park_requested_) {
            park_locked(NMK_OK, "");
            continue;
        }
        lock.unlock();
        std::string message;
        nmk_status status;
        try {
            status = step(message);
        } catch (const std::exception &e) {
            status = NMK_ERR_INTERNAL, message = std::string("decode loop: ") + e.what();
        }
        lock.lock();
        if (status != NMK_OK) {
            park_locked(status, message);
            continue;
        }
        publish();
    }
}

// Pages for every active row's next position, then the step; rolled back if the step fails.
nmk_status Loop::step(std::string &message) {
    slots_.clear(), seqs_.clear(), in_tokens_.clear(), positions_.clear();
    std::vector<nmk::kv::Append> appends;
    for (uint32_t s = 0; s < rows_.size(); ++s) {
        const Row &r = rows_[s];
        if (!r.active()) continue;
        slots_.push_back(s), seqs_.push_back(r.seq), in_tokens_.push_back(r.last_token);
        positions_.push_back(r.position);
        appends.push_back({r.seq, &r.last_token, 1});
    }
    try {
        pool_.append(appends.data(), appends.size());
    } catch (const Error &e) {
        message = e.what();
        return e.status;
    }
    const auto &pp = pool_.params();
    nmk_step_batch batch{};
    batch.step = step_index_;
    batch.num_rows = static_cast<uint32_t>(slots_.size());
    batch.slots = slots_.data(), batch.seqs = seqs_.data();
    batch.tokens = in_tokens_.data(), batch.positions = positions_.data();
    batch.num_groups = pp.num_groups;
    batch.max_pages_per_seq = pool_.cols();
    for (uint32_t g = 0; g < pp.num_groups; ++g) batch.block_tables[g] = pool_.dense(g);
    out_tokens_.assign(slots_.size(), -1);
    logprobs_.assign(slots_.size(), 0.0f);
    nmk_step_result result{out_tokens_.data(), logprobs_.data()};
    int rc = params_.step(params_.step_user, &batch, &result);
    if (rc == NMK_OK) {
        auto bad = std::find_if(out_tokens_.begin(), out_tokens_.end(), [](int32_t t) { return t < 0; });
        if (bad == out_tokens_.end()) {
            ++step_index_;
            return NMK_OK;
        }
        message = "step " + std::to_string(step_index_) + " left a negative token id for slot " +
                  std::to_string(slots_[bad - out_tokens_.begin()]);
    } else {
        message = "step " + std::to_string(step_index_) + " failed with status " + std::to_string(rc) + " (" +
                  nmk_status_string(rc) + ")";
    }
    pool_.drop_last_token(seqs_.data(), seqs_.size());
    return NMK_ERR_STEP_FAILED;
}

// Applies the step's tokens to the rows and publishes them. Called with mu_ held.
void Loop::publish() {
    const uint32_t max_len = pool_.params().max_seq_len;
    for (size_t i = 0; i < slots_.size(); ++i) {
        Row &r = rows_[slots_[i]];
        int32_t t = out_tokens_[i];
        ++r.generated, --r.remaining, ++r.position;
        r.last_token = t;
        r.flags = 0;
        if (r.generated >= r.min_new && std::find(r.stop.begin(), r.stop.end(), t) != r.stop.end())
            r.flags = NMK_TOKEN_FINISHED | NMK_TOKEN_STOP;
        else if (r.remaining == 0 || r.position >= max_len)
            r.flags = NMK_TOKEN_FINISHED | NMK_TOKEN_LENGTH;
        ring_.push(nmk_token_event{r.seq, slots_[i], t, logprobs_[i], r.flags});
    }
    signal();
}

void Loop::state(nmk_loop_state *state, nmk_status *park_status) {
    std::lock_guard<std::mutex> lock(mu_);
    if (state) {
        *state = state_;
        if (state_ == NMK_LOOP_PARKED) park_unreported_ = false;
    }
    if (park_status) *park_status = park_status_;
}

size_t Loop::park_message(char *buf, size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    if (buf && size) {
        size_t n = std::min(park_message_.size(), size - 1);
        std::memcpy(buf, park_message_.data(), n);
        buf[n] = '\0';
    }
    return park_message_.size();
}

void Loop::request_park() {
    check_caller();
    std::lock_guard<std::mutex> lock(mu_);
    if (state_ == NMK_LOOP_PARKED) return;
    park_requested_ = true;
    cv_.notify_all();
}

void Loop::park() {
    check_caller();
    std::unique_lock<std::mutex> lock(mu_);
    if (state_ == NMK_LOOP_PARKED) return;
    park_requested_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return state_ == NMK_LOOP_PARKED; });
}

void Loop::resume() {
    check_caller();
    std::lock_guard<std::mutex> lock(mu_);
    check_parked();
    state_ = NMK_LOOP_RUNNING;
    park_unreported_ = false;
    park_status_ = NMK_OK;
    park_message_.clear();
    cv_.notify_all();
}

size_t Loop::drain(nmk_token_event *out, size_t cap) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t count;
    ssize_t ignored = read(fd_, &count, sizeof count);  // EAGAIN when nothing was signalled
    (void)ignored;
    size_t n = ring_.pop(out, cap);
    if (ring_.size() > 0 || park_unreported_) signal();
    if (n > 0) cv_.notify_all();  // the loop may be waiting for ring room
    return n;
}

void Loop::add_row(const nmk_loop_row_params &p) {
    check_caller();
    std::lock_guard<std::mutex> lock(mu_);
    check_parked();
    if (p.slot >= rows_.size())
        throw_error(NMK_ERR_INVALID_ARGUMENT, "slot " + std::to_string(p.slot) + " >= max_rows " +
                    std::to_string(rows_.size()));
    if (rows_[p.slot].used) throw_error(NMK_ERR_BAD_STATE, "slot " + std::to_string(p.slot) + " is occupied");
    if (p.max_new_tokens < 1) throw_error(NMK_ERR_INVALID_ARGUMENT, "max_new_tokens must be >= 1");
    if (p.num_stop_token_ids && !p.stop_token_ids)
        throw_error(NMK_ERR_INVALID_ARGUMENT, "stop_token_ids is NULL but num_stop_token_ids > 0");
    if (p.last_token < 0) throw_error(NMK_ERR_INVALID_ARGUMENT, "last_token must be >= 0");
    size_t position = pool_.length(p.seq);
    if (position >= pool_.params().max_seq_len)
        throw_error(NMK_ERR_INVALID_ARGUMENT, "sequence " + std::to_string(p.seq) + " already holds max_seq_len " +
                    std::to_string(pool_.params().max_seq_len) + " tokens");
    pool_.bind_row(p.slot, p.seq);
    Row &r = rows_[p.slot];
    r = Row{};
    r.used = true;
    r.seq = p.seq;
    r.last_token = p.last_token;
    r.position = static_cast<uint32_t>(position);
    r.remaining = p.max_new_tokens;
    r.min_new = p.min_new_tokens;
    r.stop.assign(p.stop_token_ids, p.stop_token_ids + p.num_stop_token_ids);
}

void Loop::remove_row(uint32_t slot) {
    check_caller();
    std::lock_guard<std::mutex> lock(mu_);
    check_parked();
    if (slot >= rows_.size() || !rows_[slot].used)
        throw_error(NMK_ERR_NOT_FOUND, "slot " + std::to_string(slot) + " holds no row");
    pool_.unbind_row(slot);
    rows_[slot] = Row{};
}

nmk_loop_row_info Loop::row(uint32_t slot) {
    std::lock_guard<std::mutex> lock(mu_);
    check_parked();
    if (slot >= rows_.size() || !rows_[slot].used)
        throw_error(NMK_ERR_NOT_FOUND, "slot " + std::to_string(slot) + " holds no row");
    const Row &r = rows_[slot];
    return nmk_loop_row_info{r.seq, r.last_token, r.position, r.generated, r.remaining, r.flags};
}

uint32_t Loop::num_rows() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<uint32_t>(std::count_if(rows_.begin(), rows_.end(), [](const Row &r) { return r.used; }));
}

}  // namespace nmk::loop
