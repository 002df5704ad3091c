"""DecodeLoop: the native decode thread driving a step function over a batch of rows."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_int, c_int32, c_size_t, c_uint32, c_void_p
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

from ._lib import (
    STEP_FN,
    LoopState,
    NativeHandle,
    RowInfo,
    RowParams,
    Status,
    StepBatch,
    StepResult,
    TokenEvent,
    TokenFlag,
    check,
    load,
)
from .kv import KVPool


@dataclass
class StepInput:
    """One step's batch, arrays over the active rows (ascending slot); copies, safe to keep."""

    step: int
    slots: np.ndarray  # uint32 [B] dense block-table rows
    seqs: np.ndarray  # uint64 [B]
    tokens: np.ndarray  # int32 [B] input token; its KV goes to positions[i]
    positions: np.ndarray  # uint32 [B]


# Returns (sampled token ids [B], their logprobs [B]); raising fails the step.
StepFn = Callable[[StepInput], tuple[Sequence[int], Sequence[float]]]


@dataclass(frozen=True)
class NativeStep:
    """A C step function (nmk_step_fn) and its user pointer, e.g. the megakernel's."""

    function: int  # address
    user: int = 0


class Event(NamedTuple):
    slot: int
    seq: int
    token: int
    logprob: float
    flags: TokenFlag

    @property
    def finished(self) -> bool:
        return bool(self.flags & TokenFlag.FINISHED)


class Row(NamedTuple):
    seq: int
    last_token: int
    position: int
    generated: int
    remaining: int
    flags: TokenFlag


def _array(ptr, n: int, dtype) -> np.ndarray:
    return np.ctypeslib.as_array(ptr, shape=(n,)).astype(dtype, copy=True) if n else np.empty(0, dtype)


class DecodeLoop(NativeHandle):
    """Created parked. start()/resume() run it; park() or request_park() stop it at a step boundary."""

    def __init__(
        self,
        pool: KVPool,
        step: StepFn | NativeStep,
        *,
        max_rows: int | None = None,
        ring_capacity: int = 4096,
    ):
        self._lib = load()
        self.pool = pool
        self.step_error: BaseException | None = None  # what the Python step raised at the last failed park
        p = self._lib.nmk_loop_default_params()
        p.max_rows = pool.params.max_rows if max_rows is None else max_rows
        p.ring_capacity = ring_capacity
        if isinstance(step, NativeStep):
            self._callback = None
            p.step = ctypes.cast(c_void_p(step.function), STEP_FN)
            p.step_user = step.user
        else:
            self._python_step = step
            self._callback = STEP_FN(self._run_step)  # kept alive as long as the loop
            p.step = self._callback
        self.max_rows = p.max_rows
        self._events = (TokenEvent * ring_capacity)()
        self._handle = c_void_p()
        check(self._lib.nmk_loop_create(pool.handle, byref(p), byref(self._handle)))
        pool.loops.add(self)  # closing the pool closes this loop first

    def _run_step(self, _user, batch_ptr, result_ptr) -> int:
        b, r = batch_ptr.contents, result_ptr.contents
        n = b.num_rows
        try:
            inp = StepInput(
                step=b.step,
                slots=_array(b.slots, n, np.uint32),
                seqs=_array(b.seqs, n, np.uint64),
                tokens=_array(b.tokens, n, np.int32),
                positions=_array(b.positions, n, np.uint32),
            )
            tokens, logprobs = self._python_step(inp)
            tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
            logprobs = np.asarray(logprobs, dtype=np.float32).reshape(-1)
            if tokens.shape != (n,) or logprobs.shape != (n,):
                raise ValueError(f"step returned {tokens.shape} tokens / {logprobs.shape} logprobs for {n} rows")
            if n and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
                raise ValueError("step returned a token id outside [0, 2**31)")
        except BaseException as exc:  # reported through park status; re-raised by the caller
            self.step_error = exc
            return Status.ERR_STEP_FAILED
        np.ctypeslib.as_array(r.tokens, shape=(n,))[:] = tokens
        np.ctypeslib.as_array(r.logprobs, shape=(n,))[:] = logprobs
        return Status.OK

    # ---- lifetime --------------------------------------------------------------------------
    def _release(self) -> None:
        """Stops the thread and unbinds the rows (their sequences stay in the pool)."""
        self._lib.nmk_loop_destroy(self._handle)

    def fileno(self) -> int:
        """Readable when tokens were published or the loop parked; drain() consumes it."""
        return self._lib.nmk_loop_fd(self.handle)

    # ---- state -----------------------------------------------------------------------------
    def _state(self) -> tuple[LoopState, Status]:
        state, status = c_int(), c_int()
        check(self._lib.nmk_loop_get_state(self.handle, byref(state), byref(status)))
        return LoopState(state.value), Status(status.value)

    @property
    def state(self) -> LoopState:
        return self._state()[0]

    @property
    def park_status(self) -> Status:
        """Why the loop last parked: OK (asked), ERR_NO_SPACE (pages), ERR_STEP_FAILED (see step_error)."""
        return self._state()[1]

    @property
    def park_message(self) -> str:
        size = self._lib.nmk_loop_park_message(self.handle, None, 0)
        buf = ctypes.create_string_buffer(size + 1)
        self._lib.nmk_loop_park_message(self.handle, buf, size + 1)
        return buf.value.decode("utf-8", "replace")

    def request_park(self) -> None:
        """Asks for a park at the next step boundary; fileno() signals when parked."""
        check(self._lib.nmk_loop_request_park(self.handle))

    def park(self) -> None:
        """Parks and waits (blocking: call from a worker thread inside asyncio)."""
        check(self._lib.nmk_loop_park(self.handle))

    def resume(self) -> None:
        self.step_error = None
        check(self._lib.nmk_loop_resume(self.handle))

    start = resume

    def drain(self) -> list[Event]:
        """All published events, oldest first."""
        out: list[Event] = []
        n = c_size_t(0)
        while True:
            check(self._lib.nmk_loop_drain(self.handle, self._events, len(self._events), byref(n)))
            out += [Event(e.slot, e.seq, e.token, e.logprob, TokenFlag(e.flags)) for e in self._events[: n.value]]
            if n.value < len(self._events):
                return out

    # ---- batch (parked only) ---------------------------------------------------------------
    def add_row(
        self,
        slot: int,
        seq: int,
        last_token: int,
        max_new_tokens: int,
        *,
        stop_token_ids: Sequence[int] = (),
        min_new_tokens: int = 0,
    ) -> None:
        """Adds an active row: last_token is sampled but not yet in the KV (position = length(seq))."""
        if slot < 0 or max_new_tokens < 1 or min_new_tokens < 0 or last_token < 0:
            raise ValueError(
                f"add_row: need slot >= 0, max_new_tokens >= 1, min_new_tokens >= 0, last_token >= 0; got "
                f"{slot}, {max_new_tokens}, {min_new_tokens}, {last_token}"
            )
        stops = (c_int32 * max(len(stop_token_ids), 1))(*stop_token_ids)
        row = RowParams(slot, seq, last_token, max_new_tokens, min_new_tokens,
                        ctypes.cast(stops, POINTER(c_int32)), len(stop_token_ids))
        check(self._lib.nmk_loop_add_row(self.handle, byref(row)))

    def remove_row(self, slot: int) -> None:
        check(self._lib.nmk_loop_remove_row(self.handle, slot))

    def row(self, slot: int) -> Row:
        info = RowInfo()
        check(self._lib.nmk_loop_row(self.handle, slot, byref(info)))
        return Row(info.seq, info.last_token, info.position, info.generated, info.remaining, TokenFlag(info.flags))

    @property
    def num_rows(self) -> int:
        out = c_uint32()
        check(self._lib.nmk_loop_num_rows(self.handle, byref(out)))
        return out.value
