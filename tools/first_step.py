"""A process's first megakernel steps at a batch size and context bucket, against the next ones
(full North geometry, random weights, the engine's GPU sampler):

    NORTHMK_LIB=BUILD/libnorthmk.so python tools/first_step.py    (a CUDA build, an sm_90 GPU)

prints the wall time of each step and draw, synchronized. A step at a (batch, context bucket)
the Megakernel has not run before first builds and checks that schedule (nmk_mk_step's
schedule_for); nmk_mk_prepare does it ahead."""
import time

import torch

from northmk.bench import DecodeState, geometry
from northmk.checkpoint import synthetic_weights
from northmk.engine.gpu_sampling import DrawParams, GpuSampler


def timed(what: str, run) -> None:
    torch.cuda.synchronize()
    began = time.perf_counter()
    run()
    torch.cuda.synchronize()
    print(f"{what}: {(time.perf_counter() - began) * 1e3:.1f} ms", flush=True)


config = geometry("north")
weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=0)
sampler = GpuSampler("cuda")
for batch in (1, 8):
    states = []
    timed(f"b{batch} DecodeState (Megakernel create)",
          lambda: states.append(DecodeState(config, weights, batch, 8300)))  # bucket 16384
    s = states[0]
    for i in range(3):
        timed(f"b{batch} step {i}", s.step)
    params = [DrawParams(0.0, 0, 1.0, 0.0, 1, 0)] * batch
    for i in range(2):
        timed(f"b{batch} sampler draw {i}", lambda: sampler.draw(s.logits, params))
    for position, what in ((8250, "same bucket"), (4000, "new bucket, 4096"), (4001, "again"),
                           (1000, "new bucket, 1024")):
        s.positions = [position] * batch
        timed(f"b{batch} step at {position + 1} ({what})", s.step)
    s.mk.close()
