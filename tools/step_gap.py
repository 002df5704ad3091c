"""Where a decode step's time goes outside the megakernel, at batch 1 and 8 (full North geometry,
random weights, 8K context, as `python -m northmk.bench decode` builds them):

    NORTHMK_LIB=BUILD/libnorthmk.so python tools/step_gap.py     (a CUDA build, an sm_90 GPU)

prints per batch the bench's loop (a step, then its tokens to the host), the same steps back to
back (one sync at the end), a step then torch.cuda.synchronize, the host time of
Megakernel.step alone, and CUDA events around one step (us each)."""
import statistics
import time

import torch

from northmk.bench import geometry, synthetic_weights
from northmk.config import PAGE_SIZE
from northmk.megakernel import Megakernel
from northmk.model.kv import PagedKVCache

config = geometry("north")
weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=0)
for batch in (1, 8):
    context = 8192
    per_row = -(-context // PAGE_SIZE)
    kv = PagedKVCache(config, [batch * per_row] * len(config.attention_groups), torch.bfloat16, "cuda")
    for p in kv.pages:
        p.normal_()
    table = torch.arange(batch * per_row, dtype=torch.int32, device="cuda").view(batch, per_row)
    tables = [table] * len(kv.pages)
    mk = Megakernel(config, weights, kv)
    tokens = torch.randint(0, config.vocab_size, (batch,), dtype=torch.int32, device="cuda")
    positions = [context - 1] * batch
    logits = torch.empty(batch, config.vocab_size, dtype=torch.float32, device="cuda")
    outs = [torch.empty(batch, dtype=torch.int32, device="cuda") for _ in range(2)]
    for i in range(8):
        _, tokens = mk.step(tokens, positions, tables, logits, outs[i % 2])
    torch.cuda.synchronize()
    n = 128
    t0 = time.perf_counter()
    for i in range(n):
        _, tokens = mk.step(tokens, positions, tables, logits, outs[i % 2])
        tokens.tolist()
    bench_loop = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        _, tokens = mk.step(tokens, positions, tables, logits, outs[i % 2])
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - t0) / n
    host = []
    for i in range(n):
        h0 = time.perf_counter()
        _, tokens = mk.step(tokens, positions, tables, logits, outs[i % 2])
        host.append(time.perf_counter() - h0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        _, tokens = mk.step(tokens, positions, tables, logits, outs[i % 2])
        torch.cuda.synchronize()
    with_sync = (time.perf_counter() - t0) / n
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    gpu = []
    for i in range(32):
        ev[0].record()
        _, tokens = mk.step(tokens, positions, tables, logits, outs[i % 2])
        ev[1].record()
        ev[1].synchronize()
        gpu.append(ev[0].elapsed_time(ev[1]) * 1e3)
    print(f"batch {batch}: bench loop {bench_loop * 1e6:.1f} us/step, back-to-back {back_to_back * 1e6:.1f}, "
          f"step + synchronize {with_sync * 1e6:.1f}, host time of step() {statistics.median(host) * 1e6:.1f} "
          f"(min {min(host) * 1e6:.1f}), events around one step {statistics.median(gpu):.1f}")
    mk.close()
