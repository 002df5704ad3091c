/*
 * northmk.h: the C ABI of libnorthmk, the native half of the northmk serving engine.
 *
 * Strict C99. Three parts:
 *   - status codes, the thread-local last-error message, versions;
 *   - the paged KV block pool: page groups, per-sequence block tables, reference counts,
 *     sliding-window release, a prefix cache, dense per-row block tables for a decode step;
 *   - the decode loop: a native thread that runs decode steps on a batch of rows, publishes
 *     tokens to a ring and signals a file descriptor; it parks at a step boundary on request.
 *
 * Conventions. Every fallible function returns nmk_status; on failure it also sets the
 * calling thread's last-error message (nmk_last_error) and, unless stated, changes nothing.
 * Output pointers are written only on success. Objects are opaque; each *_create has a
 * *_destroy that accepts NULL. Strings returned as `const char *` are static.
 */
#ifndef NORTHMK_H
#define NORTHMK_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#  define NMK_API __declspec(dllexport)
#elif defined(__GNUC__)
#  define NMK_API __attribute__((visibility("default")))
#else
#  define NMK_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on every incompatible change of a declaration below, and when a declaration is added
 * that the package's bindings call (10: nmk_schedule_waits_in_run); nmk_abi_version() returns
 * the library's value and bindings refuse a library whose value differs from theirs. */
#define NMK_ABI_VERSION 10

/* ==== status, errors, versions ==== */

/* Append-only; numbers are fixed forever.
 * Recoverable: NMK_ERR_NO_SPACE (free pages or preempt a sequence, then retry),
 *              NMK_ERR_NOT_FOUND, NMK_ERR_INVALID_ARGUMENT, NMK_ERR_BAD_STATE (the call was
 *              wrong; the object is unchanged), NMK_ERR_UNSUPPORTED (feature absent in this
 *              build, e.g. CUDA).
 * Fatal for the object involved: NMK_ERR_CUDA, NMK_ERR_OUT_OF_MEMORY, NMK_ERR_INTERNAL
 *              (destroy it). NMK_ERR_STEP_FAILED: a decode step failed; the loop is parked,
 *              its state consistent, and it may be resumed to retry. */
typedef enum nmk_status {
    NMK_OK = 0,
    NMK_ERR_INVALID_ARGUMENT = 1,
    NMK_ERR_NO_SPACE = 2,
    NMK_ERR_NOT_FOUND = 3,
    NMK_ERR_BAD_STATE = 4,
    NMK_ERR_UNSUPPORTED = 5,
    NMK_ERR_CUDA = 6,
    NMK_ERR_STEP_FAILED = 7,
    NMK_ERR_OUT_OF_MEMORY = 8,
    NMK_ERR_INTERNAL = 9
} nmk_status;

/* Name of a status ("NMK_ERR_NO_SPACE"); "NMK_UNKNOWN_STATUS" for other values. Thread-safe. */
NMK_API const char *nmk_status_string(int status);

/* Copies the calling thread's last-error message (NUL-terminated, truncated to size - 1
 * bytes; nothing written when buf is NULL or size is 0) and returns its full length.
 * Set by every call that fails on this thread; successful calls leave it unchanged. */
NMK_API size_t nmk_last_error(char *buf, size_t size);

/* Library version, e.g. "0.1.0". Static string. Thread-safe. */
NMK_API const char *nmk_version(void);

/* NMK_ABI_VERSION as compiled into the library. Thread-safe. */
NMK_API uint32_t nmk_abi_version(void);

/* Nonzero when the library was built with CUDA (the megakernel). Thread-safe. */
NMK_API int nmk_has_cuda(void);

/* ==== paged KV block pool ==== */

/* Layers are grouped by attention kind (full first, then sliding); each group has its own
 * page pool and its own block table per sequence. Logical page j of a sequence covers
 * positions [j*page_size, (j+1)*page_size); its physical page id is in [0, num_pages[g]).
 *
 * Sharing: only FULL pages are ever shared (forks and prefix-cache hits); a full page is
 * never written again, so no copy-on-write exists. A fork copies the partially filled last
 * page: the pool allocates a fresh page and reports the (src, dst) pair the caller copies.
 *
 * Thread-safety: every nmk_kv_* call is serialized by a mutex inside the pool, so any
 * thread may call them. The dense block tables (nmk_kv_pool_block_table) are plain memory
 * written under that mutex: read them from a decode step or while the loop is parked.
 *
 * Sequences are named by nmk_seq_id values (never 0), so a stale id gives
 * NMK_ERR_NOT_FOUND instead of undefined behaviour. Ids are not reused by a pool. */
#define NMK_KV_MAX_GROUPS 4
#define NMK_KV_NO_PAGE (-1)

typedef struct nmk_kv_pool nmk_kv_pool;
typedef uint64_t nmk_seq_id;

typedef struct nmk_kv_pool_params {
    uint32_t num_groups;                     /* 1..NMK_KV_MAX_GROUPS */
    uint32_t num_pages[NMK_KV_MAX_GROUPS];   /* physical pages per group, >= 1 */
    uint32_t window[NMK_KV_MAX_GROUPS];      /* keys visible incl. the current token; 0 = full attention */
    uint32_t page_size;                      /* tokens per page; default 64 */
    uint32_t max_seq_len;                    /* tokens per sequence, >= 1; default 8192 */
    uint32_t max_rows;                       /* rows of the dense block tables; default 8 */
    uint64_t model_key;                      /* namespaces the prefix cache (hash of the model); default 0 */
    int enable_prefix_cache;                 /* nonzero: register full pages and serve hits; default 1 */
} nmk_kv_pool_params;

/* Defaults: one full-attention group of 1024 pages, the values noted above. */
NMK_API nmk_kv_pool_params nmk_kv_pool_default_params(void);

/* Creates a pool. *out is owned by the caller: release with nmk_kv_pool_destroy. */
NMK_API nmk_status nmk_kv_pool_create(const nmk_kv_pool_params *params, nmk_kv_pool **out);

/* Destroys the pool and every sequence in it. NULL is a no-op. No loop may still use it. */
NMK_API void nmk_kv_pool_destroy(nmk_kv_pool *pool);

/* Creates a sequence. When tokens is non-NULL and the prefix cache holds pages for a
 * prefix of tokens[0..n), the sequence starts with the longest such prefix (a multiple of
 * page_size, at most n - 1 tokens so at least one prompt token is left to compute):
 * *n_cached (may be NULL) receives its length. The remaining tokens are NOT appended;
 * call nmk_kv_seq_append with tokens[*n_cached..n). Counts as one prefix lookup. */
NMK_API nmk_status nmk_kv_seq_create(nmk_kv_pool *pool, const int32_t *tokens, size_t n,
                                     nmk_seq_id *out, size_t *n_cached);

/* How many prompt tokens nmk_kv_seq_create would take from the cache now (no state change,
 * not counted in the statistics). */
NMK_API nmk_status nmk_kv_prefix_lookup(nmk_kv_pool *pool, const int32_t *tokens, size_t n,
                                        size_t *n_cached);

/* Releases the sequence's pages (full, hashed pages stay cached until evicted) and its id.
 * NMK_ERR_BAD_STATE while it is bound to a row (remove the loop row first). */
NMK_API nmk_status nmk_kv_seq_free(nmk_kv_pool *pool, nmk_seq_id seq);

/* Records n tokens at positions [len, len + n) (their KV is about to be written), gets a
 * page for each of those positions in every group and releases sliding-window pages that
 * lie wholly before the window of position len (pages of a long append that fall behind the
 * window go at the next append). The caller must write the KV of appended
 * tokens before the next nmk_kv_seq_create. NMK_ERR_NO_SPACE: no token recorded and no
 * page taken (dead sliding pages may still have been released).
 * NMK_ERR_INVALID_ARGUMENT when len + n would exceed max_seq_len. */
NMK_API nmk_status nmk_kv_seq_append(nmk_kv_pool *pool, nmk_seq_id seq, const int32_t *tokens,
                                     size_t n);

/* Takes now, in every group, the pages that positions [len, len + n) will need, so that the
 * nmk_kv_seq_append recording them takes none: for a decode step enqueued before the step it
 * follows has published its token. They are the sequence's and show in its block tables;
 * nmk_kv_seq_free releases them, a fork's child does not get them, and the decode loop's undo
 * of a failed step drops them. A no-op when those positions have their pages. NMK_ERR_NO_SPACE:
 * none taken. NMK_ERR_INVALID_ARGUMENT when len + n would exceed max_seq_len. */
NMK_API nmk_status nmk_kv_seq_reserve(nmk_kv_pool *pool, nmk_seq_id seq, size_t n);

/* One page to copy: in group `group`, page src's contents into page dst. */
typedef struct nmk_kv_page_copy {
    uint32_t group;
    int32_t src;
    int32_t dst;
} nmk_kv_page_copy;

/* Creates *child with the same tokens as src: full pages are shared (reference counted), a
 * partially filled last page gets a fresh page per group, listed in copies[0..*n_copies)
 * for the caller to copy before using either sequence. cap must be >= num_groups.
 * NMK_ERR_NO_SPACE: nothing changed. */
NMK_API nmk_status nmk_kv_seq_fork(nmk_kv_pool *pool, nmk_seq_id src, nmk_seq_id *child,
                                   nmk_kv_page_copy *copies, size_t cap, size_t *n_copies);

/* Number of tokens recorded for the sequence (its next position). */
NMK_API nmk_status nmk_kv_seq_length(nmk_kv_pool *pool, nmk_seq_id seq, size_t *out);

/* Copies the sequence's block table of one group, one entry per logical page
 * (NMK_KV_NO_PAGE where released), into out[0..min(cap, pages)); *n_pages = page count. */
NMK_API nmk_status nmk_kv_seq_block_table(nmk_kv_pool *pool, nmk_seq_id seq, uint32_t group,
                                          int32_t *out, size_t cap, size_t *n_pages);

/* Binds a sequence to row `row` of the dense block tables (kept current by every later
 * change to the sequence) / clears the row to NMK_KV_NO_PAGE. A sequence has at most one
 * row. The decode loop binds its rows itself. */
NMK_API nmk_status nmk_kv_pool_bind_row(nmk_kv_pool *pool, uint32_t row, nmk_seq_id seq);
NMK_API nmk_status nmk_kv_pool_unbind_row(nmk_kv_pool *pool, uint32_t row);

/* Dense block table of a group: int32 [*rows = max_rows][*cols = pages per max_seq_len],
 * row-major, NMK_KV_NO_PAGE when absent. Owned by the pool, valid until it is destroyed. */
NMK_API nmk_status nmk_kv_pool_block_table(nmk_kv_pool *pool, uint32_t group, const int32_t **data,
                                           uint32_t *rows, uint32_t *cols);

typedef struct nmk_kv_usage {
    uint32_t total;   /* physical pages */
    uint32_t used;    /* referenced by a sequence */
    uint32_t cached;  /* unreferenced, holding a prefix-cache entry (evictable, LRU) */
    uint32_t free;    /* unreferenced, no cache entry */
} nmk_kv_usage;

/* Page counts of one group; used + cached + free == total. */
NMK_API nmk_status nmk_kv_pool_usage(nmk_kv_pool *pool, uint32_t group, nmk_kv_usage *out);

typedef struct nmk_kv_prefix_stats {
    uint64_t lookups;        /* nmk_kv_seq_create calls with tokens */
    uint64_t query_tokens;   /* tokens offered to those lookups */
    uint64_t hit_tokens;     /* tokens served from the cache */
    uint64_t evictions;      /* cached pages reused for new data */
} nmk_kv_prefix_stats;

NMK_API nmk_status nmk_kv_pool_prefix_stats(nmk_kv_pool *pool, nmk_kv_prefix_stats *out);

/* ==== decode loop ==== */

/* A native thread that owns decode while running. Each iteration: make sure every active
 * row has a page for its next position in every group (appending its last token to its
 * sequence; all rows or none), run the step, then per row record the sampled token, apply
 * stop ids / budget / max_seq_len, publish one ring entry and signal the fd.
 *
 * States: created PARKED. nmk_loop_resume -> RUNNING. It parks at a step boundary when
 * asked (park status NMK_OK), when pages run out (NMK_ERR_NO_SPACE: nothing was changed
 * for that step; free pages or remove a row, then resume), or when the step fails
 * (NMK_ERR_STEP_FAILED: the step's page appends are rolled back; no published token is
 * lost). Entering PARKED signals the fd (creation does not: a new loop is parked
 * silently). Every entry is published before the park, so a reader that sees PARKED and
 * then drains has every token. Running with no active row waits idle.
 *
 * Thread-safety: any thread may call nmk_loop_*, except from inside the step function
 * (NMK_ERR_BAD_STATE). add_row/remove_row/resume require PARKED. The pool is used by the
 * loop while running; it must outlive the loop. */
typedef struct nmk_loop nmk_loop;

/* Input of one step, struct of arrays over the active rows (ascending slot). */
typedef struct nmk_step_batch {
    uint64_t step;                 /* 0, 1, ... for this loop */
    uint32_t num_rows;
    const uint32_t *slots;         /* dense block-table row of each row */
    const nmk_seq_id *seqs;
    const int32_t *tokens;         /* input token: its KV is written at positions[i] */
    const uint32_t *positions;
    uint32_t num_groups;
    uint32_t max_pages_per_seq;    /* columns of each block table */
    const int32_t *block_tables[NMK_KV_MAX_GROUPS];  /* the pool's dense tables, [max_rows][cols] */
} nmk_step_batch;

/* Output of one step: the step writes one sampled token and its logprob per row. */
typedef struct nmk_step_result {
    int32_t *tokens;               /* [num_rows] */
    float *logprobs;               /* [num_rows] */
} nmk_step_result;

/* Runs one decode step on the loop thread. Returns NMK_OK, or any other status to fail. */
typedef int (*nmk_step_fn)(void *user, const nmk_step_batch *batch, nmk_step_result *result);

typedef struct nmk_loop_params {
    uint32_t max_rows;         /* row slots, <= the pool's max_rows; default 8 */
    uint32_t ring_capacity;    /* ring entries, >= max_rows; default 4096. Full ring: the loop waits */
    nmk_step_fn step;          /* required */
    void *step_user;           /* passed to step; owned by the caller, must outlive the loop */
} nmk_loop_params;

NMK_API nmk_loop_params nmk_loop_default_params(void);

/* Creates a parked loop and its thread. *out owned by the caller (nmk_loop_destroy).
 * NMK_ERR_UNSUPPORTED where eventfd is unavailable. */
NMK_API nmk_status nmk_loop_create(nmk_kv_pool *pool, const nmk_loop_params *params, nmk_loop **out);

/* Stops the thread at a step boundary, unbinds its rows (their sequences stay in the pool)
 * and frees the loop. Unread ring entries are lost. NULL is a no-op. */
NMK_API void nmk_loop_destroy(nmk_loop *loop);

/* Readable (eventfd counter > 0) when ring entries were published or the loop parked.
 * Owned by the loop; do not close it. nmk_loop_drain consumes the notification. */
NMK_API int nmk_loop_fd(const nmk_loop *loop);

typedef enum nmk_loop_state {
    NMK_LOOP_PARKED = 0,
    NMK_LOOP_RUNNING = 1
} nmk_loop_state;

/* Current state, and the status of the latest park (meaningful while parked). */
NMK_API nmk_status nmk_loop_get_state(nmk_loop *loop, nmk_loop_state *state, nmk_status *park_status);

/* The message of the latest failed park (the step's failure or the missing pages), like
 * nmk_last_error: returns its full length; "" after a requested park. */
NMK_API size_t nmk_loop_park_message(nmk_loop *loop, char *buf, size_t size);

/* Asks the loop to park after the current step; returns at once. The fd signals when
 * parked. No-op while parked. */
NMK_API nmk_status nmk_loop_request_park(nmk_loop *loop);

/* request_park and wait until parked. */
NMK_API nmk_status nmk_loop_park(nmk_loop *loop);

/* PARKED -> RUNNING. NMK_ERR_BAD_STATE unless parked. */
NMK_API nmk_status nmk_loop_resume(nmk_loop *loop);

/* Ring entry flags. */
#define NMK_TOKEN_FINISHED 1u   /* the row's last token; it stays in the batch, idle */
#define NMK_TOKEN_STOP 2u       /* finished on a stop token id (e.g. EOS) */
#define NMK_TOKEN_LENGTH 4u     /* finished on the token budget or max_seq_len */

typedef struct nmk_token_event {
    nmk_seq_id seq;
    uint32_t slot;
    int32_t token;
    float logprob;
    uint32_t flags;            /* NMK_TOKEN_* */
} nmk_token_event;

/* Consumes the fd notification, then moves up to cap entries, oldest first, to out;
 * *n receives the count. Re-signals the fd when entries remain, and after a park that
 * nmk_loop_get_state has not reported yet (so a consumer that reads the state, then drains,
 * never loses a park that came between the two). Any state. */
NMK_API nmk_status nmk_loop_drain(nmk_loop *loop, nmk_token_event *out, size_t cap, size_t *n);

typedef struct nmk_loop_row_params {
    uint32_t slot;                  /* < max_rows and free */
    nmk_seq_id seq;                 /* a sequence of the loop's pool, not bound to a row */
    int32_t last_token;             /* sampled, not yet in the KV; its position is the sequence length */
    uint32_t max_new_tokens;        /* tokens this row may still generate, >= 1 */
    uint32_t min_new_tokens;        /* stop ids are ignored before this many */
    const int32_t *stop_token_ids;  /* copied; may be NULL when num_stop_token_ids is 0 */
    uint32_t num_stop_token_ids;
} nmk_loop_row_params;

/* Adds an active row (binds its sequence to the slot's block-table row). PARKED only. */
NMK_API nmk_status nmk_loop_add_row(nmk_loop *loop, const nmk_loop_row_params *row);

/* Removes a row, finished or not, and unbinds its sequence (which stays in the pool; free
 * or keep it). PARKED only. */
NMK_API nmk_status nmk_loop_remove_row(nmk_loop *loop, uint32_t slot);

typedef struct nmk_loop_row_info {
    nmk_seq_id seq;
    int32_t last_token;
    uint32_t position;              /* where last_token's KV goes */
    uint32_t generated;             /* tokens published for this row */
    uint32_t remaining;             /* budget left */
    uint32_t flags;                 /* NMK_TOKEN_* of its last event; FINISHED once done */
} nmk_loop_row_info;

/* NMK_ERR_NOT_FOUND for an empty slot. PARKED only. */
NMK_API nmk_status nmk_loop_row(nmk_loop *loop, uint32_t slot, nmk_loop_row_info *out);

/* Rows in the batch (active or finished). Any state. */
NMK_API nmk_status nmk_loop_num_rows(nmk_loop *loop, uint32_t *out);

/* ==== GPU sampling: owned by cuda/sample ==== */

/* One token per row drawn on the GPU by one kernel launch, without a sort (a row's vocab in up to
 * 32 slices of at least 2048 logits, one CTA each, as many as the SMs hold for all rows at once;
 * the CTAs of a row meet at barriers in a scratch of the device's, so calls on one device must
 * run one after another, e.g. in one stream):
 * s_i = logit_i * (1 / temperature); top_k, top_p and min_p each keep the tokens whose s is at or
 * above a threshold (ties at a threshold are all kept), then the token is the argmax over
 * kept i of s_i + gumbel_i (lowest id on ties), where gumbel_i is a counter-based hash of
 * (seed, counter, i): the same (seed, counter) draws the same token on any GPU, and
 * northmk/engine/gpu_sampling.py (reference_draw) computes it bit for bit on the CPU.
 * NaN logits count as -inf. Without CUDA: NMK_ERR_UNSUPPORTED after argument checks. */
enum { NMK_SAMPLE_MAX_ROWS = 64, NMK_SAMPLE_MAX_VOCAB = 1 << 24 };

typedef struct nmk_sample_row {
    float temperature;   /* <= 0: greedy (argmax of the raw logits, lowest id on ties); else >= FLT_MIN */
    int32_t top_k;       /* <= 0: off */
    float top_p;         /* (0, 1]; 1: off */
    float min_p;         /* [0, 1]; 0: off */
    uint64_t seed;       /* per sequence */
    uint64_t counter;    /* index of this draw in the sequence (tokens generated before it) */
} nmk_sample_row;

/* Draws one token per row from device logits [rows, vocab] (fp32, row-major) on `stream`
 * (a cudaStream_t, NULL = default); writes device tokens[rows] (int32) and, when logprobs is
 * not NULL, device logprobs[rows] (fp32): the drawn token's log-softmax of the RAW logits.
 * rows in [1, NMK_SAMPLE_MAX_ROWS], vocab in [1, NMK_SAMPLE_MAX_VOCAB]. params is host
 * memory, read during the call (passed to the kernel by value). No host synchronization;
 * may be captured in a CUDA graph (the params are then frozen into it). */
NMK_API nmk_status nmk_sample(const float *logits, uint32_t rows, uint32_t vocab,
                              const nmk_sample_row *params, int32_t *tokens, float *logprobs, void *stream);

/* ==== megakernel and task schedule: owned by cuda/mk and cuda/schedule ==== */

/* A decode step is one persistent kernel: one CTA per SM runs its own list of tasks; a
 * task waits until a counter in device memory reaches its target, runs, then bumps its
 * signal counter. The schedule (host-built, cached per batch size and context bucket)
 * holds those lists and the device work queues (v3):
 *
 *   - Queue q is an ordered array of ordinary tasks (same opcodes, fields and counters as
 *     list tasks). Every list holds exactly one DRAIN(q) entry per queue. A CTA reaching
 *     DRAIN(q) repeatedly claims the next unclaimed task of q (one atomic claim head per
 *     queue, in queue order) and runs it as if it were the next task of its own list (wait
 *     until counters[wait] >= target, run, bump signal), until q has no unclaimed task left;
 *     then it continues its list. A wait target counts all signallers of the counter,
 *     wherever they live (lists or queues). A CTA may claim ahead while it runs a task if
 *     it runs its claims in claim order: the rule below keeps that safe too.
 *   - Safety (nmk_schedule_check), so that every claim interleaving finishes: the
 *     must-finish-before relation is acyclic. It is the union of (i) each list's order,
 *     (ii) each queue's order, (iii) per list, the entry before DRAIN(q) before q's first
 *     task and q's last task before DRAIN(q) (the list runs the whole queue in place of its
 *     DRAIN), (iv) every signaller of a counter before every task waiting on it. Two
 *     consequences, reported by name: a task of queue q waits only on counters signalled
 *     by earlier tasks of q, by list tasks before DRAIN(q) in their own list, or by tasks
 *     of a queue q' whose DRAIN comes before DRAIN(q) in every list; and a list task that
 *     waits on a counter a task of queue q signals comes after DRAIN(q) in its list.
 *
 * Counters, then the claim heads of the queues (counters[num_counters + q]), live together
 * in device memory, in two sets that a schedule's launches take in turn: each launch zeroes
 * the set of the launch before it, so that the step ends with its last task. */

enum { NMK_MK_MAX_BATCH = 8, NMK_MK_MAX_SPLITS = 64, NMK_MK_BLOCK_COLS = 256, NMK_MK_POST_SCALED_MAX_BATCH = 2 };

/* Append-only; 0 is never valid so zeroed memory fails loudly. Semantics of v0.6: the
 * residual entering layer l is a sum x_l in fp32 that layer l - 1's OPROJ and DOWN tasks add
 * their outputs into (layer 0's: the embedding, which the NORM tiles write). Its columns are
 * blocks of NMK_MK_BLOCK_COLS (hidden is a multiple of it), each with its own counter: a task
 * that writes x_l (NORM, OPROJ, DOWN) writes columns of one block only and signals that
 * block's counter. The readers of x_l (QKV, ROUTER, a dense layer's GATE_UP; LM_HEAD of x_L)
 * wait on the hidden / NMK_MK_BLOCK_COLS counters wait, wait + 1, ... (block b's at wait + b),
 * each until it reaches target; up to NMK_MK_POST_SCALED_MAX_BATCH rows QKV and ROUTER may
 * start on each block once its own counter does. Every task that reads the normed input h but
 * a sparse GATE_UP computes it from x_l itself: x = bf16(x_l), rms_b = rsqrt(sum_i x[b, i]^2 /
 * hidden + eps), h[b, i] = bf16(round_bf16(x[b, i] * rms_b) * norm_weight[i]); up to
 * NMK_MK_POST_SCALED_MAX_BATCH rows QKV and ROUTER scale after their GEMV instead: output
 * bf16(rms_b * sum_i g[b, i] w[i]) with g[b, i] = bf16(x[b, i] * norm_weight[i]). The routing
 * tile (ROUTER) writes h (as above, both ways) for the layer's sparse GATE_UP tasks. (v0.5: one counter
 * for all of x_l, no post-scaling; v0.4: NORM tiles closed every layer's residual and
 * FINAL_NORM the last one's.) */
typedef enum nmk_opcode {
    NMK_OP_NORM = 1,       /* layer 0 only, tile x: hidden cols [x*norm_cols, ...) of every row's
                            * embedding into x_0; zeroes the same columns of x_1 */
    NMK_OP_QKV = 2,        /* rows [x*qkv_rows, ...) of qkv @ h; RoPE; k, v into the paged cache */
    NMK_OP_ROUTER = 3,     /* tile x: router_logits[b, e] = bf16(h_b . router[e]) (post-scaled up
                            * to NMK_MK_POST_SCALED_MAX_BATCH rows, above), e in
                            * [x*router_rows, ...). The last tile (x = router_tiles - 1, the
                            * routing tile) waits for the other tiles' logits (a poll, no
                            * counter: the schedule must order them before it), writes h whole
                            * and routes the layer: row b's top_k logits (ties: lower id),
                            * ascending id, weight bf16(sigmoid(logit)); slot y = the y-th
                            * smallest distinct pick (-1 past them); it writes slot_expert and
                            * the debug experts. */
    NMK_OP_ATTN = 4,       /* row x, kv head y, split z & 0xff of z >> 8: partial softmax(qk)v;
                            * the pair's last split to finish merges all of them into attn_out */
    NMK_OP_COMBINE = 5,    /* retired in v0.3, never emitted (ATTN merges); the checker rejects it */
    NMK_OP_OPROJ = 6,      /* rows [x*oproj_rows, ...) of o @ attn_out: adds bf16(x + bf16(o))
                            * into x_{l+1} (x = bf16(x_l)); zeroes those rows of x_{l+2} */
    NMK_OP_GATE_UP = 7,    /* mlp slot y, intermediate cols [x*cols, ...): silu(gate) * up. On a
                            * sparse layer, of slot_expert[y] (nothing for -1) with the h the
                            * routing tile wrote. */
    NMK_OP_DOWN = 8,       /* mlp slot y, hidden rows [x*rows, ...) of down @ act, times each row's
                            * routing weight of the slot (sparse layers), added into x_{l+1} */
    NMK_OP_FINAL_NORM = 9, /* retired in v0.5, never emitted (LM_HEAD normalizes x_L itself);
                            * the checker rejects it */
    NMK_OP_LM_HEAD = 10,   /* vocab rows [x*lm_rows, ...) of embed @ h (final_norm, from x_L):
                            * scaled logits, per-tile argmax */
    NMK_OP_ARGMAX = 11,    /* row x: greedy token from the per-tile argmaxes */
    NMK_OP_DRAIN = 12,     /* list entries only: drain queue x (see above). y = z = 0, wait = -1,
                            * target = 0, signal = -1; layer is free (the builder writes the
                            * queue's layer) */
    NMK_OP_END = 13        /* one past the last opcode */
} nmk_opcode;

typedef struct nmk_task {
    uint8_t op;            /* nmk_opcode */
    uint8_t layer;
    uint16_t x, y, z;      /* meaning per opcode, above */
    int32_t wait;          /* counter to wait on, -1: none; the first of the input's block
                            * counters for a reader of x_l (above) */
    uint32_t target;       /* run once counters[wait] (each of the block counters) >= target */
    int32_t signal;        /* counter to bump when done, -1: none */
} nmk_task;

/* Tile geometry of one schedule, chosen by the builder and obeyed by the kernel. Row and
 * column tiles are multiples of 16 (tensor-core tiles); the last tile of a stage may be short. */
typedef struct nmk_plan {
    int32_t batch;
    int32_t expert_slots;     /* min(batch * top_k, experts): one per distinct routed expert */
    int32_t norm_cols;        /* hidden columns per NORM / FINAL_NORM task: 32 */
    int32_t norm_tiles;       /* hidden / norm_cols: the partial sums of squares per row */
    int32_t qkv_rows;         /* <= 128 */
    int32_t router_rows;      /* experts per ROUTER task: 16 */
    int32_t router_tiles;     /* ceil(experts / router_rows) */
    int32_t oproj_rows;       /* <= 128 */
    int32_t moe_cols;         /* expert intermediate columns per GATE_UP task, <= 128 */
    int32_t moe_down_rows;    /* <= 256 */
    int32_t dense_cols;       /* <= 128 */
    int32_t dense_down_rows;  /* <= 128 */
    int32_t lm_rows;          /* <= 512 */
    int32_t lm_tiles;
    int32_t max_splits;       /* most attention splits of any row */
    int32_t num_counters;
    int32_t num_queues;       /* device work queues (the builder: one per layer) */
} nmk_plan;

/* Model geometry as the megakernel and the schedule see it. Per-layer arrays have
 * num_layers entries (nonzero = yes) and are read only during the call they are passed to. */
typedef struct nmk_mk_geometry {
    int32_t hidden, num_layers, num_heads, num_kv_heads, head_dim;
    int32_t num_experts, top_k, moe_inter, dense_inter, vocab;
    int32_t sliding_window;   /* keys a sliding layer sees, the current token included */
    int32_t page_size;        /* 64 */
    float rope_theta, norm_eps, logit_scale;
    const uint8_t *dense;     /* dense MLP, else routed experts (sigmoid top-k, no renorm) */
    const uint8_t *sliding;   /* sliding-window attention, else full */
    const uint8_t *rope;      /* interleaved RoPE on q and k */
} nmk_mk_geometry;

typedef struct nmk_schedule nmk_schedule;

/* Builds the schedule of a step of `batch` rows where row r sees context_lens[r] tokens
 * (its new one included); valid for any step whose lengths are <= these. *out is owned by
 * the caller (nmk_schedule_destroy). Host only; always available. */
NMK_API nmk_status nmk_schedule_create(const nmk_mk_geometry *geometry, uint32_t num_sms,
                                       const int32_t *context_lens, uint32_t batch, nmk_schedule **out);
NMK_API void nmk_schedule_destroy(nmk_schedule *schedule);
NMK_API nmk_status nmk_schedule_plan(const nmk_schedule *schedule, nmk_plan *out);

/* The task array: the lists, then the queues. SM s runs tasks[sm_offsets[s] ..
 * sm_offsets[s + 1]) (sm_offsets[0] == 0); the queues follow (nmk_schedule_queues).
 * Owned by the schedule, valid until it is destroyed. */
NMK_API nmk_status nmk_schedule_tasks(const nmk_schedule *schedule, const nmk_task **tasks,
                                      const uint32_t **sm_offsets, uint32_t *num_sms);

/* Queue q holds tasks[queue_offsets[q] .. queue_offsets[q + 1]) of nmk_schedule_tasks'
 * array; queue_offsets has *num_queues + 1 entries, queue_offsets[0] == sm_offsets[num_sms]
 * and queue_offsets[*num_queues] is the array's length. Owned by the schedule. The builder
 * makes one queue per layer l: its GATE_UP tasks (slot-major) with the ATTN tasks (row, kv
 * head, split) after the first num_sms - splits of them, DOWN tasks (slot-major), then OPROJ
 * tasks; the lists hold the layer's NORM, QKV
 * and ROUTER tiles, then DRAIN(l), and after the last layer FINAL_NORM, LM_HEAD, ARGMAX. */
NMK_API nmk_status nmk_schedule_queues(const nmk_schedule *schedule, const uint32_t **queue_offsets,
                                       uint32_t *num_queues);

/* NMK_OK when the lists and queues are safe to run: a plan whose tiles fit the geometry and
 * the kernel's limits, known opcodes (not the retired COMBINE), every task of the step
 * exactly once across lists and queues, each wait for all signallers of its counter and all
 * of the stages it reads, no two unordered stages sharing a buffer, well-formed DRAIN
 * entries (a known queue, no wait or signal, exactly one per queue in every list, none in a
 * queue), an acyclic must-finish-before relation (above) and a step that finishes. The
 * array is as nmk_schedule_tasks and nmk_schedule_queues give it: queue_offsets has
 * plan->num_queues + 1 nondecreasing entries starting at sm_offsets[num_sms]; it may be
 * NULL only when plan->num_queues is 0. Else NMK_ERR_INVALID_ARGUMENT with the first
 * violation as the last error. */
NMK_API nmk_status nmk_schedule_check(const nmk_mk_geometry *geometry, const nmk_plan *plan,
                                      const nmk_task *tasks, const uint32_t *sm_offsets, uint32_t num_sms,
                                      const uint32_t *queue_offsets);

/* spans[i] = how many counters tasks[i] waits on, each until it reaches its target: counters
 * wait .. wait + span - 1 (v0.6: hidden / NMK_MK_BLOCK_COLS for a reader of a layer's input,
 * 1 for any other task with a wait, 0 for wait = -1), for i < count. The rule the builder, the
 * checker and the kernel follow, for tools that replay a schedule. tasks and spans may be NULL
 * only when count is 0. NMK_ERR_INVALID_ARGUMENT for a NULL argument, a geometry the schedule
 * cannot take, or a GATE_UP task whose layer is not below num_layers (as nmk_schedule_waits_in_run).
 * Host only; always available. */
NMK_API nmk_status nmk_schedule_wait_spans(const nmk_mk_geometry *geometry, const nmk_task *tasks, size_t count,
                                           uint32_t *spans);

/* inside[i] = 1 when tasks[i], a task of a step of `batch` rows, waits for its counters inside its
 * run rather than before it (so its timing record's start stamp precedes its wait), else 0, for
 * i < count: a task with a wait that is a QKV or ROUTER tile up to NMK_MK_POST_SCALED_MAX_BATCH
 * rows (it starts on each block of its input once that block's counter is complete), a sparse
 * layer's GATE_UP (it polls the routing itself) or an attention split (it loads its page numbers
 * first). The rule the kernel follows, for tools that read its task times. tasks and inside may
 * be NULL only when count is 0. NMK_ERR_INVALID_ARGUMENT for a NULL argument, a batch outside
 * 1..NMK_MK_MAX_BATCH, a geometry the schedule cannot take, or a GATE_UP task whose layer is not
 * below num_layers. Host only; always available. */
NMK_API nmk_status nmk_schedule_waits_in_run(const nmk_mk_geometry *geometry, uint32_t batch, const nmk_task *tasks,
                                             size_t count, uint8_t *inside);

/* ---- the megakernel (CUDA builds; NMK_ERR_UNSUPPORTED otherwise) ---- */

/* Device pointers (bf16 unless noted) in the layout of northmk/model/weights.py, except those
 * marked "tiled": a [R, K] matrix in the tiled layout (northmk.megakernel.tiled_layout) has R
 * rounded up to a multiple of 16 with zero rows, and each band of 16 rows stored as its K / 32
 * blocks of [16, 32] (row-major inside), one after another: element (r, c) at
 * (r - r % 16) * K + (c / 32) * 512 + (r % 16) * 32 + c % 32. */
typedef struct nmk_mk_layer {
    const void *norm;             /* [H] */
    const void *qkv;              /* [Q + 2 KV, H], tiled */
    const void *o;                /* [H, Q], tiled */
    const void *gate_up;          /* dense: [2 D, H], gate rows first, tiled */
    const void *down;             /* dense: [H, D], tiled */
    const void *router;           /* sparse: [E, H], tiled */
    const void *experts_gate_up;  /* sparse: [E, 2 I, H], each expert's [2 I, H] tiled */
    const void *experts_down;     /* sparse: [E, H, I], each expert's [H, I] tiled */
    int32_t kv_group, kv_slot;    /* pages[kv_group][:, kv_slot] hold this layer's k, v */
} nmk_mk_layer;

typedef struct nmk_mk_weights {
    const void *embed;            /* [V, H], tiled; also the tied lm_head */
    const void *final_norm;       /* [H] */
    const nmk_mk_layer *layers;   /* [num_layers], copied */
    void *kv_pages[NMK_KV_MAX_GROUPS];  /* [pages, layers_in_group, 2, kv_heads, page_size, head_dim] */
    uint32_t kv_num_pages[NMK_KV_MAX_GROUPS];  /* `pages` of each group: >= 1 for a group a layer uses */
} nmk_mk_weights;

typedef struct nmk_mk nmk_mk;

/* Binds weights and KV pages (not copied; they must outlive the megakernel) and allocates
 * the step's scratch on the current CUDA device. *out owned by the caller (nmk_mk_destroy).
 * NMK_ERR_INVALID_ARGUMENT for a geometry the kernel does not take (head_dim other than
 * 128, more than 128 layers, ...), a missing pointer, a bad kv_group, or a group a layer uses
 * whose kv_num_pages is 0 (or so large that pages * layers_in_group exceeds INT32_MAX). */
NMK_API nmk_status nmk_mk_create(const nmk_mk_geometry *geometry, const nmk_mk_weights *weights, nmk_mk **out);
NMK_API void nmk_mk_destroy(nmk_mk *mk);

/* One decode step, enqueued on `stream` (a cudaStream_t; NULL: the default stream). */
typedef struct nmk_mk_step_args {
    uint32_t batch;                      /* 1..NMK_MK_MAX_BATCH */
    const int32_t *host_positions;       /* [batch] host: position of each row's new token */
    const int32_t *tokens;               /* [batch] device: input token of each row */
    const int32_t *positions;            /* unused, may be NULL: the kernel takes host_positions by value */
    const int32_t *block_tables[NMK_KV_MAX_GROUPS];  /* device, per group [batch][table_cols] */
    uint32_t table_cols;
    float *logits;                       /* device fp32 [batch, vocab], written */
    int32_t *next_tokens;                /* device [batch]: greedy argmax, written */
} nmk_mk_step_args;

NMK_API nmk_status nmk_mk_step(nmk_mk *mk, const nmk_mk_step_args *args, void *stream);

/* Builds, checks and uploads the schedule that a step of `batch` rows whose longest row holds
 * `max_len` tokens runs (schedules are cached per batch and power-of-two context bucket; a
 * step builds its own on first use, tens of ms of host time at North Mini Code's geometry).
 * The one call that may run on another thread while nmk_mk_step runs (not while
 * nmk_mk_destroy does). NMK_ERR_INVALID_ARGUMENT for a batch outside 1..NMK_MK_MAX_BATCH or
 * max_len < 1. */
NMK_API nmk_status nmk_mk_prepare(nmk_mk *mk, uint32_t batch, int32_t max_len);

/* Multiprocessors the megakernel runs on (one CTA each). */
NMK_API nmk_status nmk_mk_num_sms(const nmk_mk *mk, uint32_t *out);

/* Debug capture, for tests and diagnosis. Stages recorded per layer l in [0, num_layers]
 * (l = num_layers: what enters the final norm); append-only. */
typedef enum nmk_mk_debug_stage {
    NMK_MK_DEBUG_X = 0,     /* the residual x entering layer l (the embedding at l = 0) */
    NMK_MK_DEBUG_ATTN = 1,  /* the o-proj output of layer l - 1 (zero at l = 0) */
    NMK_MK_DEBUG_MLP = 2,   /* the mlp output of layer l - 1, experts combined (zero at l = 0) */
    NMK_MK_DEBUG_STAGES = 3
} nmk_mk_debug_stage;

/* Bytes of the buffer nmk_mk_set_debug needs: fp32 [num_layers + 1][NMK_MK_DEBUG_STAGES]
 * [NMK_MK_MAX_BATCH][hidden], then int32 [num_layers][NMK_MK_MAX_BATCH][top_k]: the experts
 * each row routed to in ascending id order (-1 on dense layers). */
NMK_API nmk_status nmk_mk_debug_bytes(const nmk_mk *mk, uint64_t *out);

/* From the next step on, every step records into `buffer` (device memory of at least
 * nmk_mk_debug_bytes, owned by the caller, alive while set). NULL turns recording off. */
NMK_API nmk_status nmk_mk_set_debug(nmk_mk *mk, void *buffer, uint64_t bytes);

/* Task timing, for profiling: from the next step on, task i of the step's task array
 * (lists, then queues; i < capacity) writes buffer[4 i .. 4 i + 3] (device memory, owned
 * by the caller, alive while set): globaltimer ns when its wait began, when it started
 * running, when it ended, and op | layer << 8 | sm << 16, sm being the CTA that ran it (a
 * queue task: the CTA that claimed it). DRAIN entries are not timed (their records are left
 * as they were), nor are tasks at or past capacity. NULL turns it off. */
NMK_API nmk_status nmk_mk_set_timing(nmk_mk *mk, uint64_t *buffer, uint32_t capacity);

/* ==== end megakernel ==== */

#ifdef __cplusplus
}
#endif

#endif /* NORTHMK_H */
