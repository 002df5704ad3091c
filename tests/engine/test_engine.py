"""The engine end to end on a tiny checkpoint: the native KV pool and decode loop driving
the PyTorch reference model on CPU."""

import asyncio
import random
import time

import pytest

from northmk.checkpoint import load_checkpoint
from northmk.engine import AsyncEngine, EngineConfig, EngineOverloaded, FinishReason, GenerationRequest, SamplingParams
from northmk.engine.types import EngineDead, RequestRejected
from northmk.generate import generate as reference_generate
from northmk.model.reference import ReferenceModel

PROMPTS = [[2, 17, 99, 301, 5], [2] + list(range(40, 110)), [2, 900, 901], [2] + list(range(200, 330))]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    config, weights = load_checkpoint(tiny_checkpoint)
    return ReferenceModel(config, weights)


async def settled(engine) -> dict:
    """Stats once finished rows are reaped (that happens just after the last output)."""
    for _ in range(200):
        stats = engine.stats()
        if stats["num_rows"] == 0 and stats["kv_pages_used"] == 0:
            break
        await asyncio.sleep(0.01)
    return stats


async def collect(engine, prompt, request_id, **params):
    params.setdefault("temperature", 0.0)
    request = GenerationRequest(request_id, list(prompt), SamplingParams(**params))
    choices: dict[int, list[int]] = {}
    finals = {}
    async for out in engine.generate(request):
        for c in out.outputs:
            choices.setdefault(c.index, []).extend(c.token_ids)
            if c.finished:
                finals[c.index] = c
    return choices, finals, out


async def test_greedy_decode_matches_the_reference_model(make_engine, reference):
    # 131 prompt tokens in 64-token chunks, decoding past the 80-token sliding window's
    # first page release (position 143).
    engine = await make_engine(prefill_chunk=64)
    expected = reference_generate(reference, [PROMPTS[3]], max_tokens=16)[0].token_ids
    choices, finals, last = await collect(engine, PROMPTS[3], "a", max_tokens=16, ignore_eos=True)
    assert choices[0] == expected
    assert finals[0].finish_reason == FinishReason.LENGTH and finals[0].num_generated == 16
    assert last.num_prompt_tokens == len(PROMPTS[3])


async def test_concurrent_greedy_requests_match_each_alone(make_engine):
    engine = await make_engine(max_batch=4)
    alone = [(await collect(engine, p, f"alone{i}", max_tokens=20, ignore_eos=True))[0][0] for i, p in enumerate(PROMPTS)]
    together = await asyncio.gather(*[
        collect(engine, p, f"together{i}", max_tokens=20, ignore_eos=True) for i, p in enumerate(PROMPTS)])
    assert [t[0][0] for t in together] == alone


async def test_a_row_at_max_seq_len_needs_no_next_page_and_a_full_pool_says_so(make_engine):
    """Admission takes the page of every running row's next position (Scheduler._reserve_next): none
    for a row at max_seq_len, which takes no further position; NoSpace when the pool is full."""
    from types import SimpleNamespace

    from northmk.native import NoSpace

    engine = await make_engine(max_model_len=128, num_kv_pages=2)
    s, pool = engine.scheduler, engine.scheduler.pool
    full, _ = pool.create_sequence()
    pool.append(full, [5] * 128)  # max_seq_len: both pages
    s._reserve_next(SimpleNamespace(kv_seq=full))
    assert len(pool.seq_block_table(full, 0)) == 2
    pool.free(full)
    seq, _ = pool.create_sequence()
    pool.append(seq, [5] * 64)
    other, _ = pool.create_sequence()
    pool.append(other, [6] * 64)  # the pool's two pages taken
    with pytest.raises(NoSpace):
        s._reserve_next(SimpleNamespace(kv_seq=seq))
    pool.free(seq)
    pool.free(other)


@pytest.mark.parametrize("pages", [4, 5])
@pytest.mark.parametrize("sampled_on", ["host", "device"])
async def test_preemption_under_a_tiny_page_budget_keeps_the_tokens(make_engine, sampled_on, pages):
    # Three 61-token prompts fit one page each; growing past 64 tokens each needs a second
    # page, and 4 or 5 pages cannot hold all three: the loop runs out and the engine preempts, or
    # the last row waits.
    # Drawn "on the device", steps are enqueued ahead, and the pool gives a row its second page a
    # step early where it can (pool.reserve), or the step is not enqueued ahead.
    prompts = [[2] + list(range(100 * i + 10, 100 * i + 70)) for i in range(3)]
    roomy = await make_engine(max_batch=3, device_sampler=sampler_for(sampled_on))
    alone = [(await collect(roomy, p, f"r{i}", max_tokens=30, ignore_eos=True))[0][0] for i, p in enumerate(prompts)]
    tight = await make_engine(max_batch=3, num_kv_pages=pages, device_sampler=sampler_for(sampled_on))
    results = await asyncio.gather(*[
        collect(tight, p, f"t{i}", max_tokens=30, ignore_eos=True) for i, p in enumerate(prompts)])
    assert [r[0][0] for r in results] == alone
    # A row is admitted (a preempted one again) only with the page of its first decode step, after
    # the running rows have taken those of their next steps; else it stopped the loop there and
    # was preempted again at every step of the others (10-23 preemptions on 5 pages). A newer
    # row's prefill never preempts an older running row. 0 or 1 preemption over 160 runs on one core.
    assert tight.metrics.num_preemptions._value.get() <= 2
    assert (await settled(tight))["kv_pages_used"] == 0


async def test_closing_the_iterator_frees_row_and_pages(make_engine):
    engine = await make_engine()
    request = GenerationRequest("c", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True))
    stream = engine.generate(request)
    await anext(stream)
    await anext(stream)
    assert engine.stats()["kv_pages_used"] > 0
    await stream.aclose()
    stats = await settled(engine)
    assert stats["num_rows"] == 0 and stats["kv_pages_used"] == 0 and stats["num_requests_running"] == 0
    # the engine still serves
    choices, _, _ = await collect(engine, PROMPTS[0], "after", max_tokens=3)
    assert len(choices[0]) >= 1


async def test_a_stop_string_ends_the_text_before_it_and_frees_the_row(make_engine):
    engine = await make_engine()
    request = GenerationRequest("full", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    text = "".join([c.text async for out in engine.generate(request) for c in out.outputs])
    stop = text[10:13]
    assert len(stop) == 3
    request = GenerationRequest("stop", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))
    outs = [c async for out in engine.generate(request) for c in out.outputs]
    assert "".join(c.text for c in outs) == text[: text.index(stop)]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == stop
    stats = await settled(engine)
    assert stats["num_rows"] == 0 and stats["kv_pages_used"] == 0


async def test_n_choices_share_the_prompt_and_sample_independently(make_engine):
    engine = await make_engine()
    choices, finals, last = await collect(engine, PROMPTS[0], "n", n=3, temperature=1.0, seed=11,
                                          max_tokens=12, ignore_eos=True)
    assert sorted(choices) == [0, 1, 2] and all(len(c) == 12 for c in choices.values())
    assert len({tuple(c) for c in choices.values()}) == 3
    again, _, _ = await collect(engine, PROMPTS[0], "n2", n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    assert again == choices


async def test_choices_that_find_no_pages_wait_for_an_older_request_and_match_a_roomy_run(make_engine):
    """Each choice of an n > 1 request holds its own copy of the prompt's partly filled last page
    (the pool's fork). On 4 pages, with an older request holding 2, the third choice's fork finds
    none: the request waits (it never preempts an older row) and runs once the older one is done.
    (The fork's NoSpace used to kill the engine.)"""
    older_prompt, prompt = [2] + list(range(40, 109)), [2, 17, 99, 301, 5]  # 70 tokens: 2 pages; 1 page
    params = dict(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    roomy = await make_engine(max_batch=4)
    want_older = (await collect(roomy, older_prompt, "o", max_tokens=20, ignore_eos=True))[0]
    want = (await collect(roomy, prompt, "n", **params))[0]
    tight = await make_engine(max_batch=4, num_kv_pages=4)
    older = tight.generate(GenerationRequest("o", older_prompt, SamplingParams(temperature=0.0, max_tokens=20,
                                                                               ignore_eos=True)))
    first = await anext(older)  # a decoding row on 2 of the 4 pages
    got, older_rest = await asyncio.gather(collect(tight, prompt, "n", **params), collect_rest(older))
    assert got[0] == want
    assert first.outputs[0].token_ids + older_rest == want_older[0]
    assert tight.metrics.num_preemptions._value.get() == 0
    assert (await settled(tight))["kv_pages_used"] == 0


@pytest.mark.parametrize("sampled_on, seed", [("host", 1), ("host", 4), ("host", 6), ("device", 1)])
async def test_a_mixed_workload_on_too_few_pages_keeps_every_token(make_engine, sampled_on, seed):
    """14 requests at once, 1-3 choices each, prompts on and around page boundaries, on 5 and 6
    pages, far fewer than they take together: the engine forks, preempts or waits, and every
    choice's tokens are those of a roomy engine; every page comes back. (Found two hangs: a
    request retried in a loop that parked the decode loop at once, so the rows it waited for
    never stepped, which seeds 1 and 4 show; and a prefill that read a preemption's stale
    out-of-pages flag as the loop being out of pages, and waited with nothing running, which
    seed 6 showed in one run of two.)"""
    rng = random.Random(seed)
    requests = []
    for i in range(14):
        prompt = [2] + [rng.randrange(10, 900) for _ in range(rng.choice([5, 30, 63, 64, 65, 100, 128]) - 1)]
        params = dict(n=rng.choice([1, 1, 2, 3]), temperature=1.0, seed=i, max_tokens=rng.choice([4, 20, 70]),
                      ignore_eos=True)
        requests.append((f"r{i}", prompt, params))
    roomy = await make_engine(max_batch=4, device_sampler=sampler_for(sampled_on))
    want = [(await collect(roomy, prompt, rid, **params))[0] for rid, prompt, params in requests]
    for pages in (5, 6):
        tight = await make_engine(max_batch=4, num_kv_pages=pages, device_sampler=sampler_for(sampled_on))
        got = await asyncio.wait_for(
            asyncio.gather(*[collect(tight, prompt, rid, **params) for rid, prompt, params in requests]), 60)
        assert [choices for choices, _, _ in got] == want
        assert (await settled(tight))["kv_pages_used"] == 0


@pytest.mark.parametrize("sampled_on", ["host", "device"])
async def test_clients_that_leave_early_under_page_pressure_leave_nothing_behind(make_engine, sampled_on):
    """24 requests arriving over 0.3 s on 4 pages: 1-3 choices, greedy or sampled, with and
    without logprobs, prompt logprobs and stop strings, max_tokens 0 to 70; a third of the
    clients close their stream after 1 or 3 outputs. Those too many to start are rejected; the
    rest end. Then no row and no page is left, and the engine serves on."""
    rng = random.Random(12)
    engine = await make_engine(max_batch=4, num_kv_pages=4, device_sampler=sampler_for(sampled_on))

    async def client(i: int) -> None:
        prompt = [2] + [rng.randrange(10, 900) for _ in range(rng.choice([5, 30, 63, 64, 65, 100, 128]) - 1)]
        params = SamplingParams(
            n=rng.choice([1, 1, 2, 3]), temperature=rng.choice([0.0, 1.0]), seed=i, ignore_eos=True,
            max_tokens=rng.choice([0, 1, 4, 20, 70]), logprobs=rng.choice([None, 0, 2]),
            prompt_logprobs=rng.choice([None, None, 1]), stop=rng.choice([[], ["a"], ["the"]]))
        leave_after = rng.choice([None, None, 1, 3])
        await asyncio.sleep(rng.random() * 0.3)
        stream = engine.generate(GenerationRequest(f"c{i}", prompt, params))
        try:
            outputs = 0
            async for _ in stream:
                outputs += 1
                if outputs == leave_after:
                    await stream.aclose()
                    return
        except RequestRejected as exc:
            assert exc.param == "n"

    await asyncio.wait_for(asyncio.gather(*[client(i) for i in range(24)]), 60)
    stats = await settled(engine)
    assert stats["kv_pages_used"] == 0 and stats["num_rows"] == 0 and stats["num_requests_running"] == 0
    choices, _, _ = await collect(engine, PROMPTS[0], "after", max_tokens=3, ignore_eos=True)
    assert len(choices[0]) == 3


async def collect_rest(outputs) -> list[int]:
    return [t async for out in outputs for c in out.outputs for t in c.token_ids]


async def test_choices_that_could_never_start_on_the_pool_are_rejected(make_engine):
    """n choices of a prompt need its pages plus, each but the first, a copy of its partly filled
    last page (or, on a page boundary, one page each for the first new token): more than the
    whole pool is a RequestRejected naming n, and the engine serves on."""
    engine = await make_engine(max_batch=4, num_kv_pages=2)
    with pytest.raises(RequestRejected, match="3 choices of a 5-token prompt need 3 KV pages to start; the cache holds 2") as err:
        # (not rejected, such a request would wait for pages for ever)
        await asyncio.wait_for(anext(engine.generate(GenerationRequest("n3", [2, 17, 99, 301, 5], SamplingParams(n=3)))),
                               10)
    assert err.value.param == "n"
    with pytest.raises(RequestRejected, match="2 choices of a 64-token prompt need 3 KV pages"):
        await asyncio.wait_for(anext(engine.generate(GenerationRequest("n2", [2] * 64, SamplingParams(n=2)))), 10)
    # n = 2 fits (1 page + 1 copy), and n = 3 with max_tokens 0 forks nothing
    choices, _, _ = await collect(engine, [2, 17, 99, 301, 5], "n2", n=2, temperature=1.0, seed=3, max_tokens=4,
                                  ignore_eos=True)
    assert sorted(choices) == [0, 1] and all(len(c) == 4 for c in choices.values())
    choices, _, _ = await collect(engine, [2, 17, 99, 301, 5], "n0", n=3, max_tokens=0)
    assert sorted(choices) == [0, 1, 2] and not any(choices.values())
    assert (await settled(engine))["kv_pages_used"] == 0


async def test_seeded_sampling_does_not_depend_on_the_batch(make_engine):
    engine = await make_engine()
    params = dict(temperature=0.9, top_p=0.95, seed=5, max_tokens=16, ignore_eos=True)
    alone = (await collect(engine, PROMPTS[2], "s0", **params))[0][0]
    others = [collect(engine, p, f"o{i}", temperature=1.0, max_tokens=16, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    together = await asyncio.gather(collect(engine, PROMPTS[2], "s1", **params), *others)
    assert together[0][0][0] == alone


async def test_logprobs_and_prefix_cache_hits(make_engine):
    engine = await make_engine()
    prompt = PROMPTS[3]
    _, finals, first = await collect(engine, prompt, "p1", max_tokens=2, logprobs=2)
    _, _, second = await collect(engine, prompt, "p2", max_tokens=2)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 128  # two full 64-token pages of the 131-token prompt


async def test_logprobs_are_reported_per_token(make_engine):
    engine = await make_engine()
    request = GenerationRequest("lp", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))
    lps = [lp async for out in engine.generate(request) for c in out.outputs for lp in c.logprobs]
    assert len(lps) == 4
    for lp in lps:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the top raw token
        assert lp.logprob == pytest.approx(lp.top[0][1])


async def test_bad_requests_are_rejected_with_the_field(make_engine):
    engine = await make_engine()
    with pytest.raises(RequestRejected) as err:
        await anext(engine.generate(GenerationRequest("bad", [2, 99999], SamplingParams())))
    assert err.value.param == "prompt"
    with pytest.raises(RequestRejected) as err:
        await anext(engine.generate(GenerationRequest("bad2", [2], SamplingParams(top_p=0.0))))
    assert err.value.param == "top_p"


async def test_a_full_waiting_queue_answers_overloaded(make_engine):
    engine = await make_engine(max_waiting=1, max_batch=1)
    long = [engine.generate(GenerationRequest(f"w{i}", PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)))
            for i in range(2)]
    await anext(long[0])  # running
    pending = asyncio.ensure_future(anext(long[1]))  # waiting
    await asyncio.sleep(0.05)
    with pytest.raises(EngineOverloaded):
        await anext(engine.generate(GenerationRequest("x", PROMPTS[0], SamplingParams())))
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    for g in long:
        await g.aclose()


async def test_metrics_are_exposed(make_engine):
    engine = await make_engine()
    await collect(engine, PROMPTS[0], "m", max_tokens=3, ignore_eos=True)
    text = engine.metrics.exposition().decode()
    for name in ("northmk:num_requests_running", "northmk:num_requests_waiting", "northmk:kv_cache_usage_perc",
                 "northmk:prompt_tokens_total", "northmk:generation_tokens_total",
                 "northmk:time_to_first_token_seconds_bucket", "northmk:inter_token_latency_seconds_bucket",
                 "northmk:e2e_request_latency_seconds_bucket", "northmk:prefix_cache_hits_total"):
        assert name in text


async def test_outputs_carry_when_the_request_left_the_queue_and_got_its_first_token(make_engine):
    engine = await make_engine(max_batch=1)
    start = time.monotonic()
    runs = [collect(engine, prompt, rid, max_tokens=30, ignore_eos=True)
            for prompt, rid in ((PROMPTS[1], "first"), (PROMPTS[0], "second"))]
    (_, _, first), (_, _, second) = await asyncio.gather(*runs)
    for last in (first, second):
        assert start <= last.scheduled_time <= last.first_token_time
    # One row: the second request waits in the queue until the first has finished.
    assert second.scheduled_time > first.first_token_time


def sampler_for(where: str):
    """None: the host samples every step; "device": the reference of the GPU sampler does, and
    the scheduler enqueues steps ahead as on the megakernel."""
    from tests.engine.test_backend import ReferenceSampler

    return ReferenceSampler() if where == "device" else None


@pytest.mark.parametrize("sampled_on", ["host", "device"])
async def test_a_failing_decode_step_ends_its_requests_and_the_engine_still_shuts_down(make_engine, sampled_on):
    engine = await make_engine(device_sampler=sampler_for(sampled_on))
    calls = 0
    decode = engine.runner.decode_on_device  # every step's model call, on either path

    def failing_decode(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("injected decode failure")
        return decode(*args, **kwargs)

    engine.runner.decode_on_device = failing_decode
    with pytest.raises(EngineDead, match="injected decode failure"):
        await asyncio.wait_for(collect(engine, PROMPTS[0], "doomed", max_tokens=20, ignore_eos=True), 30)
    assert not engine.is_healthy and isinstance(engine.dead_error, EngineDead)
    with pytest.raises(EngineDead):  # later requests are refused with the same error
        await asyncio.wait_for(collect(engine, PROMPTS[2], "late", max_tokens=2), 30)
    await asyncio.wait_for(engine.shutdown(), 30)


@pytest.mark.parametrize("sampled_on", ["host", "device"])
async def test_a_park_awaited_when_the_step_fails_returns(make_engine, sampled_on):
    engine = await make_engine(device_sampler=sampler_for(sampled_on))
    scheduler = engine.scheduler
    decode, started = engine.runner.decode_on_device, asyncio.Event()
    loop = asyncio.get_running_loop()

    def failing_decode(*args, **kwargs):
        loop.call_soon_threadsafe(started.set)
        time.sleep(0.2)  # the park below is requested while this step runs
        raise RuntimeError("injected decode failure")

    engine.runner.decode_on_device = failing_decode
    request = asyncio.create_task(collect(engine, PROMPTS[0], "doomed", max_tokens=20, ignore_eos=True))
    await asyncio.wait_for(started.wait(), 30)
    await asyncio.wait_for(scheduler.park(), 10)  # released by the failed step's park
    with pytest.raises(EngineDead):
        await asyncio.wait_for(request, 30)
    engine.runner.decode_on_device = decode
    await asyncio.wait_for(engine.shutdown(), 30)


async def test_a_park_awaited_when_handling_the_loop_fails_returns(make_engine):
    engine = await make_engine()
    scheduler = engine.scheduler

    def broken(*args):
        raise AssertionError("injected broken invariant")

    request = asyncio.create_task(collect(engine, PROMPTS[0], "doomed", max_tokens=200, ignore_eos=True))
    while not scheduler.rows:
        await asyncio.sleep(0.01)
    scheduler._on_token = broken  # every drain of the loop's events fails from now on
    await asyncio.wait_for(scheduler.park(), 10)
    with pytest.raises(EngineDead, match="injected broken invariant"):
        await asyncio.wait_for(request, 30)
    await asyncio.wait_for(engine.shutdown(), 30)


async def test_shutdown_ends_the_requests_still_running(make_engine):
    engine = await make_engine()
    request = asyncio.create_task(collect(engine, PROMPTS[0], "running", max_tokens=500, ignore_eos=True))
    while not engine.scheduler.rows:
        await asyncio.sleep(0.01)
    await asyncio.wait_for(engine.shutdown(), 30)
    with pytest.raises(EngineDead, match="shut down before the request finished"):
        await asyncio.wait_for(request, 10)


async def test_shutdown_ends_a_loop_that_never_parks(make_engine, monkeypatch):
    engine = await make_engine()
    scheduler = engine.scheduler
    request = asyncio.create_task(collect(engine, PROMPTS[0], "running", max_tokens=500, ignore_eos=True))
    while not scheduler.rows:
        await asyncio.sleep(0.01)
    monkeypatch.setattr(scheduler, "close_park_timeout_s", 0.5)
    monkeypatch.setattr(scheduler.loop, "request_park", lambda: None)  # the park request is lost
    await asyncio.wait_for(engine.shutdown(), 30)
    assert scheduler.loop.closed
    with pytest.raises(EngineDead, match="shut down before the request finished"):
        await asyncio.wait_for(request, 10)


async def test_a_request_whose_final_output_is_queued_ends_normally_when_the_engine_dies(make_engine, monkeypatch):
    engine = await make_engine()
    scheduler = engine.scheduler
    monkeypatch.setattr(scheduler, "_retire_requests", lambda: None)  # the finished request stays listed
    outputs = engine.generate(GenerationRequest("done", list(PROMPTS[2]), SamplingParams(temperature=0.0, max_tokens=3)))
    first = await outputs.__anext__()
    req = scheduler.requests["done"]
    while not req.done:  # its final output is queued, not read yet
        await asyncio.sleep(0.01)
    scheduler.die(RuntimeError("injected failure after the request finished"))
    rest = [out async for out in outputs]
    assert sum(len(c.token_ids) for out in [first, *rest] for c in out.outputs) == 3
    assert (rest or [first])[-1].outputs[0].finished
