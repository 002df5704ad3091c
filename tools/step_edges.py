"""The edge between two decode steps, by the megakernel's own task stamps (full North geometry,
random weights, 8K context, as `python -m northmk.bench decode` builds them):

    NORTHMK_LIB=BUILD/libnorthmk.so python tools/step_edges.py [--batch 1 8]   (CUDA, sm_90)

For each way of enqueueing two steps one after the other, prints in us: the gap from the first
step's last task end to the second step's first stamp (globaltimer, the median over a few
pairs), and the time a step over STEPS steps enqueued that way (one sync at the end):
  back-to-back   nothing between the kernels
  event          an event recorded between them (as a loop that waits for each step does)
  copy           the tokens copied to pinned host memory on the stream, then an event
                 (the bench's and the engine's decode-ahead loop)
  side-copy      an event between them; another stream waits for it and copies the tokens"""
import argparse
import statistics
import time

import torch

from northmk.bench import DecodeState, geometry, synthetic_weights
from northmk.megakernel import _lib, copy_to_host
from northmk.native._lib import check

STEPS = 128
PAIRS = 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    config = geometry("north")
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=0)
    side = torch.cuda.Stream()
    for batch in args.batch:
        s = DecodeState(config, weights, batch, 8192)
        host = torch.empty(batch, dtype=torch.int32, pin_memory=True)

        def between(form: str, tokens: torch.Tensor) -> None:
            if form == "back-to-back":
                return
            if form == "side-copy":
                copy_to_host(tokens, host, side)
                return
            if form == "copy":
                host.copy_(tokens, non_blocking=True)
            torch.cuda.Event().record()

        for _ in range(8):
            s.step()
        bufs = [torch.zeros(1 << 18, 4, dtype=torch.int64, device="cuda") for _ in range(2)]
        forms = ("back-to-back", "event", "copy", "side-copy")
        for form in forms:
            gaps = []
            for _ in range(PAIRS):
                torch.cuda.synchronize()
                for b in bufs:
                    b.zero_()
                for k in range(2):
                    check(_lib().nmk_mk_set_timing(s.mk._handle, bufs[k].data_ptr(), bufs[k].shape[0]))
                    tokens = s.step()
                    if k == 0:
                        between(form, tokens)
                check(_lib().nmk_mk_set_timing(s.mk._handle, None, 0))
                torch.cuda.synchronize()
                first, second = (b[b[:, 2] > 0] for b in bufs)
                gaps.append((second[:, 0].min() - first[:, 2].max()).item() / 1e3)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(STEPS):
                between(form, s.step())
            torch.cuda.synchronize()
            per = (time.perf_counter() - start) / STEPS
            print(f"batch {batch} {form:>13}: gap {statistics.median(gaps):7.2f} us (pairs {min(gaps):.2f}.."
                  f"{max(gaps):.2f}), {per * 1e6:8.1f} us a step over {STEPS}", flush=True)
        s.mk.close()


if __name__ == "__main__":
    main()
