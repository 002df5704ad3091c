"""Microseconds per nmk_sample draw on the GPU, per rule and row count, from replays of a
captured draw (no launch overhead), at the full vocabulary:

    NORTHMK_LIB=BUILD/libnorthmk.so python tools/sample_bench.py [--rows 1 8] [--out FILE.json]

Logits "peaked" (a few dozen tokens far above the rest, like a model's) and "normal" (flat:
top_p's radix searches run most often there). Each row of a case has its own seed."""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the GPU tests' module, from a checkout

from northmk.engine.gpu_sampling import DrawParams, GpuSampler  # noqa: E402
from northmk.native.sample import MAX_ROWS  # noqa: E402
from tests.gpu.test_sampling import MIXED, logits_of, time_draw  # noqa: E402 (the GPU tests' rows, logits and timer)

VOCAB = 262144
CASES = {
    "greedy": MIXED[0],
    "temperature": DrawParams(1.0, 0, 1.0, 0.0, 0, 0),
    "top_k": MIXED[2],
    "top_p": MIXED[3],
    "min_p": MIXED[4],
    "top_k+top_p": MIXED[5],
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if any(not 1 <= r <= MAX_ROWS for r in args.rows) or args.repeats < 1:
        print(f"tools/sample_bench.py: error: want --rows in [1, {MAX_ROWS}] and --repeats >= 1", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("tools/sample_bench.py: error: nmk_sample needs a CUDA device (torch sees none)", file=sys.stderr)
        return 2
    sampler, results = GpuSampler("cuda"), []
    for kind in ("peaked", "normal"):
        for rows in args.rows:
            logits = logits_of(kind, rows, VOCAB, seed=rows)
            line = []
            for name, base in CASES.items():
                params = [dataclasses.replace(base, seed=base.seed + b) for b in range(rows)]
                us = time_draw(sampler, logits, params, repeats=args.repeats)
                results.append({"logits": kind, "rows": rows, "rule": name, "us": round(us, 2)})
                line.append(f"{name} {us:.1f}")
            print(f"{kind:6s} rows {rows}: " + ", ".join(line) + " us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "vocab": VOCAB, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
