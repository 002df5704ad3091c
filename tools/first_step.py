"""A process's first megakernel steps at a batch size and context bucket, against the next ones
(full North geometry, random weights, the engine's GPU sampler):

    NORTHMK_LIB=BUILD/libnorthmk.so python tools/first_step.py    (a CUDA build, an sm_90 GPU)

prints the wall time of each step and draw, synchronized. A step at a (batch, context bucket)
the Megakernel has not run before first builds and checks that schedule (nmk_mk_step's
schedule_for)."""
import time
import torch
from northmk.bench import DecodeState, geometry
from northmk.checkpoint import synthetic_weights
from northmk.engine.gpu_sampling import GpuSampler, DrawParams

def timed(what, fn):
    torch.cuda.synchronize(); t = time.perf_counter(); out = fn(); torch.cuda.synchronize()
    print(f"{what}: {(time.perf_counter() - t) * 1e3:.1f} ms", flush=True); return out

config = geometry("north")
weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=0)
sampler = GpuSampler("cuda")
for batch in (1, 8):
    s = timed(f"b{batch} DecodeState (Megakernel create)", lambda: DecodeState(config, weights, batch, 8300))
    for i in range(3):
        timed(f"b{batch} step {i}", s.step)
    params = [DrawParams(0.0, 0, 1.0, 0.0, 1, 0)] * batch
    for i in range(2):
        timed(f"b{batch} sampler draw {i}", lambda: sampler.draw(s.logits, params))
    s.positions = [8250] * batch
    timed(f"b{batch} step at 8251 (same bucket)", s.step)
    s.positions = [4000] * batch
    try:
        timed(f"b{batch} step at 4001 (new bucket, 4096)", s.step)
        timed(f"b{batch} step at 4002 (again)", s.step)
        s.positions = [1000] * batch
        timed(f"b{batch} step at 1001 (new bucket, 1024)", s.step)
    except Exception as e:
        print("new bucket:", e)
    s.mk.close()
