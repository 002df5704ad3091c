"""Decode speed as a client of the engine sees it: AsyncEngine on the megakernel backend at the
full North Mini Code geometry (random weights, a full-vocabulary tokenizer), B concurrent
requests (greedy, or sampled with --temperature and --top-p) with `--context`-token prompts,
tokens counted as generate() yields them:

    NORTHMK_LIB=BUILD/libnorthmk.so python tools/engine_bench.py [--batch 1 8] [--context 8192]
        [--steps 256] [--out DIR]                                 (a CUDA build, an sm_90 GPU)

Per batch: each prompt is prefilled once (PyTorch) into the prefix cache, then the B requests go
in together and find their pages there (once for a short window not kept, then measured); once
every request has yielded its first token the window opens, and it closes when every one of
them has yielded --steps more. tok/s is every token yielded inside the window over its length, so all
B rows decode for all of it; the rows' KV then holds the prompt plus what they generated
(mean_keys). The requests are aborted after the window. This is `python -m northmk.bench
decode`'s step, plus everything the serving loop does around it (the native loop's turn,
the scheduler's step function, the GPU sampler where a row samples, detokenizing and the
outputs' queues).
With --both the same requests run with EngineConfig.decode_ahead on, then off (the scheduler
reads it at every step). With --ragged row i's prompt is i * 64 / B tokens shorter than
--context, so the rows start their KV pages at different steps (the rows' steps that start one
are enqueued ahead on pages the pool gives a step early); each row reports the scheduler's
counts of steps enqueued ahead over its requests. Writes engine-<date>-<commit>.json under --out."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from northmk.bench import datasheet_bandwidth, geometry, git_commit, step_bytes, uniform_distinct
from northmk.checkpoint import synthetic_weights
from northmk.config import PAGE_SIZE
from northmk.engine import AsyncEngine, EngineConfig, GenerationRequest, SamplingParams
from northmk.engine.mk_runner import MegakernelRunner
from northmk.engine import scheduler as sched
from northmk.engine.runner import TorchRunner, kv_page_counts
from northmk.engine.scheduler import Scheduler
from northmk.tokenizer import Tokenizer
from northmk.tokenizer_files import write_tokenizer_files


def make_prompts(engine: AsyncEngine, batch: int, context: int, seed: int, ragged: bool) -> list[list[int]]:
    """Random prompts of `context` tokens, or with `ragged` of context - i * PAGE_SIZE // batch."""
    rng = random.Random(seed)
    top = min(250000, engine.model_config.vocab_size - 64)  # below the chat tokens
    lengths = [context - (i * PAGE_SIZE // batch if ragged else 0) for i in range(batch)]
    return [[rng.randrange(300, top) for _ in range(n)] for n in lengths]


async def warm(engine: AsyncEngine, prompts: list[list[int]], tag: str) -> None:
    """Prefill each prompt once (one token each), so the measured requests find their pages in
    the prefix cache and all start decoding at once."""
    for i, prompt in enumerate(prompts):
        request = GenerationRequest(f"{tag}-warm{i}", prompt, SamplingParams(max_tokens=1))
        got = [t async for out in engine.generate(request) for c in out.outputs for t in c.token_ids]
        if len(got) != 1:
            raise RuntimeError(f"warming prompt {i}: expected one token, got {len(got)}")


class StepClock:
    """perf_counter stamps of the loop thread's decode_step calls and of their waits for the
    device (the scheduler's _DeviceStep.results), patched in before the engine starts."""

    def __init__(self):
        self.calls: list[tuple[float, float]] = []  # (call began, call ended)
        self.waits: list[tuple[float, float]] = []
        step, results = Scheduler.decode_step, sched._DeviceStep.results

        def timed_step(scheduler, batch):
            began = time.perf_counter()
            try:
                return step(scheduler, batch)
            finally:
                self.calls.append((began, time.perf_counter()))

        def timed_results(device_step):
            began = time.perf_counter()
            try:
                return results(device_step)
            finally:
                self.waits.append((began, time.perf_counter()))

        Scheduler.decode_step, sched._DeviceStep.results = timed_step, timed_results
        self.collections: list[tuple[float, float, int]] = []  # Python's gc runs (began, ended, generation)
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self.collections.append((self._gc_began, time.perf_counter(), info["generation"]))

    def summary(self, since: float, until: float) -> dict:
        """Medians (us) over the calls inside [since, until]: a call's host time outside its wait,
        its wait for the device, and the loop's turn from one call's end to the next's start."""
        calls = [(a, b) for a, b in self.calls if since <= a and b <= until]
        if len(calls) < 3:
            return {}
        # each call's wait inside it (none: the step sampled on the host)
        waits, i = [], 0
        for a, b in calls:
            while i < len(self.waits) and self.waits[i][0] < a:
                i += 1
            inside = i < len(self.waits) and self.waits[i][1] <= b
            waits.append(self.waits[i] if inside else (b, b))
        med = lambda xs: 1e6 * statistics.median(xs)
        period = sorted(n[0] - p[0] for p, n in zip(calls, calls[1:]))
        gcs = [(b - a, g) for a, b, g in self.collections if since <= a and b <= until]
        return {"calls": len(calls), "host_us": med([(b - a) - (d - c) for (a, b), (c, d) in zip(calls, waits)]),
                "wait_us": med([d - c for c, d in waits]),
                "turn_us": med([n[0] - p[1] for p, n in zip(calls, calls[1:])]),
                "period_us": {"mean": 1e6 * statistics.mean(period), "p50": 1e6 * period[len(period) // 2],
                              "p90": 1e6 * period[len(period) * 9 // 10], "p99": 1e6 * period[len(period) * 99 // 100],
                              "max": 1e6 * period[-1]},
                "gc": {"runs": len(gcs), "us": 1e6 * sum(d for d, _ in gcs),
                       "max_us": 1e6 * max((d for d, _ in gcs), default=0.0), "gen2": sum(g == 2 for _, g in gcs)}}


async def one_batch(engine: AsyncEngine, prompts: list[list[int]], steps: int, tag: str,
                    temperature: float = 0.0, top_p: float = 1.0) -> dict:
    batch, context = len(prompts), sum(map(len, prompts)) / len(prompts)  # the prompts' mean length
    counts = [0] * batch  # tokens yielded so far, per request
    since_open = [0] * batch  # ... since the window opened
    w: dict = {}  # the window: opened (time, tokens), then ended (time, tokens)
    done = asyncio.Event()

    async def run(i: int) -> None:
        params = SamplingParams(max_tokens=engine.max_model_len - len(prompts[i]), temperature=temperature,
                                top_p=top_p, seed=i, ignore_eos=True)
        gen = engine.generate(GenerationRequest(f"{tag}-{i}", prompts[i], params))
        try:
            async for out in gen:
                n = sum(len(c.token_ids) for c in out.outputs)
                now = time.perf_counter()
                first = counts[i] == 0 and n > 0
                counts[i] += n
                if first and all(counts) and "opened" not in w:
                    w["opened"] = (now, sum(counts))
                elif "opened" in w and not first:
                    since_open[i] += n
                    if min(since_open) >= steps and "ended" not in w:
                        w["ended"] = (now, sum(counts))
                        done.set()
                if done.is_set():
                    return
        finally:
            await gen.aclose()  # aborts the request

    s = engine.scheduler
    counted = ("ahead_steps_taken", "ahead_rows_dropped", "ahead_pages_reserved", "greedy_rows_undrawn")
    before = [getattr(s, c) for c in counted]
    tasks = [asyncio.create_task(run(i)) for i in range(batch)]
    waiter = asyncio.create_task(done.wait())
    await asyncio.wait([waiter, *tasks], timeout=600, return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*tasks)  # raises what a request raised
    if not done.is_set():
        raise RuntimeError(f"batch {batch}: the window did not close within 600 s")
    seconds = w["ended"][0] - w["opened"][0]
    tokens = w["ended"][1] - w["opened"][1]
    return {"backend": engine.backend, "path": "engine", "batch": batch, "context": context,
            "mean_keys": context + (w["opened"][1] + w["ended"][1]) / 2 / batch,
            "window_tokens": tokens, "window_s": seconds, "tok_s": tokens / seconds,
            "ms_per_step": 1e3 * seconds / (tokens / batch), "window": (w["opened"][0], w["ended"][0]),
            "scheduler": {c: getattr(s, c) - b for c, b in zip(counted, before)}}


async def main(args) -> dict:
    config = geometry(args.geometry)
    cuda = args.device == "cuda"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    max_len = args.context + 4 * args.steps + 8192 + PAGE_SIZE
    tok_dir = Path(tempfile.mkdtemp(prefix="northmk-engine-bench-"))
    write_tokenizer_files(tok_dir, config.vocab_size)
    tokenizer = Tokenizer.from_pretrained(tok_dir)
    dtype = torch.bfloat16 if cuda else torch.float32
    weights = synthetic_weights(config, dtype, args.device, seed=0)
    bandwidth = datasheet_bandwidth(device)
    result = {"device": device, "commit": git_commit(), "date": datetime.date.today().isoformat(),
              "command": " ".join(["tools/engine_bench.py", *sys.argv[1:]]), "rows": []}
    engine_config = EngineConfig(device=args.device, dtype=str(dtype).split(".")[1], backend=args.backend,
                                 max_batch=max(args.batch), max_model_len=max_len,
                                 num_kv_pages=2 * max(args.batch) * -(-max_len // PAGE_SIZE))
    runner_class = MegakernelRunner if args.backend == "megakernel" else TorchRunner
    runner = runner_class(config, weights, kv_page_counts(engine_config, config, max_len, dtype))
    engine = AsyncEngine(engine_config, tok_dir, runner, tokenizer)
    clock = StepClock()
    await engine.start()
    out = Path(args.out) / f"engine-{result['date']}-{result['commit']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for batch in args.batch:
            prompts = make_prompts(engine, batch, args.context, batch, args.ragged)
            await warm(engine, prompts, f"b{batch}")
            # a first window, not kept: the first step at a batch size and context bucket builds
            # and checks that schedule (100-190 ms on the H200's host at 2c1e446, tools/first_step.py)
            # unless the engine's background preparation got there first
            first = await one_batch(engine, prompts, 16, f"b{batch}-first")
            first_window = clock.summary(*first.pop("window"))
            for ahead in [True, False] if args.both else [not args.no_ahead]:
                engine.config.decode_ahead = ahead  # the scheduler reads it at every step
                row = await one_batch(engine, prompts, args.steps, f"b{batch}-{ahead}", args.temperature, args.top_p)
                row["decode_ahead"], row["ragged"] = ahead, args.ragged
                row["temperature"], row["top_p"] = args.temperature, args.top_p
                row["loop_thread"] = clock.summary(*row.pop("window"))
                row["first_window_period_us"] = first_window.get("period_us")
                # Speed of light at the rows' mean KV over the window, under uniform routing (an
                # estimate: the decode bench counts the step's real routing).
                if bandwidth:
                    bytes_ = step_bytes(config, batch, row["mean_keys"], uniform_distinct(config, batch))
                    row["sol_fraction_uniform"] = bytes_ / bandwidth * 1e3 / row["ms_per_step"]
                result["rows"].append(row)
                out.write_text(json.dumps(result, indent=2))
                sampled = f", temperature {args.temperature}, top_p {args.top_p}" if args.temperature > 0 else ""
                print(f"engine batch {batch}, decode_ahead {ahead}{sampled}: {row['tok_s']:.1f} tok/s, "
                      f"{row['ms_per_step']:.3f} ms/step ({row['window_tokens']} tokens in {row['window_s']:.2f} s); "
                      f"scheduler {row['scheduler']}; "
                      f"loop thread medians (us): {row['loop_thread']}", flush=True)
    finally:
        await engine.shutdown()
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--out", default=".")
    p.add_argument("--geometry", default="north", help="a checkpoint_writer preset (tiny: a CPU smoke run)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--backend", default="megakernel", choices=("megakernel", "torch"))
    p.add_argument("--no-ahead", action="store_true", help="EngineConfig.decode_ahead off")
    p.add_argument("--both", action="store_true", help="decode_ahead on, then off, on the same weights")
    p.add_argument("--ragged", action="store_true", help="row i's prompt i * 64 / B tokens shorter than --context")
    p.add_argument("--temperature", type=float, default=0.0, help="the requests' (0: greedy); request i has seed i")
    p.add_argument("--top-p", type=float, default=1.0)
    a = p.parse_args()
    asyncio.run(main(a))
