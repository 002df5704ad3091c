"""ctypes bindings of libnorthmk (include/northmk.h): the KV block pool and the decode loop.

Loading: $NORTHMK_LIB, else northmk/libnorthmk.so (installed by `pip install .`), else the
newest build/*/libnorthmk.so of a source checkout. The library's ABI version must equal
`ABI_VERSION`; otherwise `LibraryNotFound` says how to build it. Every failing call raises
`NativeError(status, message)`; `NoSpace` (a subclass) is NMK_ERR_NO_SPACE: recoverable.

KVPool(num_pages, windows=None, *, page_size=64, max_seq_len=8192, max_rows=8,
       model_key=0, prefix_cache=True)               one page pool per attention group
  KVPool.for_model(config, num_pages, **kw)          groups/windows from a ModelConfig
  .create_sequence(prompt=None) -> (seq, n_cached)   attaches the longest cached prefix (< len(prompt))
  .prefix_lookup(prompt) -> n_cached                 the same count, no state change
  .append(seq, tokens)                               pages for the next len(tokens) positions; NoSpace
  .fork(seq) -> (child, [Copy(group, src, dst)])     full pages shared; copy the partial last page
  .free(seq); .length(seq); .seq_block_table(seq, group) -> [page or -1]
  .bind_row(row, seq); .unbind_row(row)              dense-table rows (the loop binds its own)
  .block_table(group) -> np.int32 [max_rows, max_pages] view of native memory, -1 absent
  .usage(group) -> Usage(total, used, cached, free); .usage_fraction(); .prefix_stats()
  .close() / context manager

DecodeLoop(pool, step, *, max_rows=None, ring_capacity=4096)   created PARKED
  step: f(StepInput(step, slots, seqs, tokens, positions)) -> (tokens [B], logprobs [B]),
        run on the loop thread (read pool.block_table(g)[slots] for the pages); raising parks
        the loop with ERR_STEP_FAILED and keeps the exception in .step_error.
        Or NativeStep(function_address, user) for a C nmk_step_fn (the megakernel).
  .start() / .resume()        PARKED -> RUNNING
  .request_park()             returns at once; fileno() becomes readable once parked
  .park()                     blocking park (use from a worker thread)
  .fileno()                   eventfd: readable on new tokens or on park
  .drain() -> [Event(slot, seq, token, logprob, flags)]   consumes the fd notification
  .state, .park_status, .park_message, .step_error
  .add_row(slot, seq, last_token, max_new_tokens, *, stop_token_ids=(), min_new_tokens=0)
  .remove_row(slot); .row(slot) -> Row(...); .num_rows      (add/remove/row: PARKED only)
  .close() / context manager

asyncio use (the engine):

    loop.add_reader(dl.fileno(), on_ready)          # a new loop is parked without a signal:
                                                     # read dl.state before waiting for one
    def on_ready():
        parked = dl.state is LoopState.PARKED        # read BEFORE draining: then no token follows
        for ev in dl.drain(): ...                    # ev.finished -> row idle until removed
        if parked:                                   # asked for, or ERR_NO_SPACE / ERR_STEP_FAILED
            ...modify rows, free or preempt sequences...; dl.resume()
"""

from ._lib import (
    ABI_VERSION,
    NO_PAGE,
    LibraryNotFound,
    LoopState,
    NativeError,
    NoSpace,
    Status,
    TokenFlag,
    last_error,
    library_path,
    load,
)
from .kv import Copy, KVPool, PrefixCacheStats, Usage, model_key_of
from .loop import DecodeLoop, Event, NativeStep, Row, StepInput

__all__ = [
    "ABI_VERSION", "NO_PAGE", "Copy", "DecodeLoop", "Event", "KVPool", "LibraryNotFound", "LoopState",
    "NativeError", "NativeStep", "NoSpace", "PrefixCacheStats", "Row", "Status", "StepInput", "TokenFlag",
    "Usage", "last_error", "library_path", "load", "model_key_of",
]
