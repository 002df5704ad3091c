"""Time one sparse layer's experts in the PyTorch prefill (reference.moe_experts) at North Mini
Code's expert shapes, on the experts row-major (torch's grouped GEMM) and in the tiled layout
the megakernel streams them in (model.tiled_moe, Triton), for prompts of --tokens tokens.

    python tools/moe_bench.py [--tokens 16 256 2048 8192] [--reps 10] [--sweep] [--out DIR]

Routing is uniform (random router logits). Prints a table; with --out writes moe-<commit>.json.
--sweep also times each of the tiled GEMMs (gate_up, down) alone over a set of tile sizes
(model.tiled_moe.Blocks) against torch's grouped GEMM on the row-major experts.
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
from northmk.model.tiled_moe import Blocks, default_blocks, grouped_gemm_tiled
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


def candidates(rows: int, n: int, k: int) -> list[Blocks]:
    """default_blocks and tile sizes around it."""
    if rows <= 2 * EXPERTS * 16:
        swept = [Blocks(m, n, k, 4, st) for m in (16, 32) for n in (32, 64, 128) for k in (64, 128, 256)
                 for st in (2, 3, 4)]
    else:
        swept = [Blocks(m, n, k, w, st) for m in (64, 128) for n in (128, 256) for k in (64, 128) for w in (4, 8)
                 for st in (3, 4)]
    return list(dict.fromkeys([default_blocks(rows, EXPERTS, n, k)] + swept))


def sweep(tokens: int, reps: int, weights: dict, gen) -> list[dict]:
    """Each tiled GEMM alone over candidates(rows), against torch's grouped GEMM row-major."""
    rows = tokens * TOP_K
    ids = torch.randn(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    out = []
    for name, (w, w_t) in weights.items():
        x = torch.randn(rows, w.shape[2], device="cuda", generator=gen).to(torch.bfloat16)
        offsets = counts.cumsum(0).to(torch.int32)
        torch_ms = time_ms(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets), reps)
        timed = []
        for blocks in candidates(rows, *w.shape[1:]):
            try:
                timed.append((time_ms(lambda: grouped_gemm_tiled(x, counts, w_t, blocks), reps), blocks))
            except Exception as exc:  # a tile size past the shared memory: Triton's OutOfResources
                print(f"  {blocks}: {type(exc).__name__}")
        timed.sort(key=lambda t: t[0])
        default = default_blocks(rows, EXPERTS, *w.shape[1:])
        default_ms = next(ms for ms, b in timed if b == default)
        print(f"{tokens:>7} {name:>8} torch {torch_ms:.3f} ms, default {default_ms:.3f} ms, best "
              + ", ".join(f"{ms:.3f} {b}" for ms, b in timed[:3]))
        out.append({"tokens": tokens, "gemm": name, "torch_ms": torch_ms, "default_ms": default_ms,
                    "best": [{"ms": ms, **b.__dict__} for ms, b in timed[:5]]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048, 8192])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="time each tiled GEMM over a set of tile sizes")
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
    swept = []
    if args.sweep:
        for tokens in args.tokens:
            swept += sweep(tokens, args.reps, {"gate_up": (gate_up, gate_up_t), "down": (down, down_t)}, gen)
    if args.out:
        commit = os.environ.get("NORTHMK_COMMIT", "unknown")
        result = {"device": torch.cuda.get_device_name(), "commit": commit, "date": time.strftime("%Y-%m-%d"),
                  "command": "python tools/moe_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "experts": EXPERTS, "hidden": HIDDEN, "inter": INTER, "top_k": TOP_K, "rows": rows,
                  "sweep": swept}
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"moe-{commit}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
