"""Benchmarks. `python -m northmk.bench decode`: the megakernel's decode step at full North
Mini Code geometry (random weights, KV noise at --context), per batch size: tok/s, ms/step
and the fraction of speed-of-light (benchmarks/NOTES.md) at the datasheet bandwidth."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from .checkpoint import synthetic_weights
from .config import PAGE_SIZE, SLIDING, ModelConfig
from .megakernel import Megakernel, Opcode
from .model.kv import PagedKVCache

DATASHEET_BW = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s


def north_geometry() -> ModelConfig:
    return ModelConfig.from_dict({
        "model_type": "cohere2_moe", "hidden_size": 2048, "num_hidden_layers": 49,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 262144,
        "num_experts": 128, "num_experts_per_tok": 8, "intermediate_size": 768,
        "prefix_dense_intermediate_size": 3072, "first_k_dense_replace": 1, "sliding_window": 4096,
        "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "expert_selection_fn": "sigmoid", "norm_topk_prob": False,
        "logit_scale": 1.0, "tie_word_embeddings": True, "max_position_embeddings": 16384,
    })


def step_bytes(c: ModelConfig, batch: int, context: int, distinct_experts: float) -> float:
    """Bytes a decode step must read: weights touched once + every row's visible KV (bf16)."""
    h, q, kv = c.hidden_size, c.q_size, c.kv_size
    params = c.vocab_size * h + c.num_layers * (h * (q + 2 * kv) + q * h + h) + h
    for mt in c.mlp_types:
        if mt == "dense":
            params += 3 * h * c.dense_intermediate_size
        else:
            params += c.num_experts * h + distinct_experts * 3 * h * c.moe_intermediate_size
    keys = sum(min(context, c.sliding_window) if t == SLIDING else context for t in c.layer_types)
    return 2 * params + batch * keys * 2 * kv * 2


def uniform_distinct(c: ModelConfig, batch: int) -> float:
    return c.num_experts * (1 - (1 - c.top_k / c.num_experts) ** batch)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * a.numel() / sorted(times[2:])[len(times[2:]) // 2]


def bench_megakernel(config, weights, batch: int, context: int, steps: int) -> dict:
    per_row = -(-context // PAGE_SIZE)
    kv = PagedKVCache(config, [batch * per_row] * len(config.attention_groups), torch.bfloat16, "cuda")
    for pages in kv.pages:
        pages.normal_()
    table = torch.arange(batch * per_row, dtype=torch.int32, device="cuda").view(batch, per_row)
    tables = [table] * len(kv.pages)
    mk = Megakernel(config, weights, kv)
    tokens = torch.randint(0, config.vocab_size, (batch,), dtype=torch.int32, device="cuda")
    positions = [context - 1] * batch
    for _ in range(8):
        _, tokens = mk.step(tokens, positions, tables)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):  # as the native loop runs it: step, then publish tokens to the host
        _, tokens = mk.step(tokens, positions, tables)
        tokens.tolist()
    seconds = (time.perf_counter() - start) / steps
    timing = profile(mk, tokens, positions, tables)
    mk.enable_debug()  # one more step, traced, for the experts it really routed to
    mk.step(tokens, positions, tables)
    distinct = routed_distinct(config, mk.trace(batch).experts)
    mk.close()
    return {"backend": "megakernel", "batch": batch, "context": context, "ms_per_step": seconds * 1e3,
            "tok_s": batch / seconds, "distinct_experts": distinct, "profile": timing}


def profile(mk: Megakernel, tokens: torch.Tensor, positions: list[int], tables: list[torch.Tensor]) -> dict:
    """One timed step: its span, and per opcode the tasks, the summed run and wait time (us)."""
    mk.enable_timing()
    mk.step(tokens, positions, tables)
    torch.cuda.synchronize()
    t = mk.task_times()
    ops = {}
    for op in Opcode:
        mine = t[(t[:, 3] & 0xFF) == op]
        if len(mine):
            ops[op.name] = {"tasks": len(mine), "run_us": (mine[:, 2] - mine[:, 1]).sum().item() / 1e3,
                            "wait_us": (mine[:, 1] - mine[:, 0]).sum().item() / 1e3,
                            "max_run_us": (mine[:, 2] - mine[:, 1]).max().item() / 1e3}
    norms = t[(t[:, 3] & 0xFF) == Opcode.NORM][:, 1].sort().values
    layer_us = (norms[-1] - norms[0]).item() / 1e3 / max(1, len(norms) - 1)
    return {"span_us": t[:, 2].max().item() / 1e3, "layer_us": layer_us, "ops": ops}


def print_profile(prof: dict) -> None:
    print(f"  timed step span {prof['span_us']:.0f} us, {prof['layer_us']:.1f} us per layer; per opcode: tasks, summed run / wait us, longest run us")
    for name, o in sorted(prof["ops"].items(), key=lambda kv: -kv[1]["run_us"]):
        print(f"  {name:>10} {o['tasks']:6d} {o['run_us']:12.0f} {o['wait_us']:12.0f} {o['max_run_us']:9.1f}")


def routed_distinct(config: ModelConfig, experts: torch.Tensor) -> float:
    """Mean over sparse layers of the distinct experts a step routed to. experts [L, B, K]."""
    sparse = [l for l, t in enumerate(config.mlp_types) if t != "dense"]
    return sum(experts[l].unique().numel() for l in sparse) / max(1, len(sparse))


def decode(args) -> None:
    device = torch.cuda.get_device_name()
    bw = next((v for k, v in DATASHEET_BW.items() if k in device), None)
    config = north_geometry()
    copy_bw = copy_bandwidth()
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=0)
    rows = []
    for batch in args.batch:
        row = bench_megakernel(config, weights, batch, args.context, args.steps)
        sol_s = step_bytes(config, batch, args.context, row["distinct_experts"]) / bw if bw else float("nan")
        row["sol_fraction"] = sol_s * 1e3 / row["ms_per_step"]
        row["uniform_distinct_experts"] = uniform_distinct(config, batch)
        rows.append(row)
        print(f"batch {batch}: {row['tok_s']:.1f} tok/s, {row['ms_per_step']:.3f} ms/step, "
              f"{100 * row['sol_fraction']:.1f}% of SoL", flush=True)
        print_profile(row["profile"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip()
    commit = f"{commit}-dirty" if commit and dirty else commit
    commit = commit or os.environ.get("NORTHMK_COMMIT", "")  # device copies carry no git metadata
    result = {"device": device, "commit": commit or "uncommitted", "date": datetime.date.today().isoformat(),
              "command": " ".join(sys.argv), "copy_bandwidth_bytes_s": copy_bw,
              "sol_note": "bytes at the datasheet bandwidth, distinct experts from a traced step's routing",
              "rows": rows}
    out = Path(args.out) / f"decode-{result['date']}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m northmk.bench")
    sub = parser.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decode", help="megakernel decode step at full North geometry")
    d.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    d.add_argument("--context", type=int, default=8192)
    d.add_argument("--steps", type=int, default=256)
    d.add_argument("--out", default="benchmarks")
    args = parser.parse_args(argv)
    if args.what == "decode":
        decode(args)


if __name__ == "__main__":
    main()
