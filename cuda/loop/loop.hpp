// The decode loop: a thread that runs steps on a batch of rows and publishes tokens to a
// ring, parking at step boundaries on request. See include/northmk.h for the protocol.
//
// Locking: mu_ guards the state, the ring and the park fields. Rows change only while
// PARKED, so the loop thread reads them without mu_ while it runs a step.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "internal.hpp"
#include "kv/pool.hpp"

namespace nmk::loop {

struct Row {
    bool used = false;
    nmk_seq_id seq = 0;
    int32_t last_token = 0;
    uint32_t position = 0;
    uint32_t generated = 0;
    uint32_t remaining = 0;
    uint32_t min_new = 0;
    uint32_t flags = 0;
    std::vector<int32_t> stop;

    bool active() const { return used && !(flags & NMK_TOKEN_FINISHED); }
};

// Fixed-capacity FIFO of token events.
class Ring {
public:
    explicit Ring(size_t capacity) : slots_(capacity) {}
    size_t size() const { return size_; }
    size_t room() const { return slots_.size() - size_; }
    void push(const nmk_token_event &e);
    size_t pop(nmk_token_event *out, size_t cap);

private:
    std::vector<nmk_token_event> slots_;
    size_t head_ = 0, size_ = 0;
};

class Loop {
public:
    Loop(nmk::kv::Pool &pool, const nmk_loop_params &params);
    ~Loop();

    int fd() const { return fd_; }
    void state(nmk_loop_state *state, nmk_status *park_status);
    size_t park_message(char *buf, size_t size);
    void request_park();
    void park();
    void resume();
    size_t drain(nmk_token_event *out, size_t cap);
    void add_row(const nmk_loop_row_params &row);
    void remove_row(uint32_t slot);
    nmk_loop_row_info row(uint32_t slot);
    uint32_t num_rows();

private:
    void run();
    void check_caller() const;
    void check_parked() const;
    void signal();
    uint32_t num_active() const;
    nmk_status step(std::string &message);
    void publish();
    void park_locked(nmk_status status, const std::string &message);

    nmk::kv::Pool &pool_;
    nmk_loop_params params_;
    std::vector<Row> rows_;
    Ring ring_;
    int fd_ = -1;

    std::mutex mu_;
    std::condition_variable cv_;
    nmk_loop_state state_ = NMK_LOOP_PARKED;
    bool park_requested_ = false, stop_ = false;
    // A park whose fd signal a drain may have consumed before the state was read: drain
    // re-signals until state() has reported PARKED (or resume() ends the park).
    bool park_unreported_ = false;
    nmk_status park_status_ = NMK_OK;
    std::string park_message_;

    // The current step's batch (struct of arrays over active rows) and results.
    uint64_t step_index_ = 0;
    std::vector<uint32_t> slots_, positions_;
    std::vector<nmk_seq_id> seqs_;
    std::vector<int32_t> in_tokens_, out_tokens_;
    std::vector<float> logprobs_;

    std::thread thread_;
};

}  // namespace nmk::loop

struct nmk_loop : nmk::loop::Loop {
    using Loop::Loop;
};
