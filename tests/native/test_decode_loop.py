"""DecodeLoop through ctypes: a Python step drives rows; park/resume over the eventfd in asyncio."""

from __future__ import annotations

import asyncio
import ctypes

import numpy as np
import pytest

from northmk.native import (
    DecodeLoop, KVPool, LoopState, NativeError, NativeStep, Status, StepInput, TokenFlag,
)
from northmk.native._lib import STEP_FN

PS = 4


def next_token_step(inp: StepInput):
    """Deterministic model: next token = input + 1, logprob = -position."""
    return inp.tokens.astype(np.int64) + 1, -inp.positions.astype(np.float32)


def make_pool(pages=32, **kw) -> KVPool:
    return KVPool([pages], page_size=PS, max_seq_len=kw.pop("max_seq_len", 64), max_rows=4, **kw)


def make_seq(pool: KVPool, n: int) -> int:
    seq, _ = pool.create_sequence()
    pool.append(seq, [0] * n)
    return seq


async def drain_until_finished(loop: DecodeLoop, events: list) -> None:
    """Collects the running loop's events until one finishes a row."""
    while not any(e.finished for e in events):
        await asyncio.sleep(0.01)
        events += loop.drain()


async def wait_parked(loop: DecodeLoop, events: list) -> Status:
    """Watches the fd as the engine does; collects events until the loop parks."""
    ev = asyncio.Event()
    aio = asyncio.get_running_loop()
    aio.add_reader(loop.fileno(), ev.set)
    try:
        while True:
            await asyncio.wait_for(ev.wait(), 5)
            ev.clear()
            parked = loop.state is LoopState.PARKED  # read before draining: no token can follow
            events += loop.drain()
            if parked:
                return loop.park_status
    finally:
        aio.remove_reader(loop.fileno())


async def test_rows_generate_until_stop_or_budget_and_idle_until_removed():
    with make_pool() as pool, DecodeLoop(pool, next_token_step) as loop:
        a, b = make_seq(pool, 5), make_seq(pool, 2)
        assert loop.state is LoopState.PARKED and loop.num_rows == 0
        loop.add_row(0, a, last_token=10, max_new_tokens=5, stop_token_ids=[13])
        loop.add_row(3, b, last_token=100, max_new_tokens=2)
        loop.start()
        events: list = []
        while sum(e.finished for e in events) < 2:
            await asyncio.sleep(0.01)
            events += loop.drain()
        loop.request_park()
        assert await wait_parked(loop, events) is Status.OK
        by_slot = {s: [(e.token, e.logprob, e.flags) for e in events if e.slot == s] for s in (0, 3)}
        assert by_slot[0] == [(11, -5.0, 0), (12, -6.0, 0), (13, -7.0, TokenFlag.FINISHED | TokenFlag.STOP)]
        assert by_slot[3] == [(101, -2.0, 0), (102, -3.0, TokenFlag.FINISHED | TokenFlag.LENGTH)]
        assert all(e.seq == a for e in events if e.slot == 0)
        row = loop.row(0)
        assert (row.generated, row.remaining, row.position, row.last_token) == (3, 2, 8, 13)
        assert pool.length(a) == 8  # the stop token itself is not in the KV
        loop.remove_row(0)
        assert loop.num_rows == 1


async def test_step_sees_a_page_for_every_rows_position():
    with make_pool() as pool:
        seen = []

        def step(inp: StepInput):
            table = pool.block_table(0)
            seen.extend(int(table[s, p // PS]) for s, p in zip(inp.slots, inp.positions))
            return next_token_step(inp)

        with DecodeLoop(pool, step) as loop:
            loop.add_row(1, make_seq(pool, 3), last_token=1, max_new_tokens=6)
            loop.start()
            events: list = []
            await drain_until_finished(loop, events)
            assert len(seen) == 6 and min(seen) >= 0


@pytest.mark.parametrize("bad", ["raise", "shape", "negative"])
async def test_step_failure_parks_keeps_tokens_and_can_resume(bad):
    calls = {"n": 0}

    def step(inp: StepInput):
        calls["n"] += 1
        if calls["n"] == 3:
            if bad == "raise":
                raise RuntimeError("model exploded")
            if bad == "shape":
                return [1, 2, 3], [0.0]
            return [-7], [0.0]
        return next_token_step(inp)

    with make_pool() as pool, DecodeLoop(pool, step) as loop:
        seq = make_seq(pool, 3)
        loop.add_row(0, seq, last_token=1, max_new_tokens=5)
        loop.start()
        events: list = []
        assert await wait_parked(loop, events) is Status.ERR_STEP_FAILED
        assert [e.token for e in events] == [2, 3]
        assert isinstance(loop.step_error, (RuntimeError, ValueError)) and "step" in loop.park_message
        assert pool.length(seq) == 5  # the failed step's append was rolled back
        loop.resume()
        assert loop.step_error is None
        await drain_until_finished(loop, events)
        assert [e.token for e in events] == [2, 3, 4, 5, 6]


async def test_a_page_reserved_in_a_step_is_the_next_appends_or_goes_with_a_failed_step():
    """A step may reserve the page of its row's next position (the engine does, for a step it
    enqueues ahead): the loop's next append takes that page and no other, and a failed step's
    rollback releases it with the step's token."""
    calls, reserved, tables = {"n": 0}, [], {}

    def step(inp: StepInput):
        calls["n"] += 1
        seq, pos = int(inp.seqs[0]), int(inp.positions[0])
        tables[pos] = pool.seq_block_table(seq, 0)
        pool.reserve(seq)  # the page of position pos + 1
        if pos + 1 == PS:
            reserved.append(pool.seq_block_table(seq, 0)[1])
        if calls["n"] == 2:
            raise RuntimeError("model exploded")
        return next_token_step(inp)

    with make_pool() as pool, DecodeLoop(pool, step) as loop:
        seq = make_seq(pool, 2)
        loop.add_row(0, seq, last_token=1, max_new_tokens=4)
        loop.start()
        events: list = []
        assert await wait_parked(loop, events) is Status.ERR_STEP_FAILED  # at position 3, page 1 reserved
        assert pool.length(seq) == 3 and len(pool.seq_block_table(seq, 0)) == 1 and pool.usage(0).used == 1
        loop.resume()
        await drain_until_finished(loop, events)
        assert [e.token for e in events] == [2, 3, 4, 5] and len(reserved) == 2
        assert tables[PS][1] == reserved[-1]  # position 4's append took the page reserved at position 3
        assert pool.length(seq) == 6 and pool.usage(0).used == 2


async def test_no_space_parks_so_the_scheduler_can_preempt():
    with make_pool(pages=4) as pool, DecodeLoop(pool, next_token_step) as loop:
        a, b = make_seq(pool, 4), make_seq(pool, 4)
        loop.add_row(0, a, last_token=1, max_new_tokens=20)
        loop.add_row(1, b, last_token=1, max_new_tokens=20)
        loop.start()
        events: list = []
        assert await wait_parked(loop, events) is Status.ERR_NO_SPACE
        assert "needs 2 pages, 0 available" in loop.park_message
        assert len(events) == 8  # both rows filled their second page, then ran out together
        loop.remove_row(1)  # preempt b
        pool.free(b)
        loop.resume()
        assert await wait_parked(loop, events) is Status.ERR_NO_SPACE
        assert [e.token for e in events if e.slot == 0] == list(range(2, 14))


async def test_batch_changes_need_a_parked_loop_and_valid_rows():
    with make_pool() as pool, DecodeLoop(pool, next_token_step) as loop:
        seq = make_seq(pool, 1)
        with pytest.raises(ValueError):
            loop.add_row(0, seq, last_token=1, max_new_tokens=0)
        with pytest.raises(NativeError) as err:
            loop.add_row(0, 999, last_token=1, max_new_tokens=1)
        assert err.value.status is Status.ERR_NOT_FOUND
        with pytest.raises(NativeError, match="slot 7"):
            loop.add_row(7, seq, last_token=1, max_new_tokens=1)
        loop.add_row(0, seq, last_token=1, max_new_tokens=100)
        with pytest.raises(NativeError, match="occupied"):
            loop.add_row(0, seq, last_token=1, max_new_tokens=1)
        loop.start()
        with pytest.raises(NativeError, match="park it first") as err:
            loop.remove_row(0)
        assert err.value.status is Status.ERR_BAD_STATE
        with pytest.raises(NativeError, match="park it first"):
            loop.resume()
        await asyncio.to_thread(loop.park)
        assert loop.state is LoopState.PARKED
        loop.remove_row(0)


async def test_a_native_step_function_pointer_drives_the_loop():
    @STEP_FN
    def c_step(user, batch, result):
        b, r = batch.contents, result.contents
        for i in range(b.num_rows):
            r.tokens[i] = b.tokens[i] + user
            r.logprobs[i] = 0.0
        return 0

    address = ctypes.cast(c_step, ctypes.c_void_p).value
    with make_pool() as pool, DecodeLoop(pool, NativeStep(address, user=10)) as loop:
        loop.add_row(0, make_seq(pool, 1), last_token=1, max_new_tokens=3)
        loop.start()
        events: list = []
        await drain_until_finished(loop, events)
        assert [e.token for e in events] == [11, 21, 31]


def test_closed_loop_refuses_calls_and_close_is_idempotent():
    pool = make_pool()
    loop = DecodeLoop(pool, next_token_step)
    loop.close()
    loop.close()
    with pytest.raises(ValueError, match="closed"):
        loop.resume()
    pool.close()


def test_closing_the_pool_closes_its_loops_first():
    pool = make_pool()
    loop = DecodeLoop(pool, next_token_step)
    loop.add_row(0, make_seq(pool, 1), last_token=1, max_new_tokens=50)
    loop.start()
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        loop.drain()
