"""Park/resume stress from asyncio: admissions, cancellations, preemptions and park requests
from another thread race a running loop; every token is published once, in order, and no
page leaks."""

from __future__ import annotations

import asyncio
import random
import threading
import time

from northmk.native import DecodeLoop, KVPool, LoopState, NoSpace, Status

PS, ROWS, ITERATIONS = 4, 6, 150


def step(inp):
    return inp.tokens.astype("int64") + 1, inp.positions.astype("float32") * 0


async def test_park_resume_stress_with_racing_admissions_and_cancellations():
    rng = random.Random(5)
    pool = KVPool([40, 20], [None, 12], page_size=PS, max_seq_len=96, max_rows=ROWS)
    loop = DecodeLoop(pool, step, ring_capacity=16)
    expected: dict[int, int] = {}  # seq -> next token it must publish
    published: dict[int, int] = {}
    parked = asyncio.Event()

    def on_ready():
        is_parked = loop.state is LoopState.PARKED  # read before draining: no token can follow
        for e in loop.drain():
            assert e.token == expected[e.seq], (e, expected[e.seq])
            expected[e.seq] += 1
            published[e.seq] = published.get(e.seq, 0) + 1
        if is_parked:
            parked.set()

    def remove(slot: int) -> None:
        row = loop.row(slot)
        loop.remove_row(slot)
        on_ready()
        assert published.get(row.seq, 0) == row.generated
        pool.free(row.seq)

    def admit(slot: int) -> None:
        prompt = list(range(8)) + [rng.randrange(3) for _ in range(rng.randrange(1, 16))]
        seq, cached = pool.create_sequence(prompt)
        try:
            pool.append(seq, prompt[cached:])
        except NoSpace:
            pool.free(seq)
            return
        expected[seq] = 1001
        loop.add_row(slot, seq, 1000, rng.randrange(1, 30), stop_token_ids=[1000 + rng.randrange(5, 40)])

    stop = threading.Event()

    def park_requester():
        while not stop.is_set():
            loop.request_park()
            time.sleep(0.002)

    aio = asyncio.get_running_loop()
    aio.add_reader(loop.fileno(), on_ready)
    racer = threading.Thread(target=park_requester)
    racer.start()
    no_space = 0
    try:
        for _ in range(ITERATIONS):
            loop.request_park()
            while loop.state is not LoopState.PARKED:  # parks from the racer count too
                parked.clear()
                await asyncio.wait_for(parked.wait(), 5)
            assert loop.park_status in (Status.OK, Status.ERR_NO_SPACE), loop.park_message
            occupied = [s for s in range(ROWS) if _has_row(loop, s)]
            if loop.park_status is Status.ERR_NO_SPACE:
                no_space += 1
                remove(occupied.pop(0))  # preempt
            for slot in range(ROWS):
                if slot in occupied and (loop.row(slot).flags or rng.random() < 0.15):
                    remove(slot)
                elif slot not in occupied and rng.random() < 0.5:
                    admit(slot)
            loop.resume()
            await asyncio.sleep(rng.random() * 0.003)
    finally:
        stop.set()
        racer.join()
        aio.remove_reader(loop.fileno())
    await asyncio.to_thread(loop.park)
    for slot in range(ROWS):
        if _has_row(loop, slot):
            remove(slot)
    loop.close()
    assert sum(published.values()) > ITERATIONS
    for g in range(2):
        usage = pool.usage(g)
        assert usage.used == 0 and usage.cached + usage.free == usage.total
    pool.close()


def _has_row(loop: DecodeLoop, slot: int) -> bool:
    try:
        loop.row(slot)
        return True
    except Exception:
        return False
