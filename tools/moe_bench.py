"""Time one sparse layer's experts in the PyTorch prefill (reference.moe_experts) at North Mini
Code's expert shapes, on the experts row-major (torch's grouped GEMM) and in the tiled layout
the megakernel streams them in (model.tiled_moe, Triton), for prompts of --tokens tokens.

    python tools/moe_bench.py [--tokens 16 256 2048 8192] [--reps 10] [--out DIR]

Routing is uniform (random router logits). Prints a table; with --out writes moe-<commit>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from northmk.model.reference import moe_experts, route
from northmk.model.weights import to_tiled

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def time_ms(fn, reps: int) -> float:
    for _ in range(3):  # warm-up: Triton's compile, cuBLAS's heuristics
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048, 8192])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_bench: needs a CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / 45).to(torch.bfloat16)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / 28).to(torch.bfloat16)
    gate_up_t, down_t = to_tiled(gate_up), to_tiled(down)
    rows = []
    print(f"{'tokens':>7} {'row-major ms':>13} {'tiled ms':>9} {'tiled/row-major':>16}")
    for tokens in args.tokens:
        h = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        weights, ids = route(torch.randn(tokens, EXPERTS, device="cuda", generator=gen), TOP_K, "sigmoid", False)
        weights = weights.to(torch.bfloat16)
        row_major = time_ms(lambda: moe_experts(h, weights, ids, gate_up, down), args.reps)
        tiled = time_ms(lambda: moe_experts(h, weights, ids, gate_up_t, down_t, tiled=True), args.reps)
        rows.append({"tokens": tokens, "row_major_ms": row_major, "tiled_ms": tiled})
        print(f"{tokens:>7} {row_major:>13.3f} {tiled:>9.3f} {tiled / row_major:>16.2f}")
    if args.out:
        commit = os.environ.get("NORTHMK_COMMIT", "unknown")
        result = {"device": torch.cuda.get_device_name(), "commit": commit, "date": time.strftime("%Y-%m-%d"),
                  "command": "python tools/moe_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "experts": EXPERTS, "hidden": HIDDEN, "inter": INTER, "top_k": TOP_K, "rows": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"moe-{commit}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
