"""Where a decode step's time goes outside the megakernel, at batch 1 and 8 (full North geometry,
random weights, 8K context, as `python -m northmk.bench decode` builds them):

    NORTHMK_LIB=BUILD/libnorthmk.so python tools/step_gap.py     (a CUDA build, an sm_90 GPU)

prints per batch, in us a step: the bench's loop (a step, then its tokens to the host), the same
steps back to back (one sync at the end), a step then torch.cuda.synchronize, the host time of
Megakernel.step alone (median and least), and CUDA events around one step."""
import statistics
import time

import torch

from northmk.bench import DecodeState, geometry, synthetic_weights

STEPS = 128


def per_step(run, then=lambda: None) -> float:
    """Mean seconds of `run` over STEPS calls, each followed by `then`, and a sync at the end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        run()
        then()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / STEPS


config = geometry("north")
weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=0)
for batch in (1, 8):
    s = DecodeState(config, weights, batch, 8192)
    for _ in range(8):
        s.step()
    bench_loop = per_step(lambda: s.step().tolist())
    back_to_back = per_step(s.step)
    with_sync = per_step(s.step, torch.cuda.synchronize)
    host = []
    for _ in range(STEPS):
        start = time.perf_counter()
        s.step()
        host.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    events = []
    for _ in range(32):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        s.step()
        end.record()
        end.synchronize()
        events.append(begin.elapsed_time(end) * 1e3)
    print(f"batch {batch}: bench loop {bench_loop * 1e6:.1f} us/step, back-to-back {back_to_back * 1e6:.1f}, "
          f"step + synchronize {with_sync * 1e6:.1f}, host time of step() {statistics.median(host) * 1e6:.1f} "
          f"(least {min(host) * 1e6:.1f}), events around one step {statistics.median(events):.1f}")
    s.mk.close()
