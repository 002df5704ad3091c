"""Benchmarks (benchmarks/NOTES.md has the speed-of-light arithmetic and the results log).

    python -m northmk.bench decode [--batch 1 2 4 8] [--context 8192] [--steps 256]
        [--no-peer | --peer-only] [--record [NOTES.md]] [--plot PNG] [--out benchmarks]
    python -m northmk.bench record RESULT.json [--notes benchmarks/NOTES.md]
    python -m northmk.bench plot RESULT.json [MORE.json ...] [--out PNG]
    python -m northmk.bench critical TASK_TIMES.npy [--batch B --context C] [--sms 132] [--layer L]
    python -m northmk.bench simulate TASK_TIMES.npy [--batch B --context C] [--sms 132] [--hop-us H --turn-us T]
        [--what-if OP=CHANGE ...] [--save-runs RUNS.npz]
    python -m northmk.bench simulate RUNS.npz [--hop-us H --turn-us T] [--what-if OP=CHANGE ...]
    python -m northmk.bench fluid TASK_TIMES.npy [--batch B --context C] [--sms 132] [--executors 2]
        [--executor-gbs 45 --sm-gbs 45 --dram-tbs 4.24] [--hop-us H --turn-us T] [--fixed-quantile 0.1]
        [--their-executor-gbs G] [--their-fixed F] [--what-if OP=CHANGE ...]
    python -m northmk.bench timeline TASK_TIMES.npy [--batch B --context C] [--sms 132] [--bin-us 5] [--layer L]
    python -m northmk.bench switches TASK_TIMES.npy [--min-us 1.5]
    python -m northmk.bench ops TASK_TIMES.npy [MORE.npy ...] [--layers 2:46]

`decode` times the megakernel's decode step at full North Mini Code geometry (random weights,
KV noise at --context) and then, on the same weights, Hugging Face transformers'
Cohere2MoeForCausalLM (northmk.bench_peer; skip it with --no-peer, run it alone with
--peer-only). Per row: tok/s, ms/step and the fraction of speed-of-light at the datasheet
bandwidth from the bytes the step had to read (distinct experts from the step's routing).
It writes benchmarks/decode-<date>-<commit>.json; --record appends the run's line to the
results log, --plot draws tok/s against batch (northmk.bench_plot). `record` and `plot` do
the same later from result files (device runs come back as files, without git); `plot`
joins the rows of several files (e.g. a --no-peer and a --peer-only run of one session).
`critical` walks a profiled step's task times (the task-times-b{B}-c{C}.npy a decode run
writes, or that file xz-compressed as .npy.xz) back along the chain of tasks that set its
length (northmk.bench_critical);
`simulate` replays that step's schedule in time from its tasks' measured run times
(northmk.bench_simulate) and says how long it comes out, with and without the gaps between
tasks; with --what-if it replays the step again with some opcodes' run times changed (QKV=-1.5:
every QKV task 1.5 us shorter; ATTN=x0.7: every attention task at 70% of its time), the
prediction of a change that shortens tasks without moving the DRAM traffic between them.
--save-runs keeps the step's run times by task; given to `simulate` with a library whose schedule
builder lays the same tasks out otherwise (another queue order or placement), they replay that
schedule: the prediction of a change of order.
`fluid` replays a schedule with its tasks sharing DRAM bandwidth: each task a fixed part (from the
profiled step) around the bytes it streams, at rates capped per executor, per SM and for DRAM
(northmk.bench_fluid); with --executors N it replays a schedule built for N executors per SM
against the profiled step's own schedule replayed the same way, and with --their-fixed F or
--what-if OP=CHANGE the step with its fixed parts (all, or one opcode's) changed, with
--op-gbs OP=GBS one opcode's streams capped otherwise, with --ahead-kb K a task's first K KB
streamed while it waits.
`timeline` spreads each task's bytes (weights, KV pages) over its run: the bandwidth
the step asked of DRAM in each bin, and per opcode the SMs that ran (northmk.bench_timeline).
`switches` compares, per opcode, the run of its tasks that follow a task of their own
opcode on their SM with those that follow another (northmk.bench_critical.opcode_switches).
`ops` puts profiled steps side by side (an A/B's variants): per step its span and per opcode
the mean run and wait of its tasks in the middle layers (northmk.bench_critical.opcode_means).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import lzma
import math
import os
import re
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from .checkpoint import synthetic_weights
from .checkpoint_writer import PRESETS, config_dict
from .config import PAGE_SIZE, SLIDING, ModelConfig
from .megakernel import MAX_BATCH, Megakernel, Opcode, copy_to_host
from .model.kv import PagedKVCache
from .model.weights import untile_experts_

DATASHEET_BW = {"H200": 4.8e12, "H100": 3.35e12}  # bytes/s
MEGAKERNEL, PEER = "megakernel", "hf-transformers"
RESULTS_LOG = "## Results log"


def geometry(name: str) -> ModelConfig:
    """A checkpoint_writer preset: `north` is the full North Mini Code geometry."""
    return ModelConfig.from_dict(config_dict(name))


def north_geometry() -> ModelConfig:
    return geometry("north")


# ---- speed of light -------------------------------------------------------------------

def step_bytes(c: ModelConfig, batch: int, context: float, distinct_experts: float) -> float:
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


def datasheet_bandwidth(device: str) -> float | None:
    return next((v for k, v in DATASHEET_BW.items() if k in device), None)


def sol_fraction(c: ModelConfig, row: dict, bandwidth: float | None) -> float | None:
    """SoL time / measured time; the row's keys are its context unless it decoded past it."""
    if bandwidth is None:
        return None
    keys = row.get("mean_keys", row["context"])
    return step_bytes(c, row["batch"], keys, row["distinct_experts"]) / bandwidth * 1e3 / row["ms_per_step"]


def sol_curve(c: ModelConfig, context: int, bandwidth: float, max_batch: int) -> list[dict]:
    """Speed-of-light tok/s per batch size under uniform routing."""
    return [{"batch": b, "tok_s": b * bandwidth / step_bytes(c, b, context, uniform_distinct(c, b))}
            for b in range(1, max_batch + 1)]


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


# ---- the megakernel ---------------------------------------------------------------------

def kv_layout(config: ModelConfig, batch: int, context: int, device) -> tuple[list[int], list[torch.Tensor]]:
    """Pages per KV group and block tables for `batch` rows of `context` tokens, each row on
    its own pages. A sliding group's row holds only the pages its window sees, as a ring (the
    engine's pool releases the pages behind the window): column c of its table is page c mod n
    of the row's n."""
    per_row = -(-context // PAGE_SIZE)
    window_pages = -(-(config.sliding_window or 0) // PAGE_SIZE) + 1
    rows = [min(per_row, window_pages) if g == SLIDING else per_row for g in config.attention_groups]
    cols = torch.arange(per_row, dtype=torch.int32, device=device)
    first = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
    return [batch * n for n in rows], [first * n + cols % n for n in rows]


class DecodeState:
    """A megakernel decoding `batch` rows at `context` tokens of KV filled with noise, every row
    on its own pages. step() runs one step on the rows' last tokens into outputs that live
    across steps, as a serving loop keeps them: the logits, and the sampled tokens in two
    buffers (a step's input is the other one)."""

    def __init__(self, config, weights, batch: int, context: int):
        pages, self.tables = kv_layout(config, batch, context, "cuda")
        kv = PagedKVCache(config, pages, torch.bfloat16, "cuda")
        for group in kv.pages:
            group.normal_()
        self.mk = Megakernel(config, weights, kv)
        self.tokens = torch.randint(0, config.vocab_size, (batch,), dtype=torch.int32, device="cuda")
        self.positions = [context - 1] * batch
        self.logits = torch.empty(batch, config.vocab_size, dtype=torch.float32, device="cuda")
        self.outs = [torch.empty(batch, dtype=torch.int32, device="cuda") for _ in range(2)]
        self.steps = 0

    def step(self) -> torch.Tensor:
        """One step, enqueued on the current stream; returns its sampled tokens (device)."""
        _, self.tokens = self.mk.step(self.tokens, self.positions, self.tables, self.logits, self.outs[self.steps % 2])
        self.steps += 1
        return self.tokens


def timed_steps(s: DecodeState, steps: int, ahead: bool) -> tuple[float, list[list[int]]]:
    """Seconds a step over `steps` steps, and each step's tokens as the host read them. With
    `ahead`, as the engine's decode loop runs them (decode_ahead, its default): step t + 1, fed
    step t's tokens on the device, is enqueued before step t's tokens are waited for and read,
    from pinned buffers that a second stream fills after each step (so that nothing sits between
    two steps' kernels, as in the engine's _enqueue). Without it, each step's tokens
    are read before the next step is enqueued (the engine's --no-decode-ahead)."""
    torch.cuda.synchronize()
    host = [torch.empty(s.tokens.shape, dtype=torch.int32, pin_memory=True) for _ in range(2)]
    copied: list[torch.cuda.Event | None] = [None, None]
    side = torch.cuda.Stream()
    read = []
    start = time.perf_counter()
    for i in range(steps):
        if not ahead:
            read.append(s.step().tolist())
            continue
        copied[i % 2] = copy_to_host(s.step(), host[i % 2], side)
        if i:
            copied[(i - 1) % 2].synchronize()
            read.append(host[(i - 1) % 2].tolist())
    if ahead:
        copied[(steps - 1) % 2].synchronize()
        read.append(host[(steps - 1) % 2].tolist())
    return (time.perf_counter() - start) / steps, read


def bench_megakernel(config, weights, batch: int, context: int, steps: int, warmup: int = 8,
                     ahead: bool = True) -> dict:
    s = DecodeState(config, weights, batch, context)
    for _ in range(warmup):
        s.step()
    seconds, _ = timed_steps(s, steps, ahead)
    timing, task_times = profile(s.mk, s.tokens, s.positions, s.tables)
    s.mk.enable_debug()  # one more step, traced, for the experts it really routed to
    s.mk.step(s.tokens, s.positions, s.tables)
    distinct = routed_distinct(config, s.mk.trace(batch).experts)
    s.mk.close()
    return {"backend": MEGAKERNEL, "batch": batch, "context": context, "ms_per_step": seconds * 1e3, "ahead": ahead,
            "tok_s": batch / seconds, "distinct_experts": distinct, "profile": timing,
            "task_times": task_times}


def profile(mk: Megakernel, tokens: torch.Tensor, positions: list[int], tables: list[torch.Tensor]
            ) -> tuple[dict, torch.Tensor]:
    """One timed step: summarize_tasks of its task times, and the raw times (Megakernel.task_times)."""
    mk.enable_timing()
    mk.step(tokens, positions, tables)
    torch.cuda.synchronize()
    t = mk.task_times()
    return summarize_tasks(t), t


def summarize_tasks(t: torch.Tensor) -> dict:
    """Task times [tasks, 4] (wait, start, end ns; op | layer << 8 | sm << 16, sm the CTA that
    ran it) -> the step's span, the mean layer time, per opcode the tasks and summed run / wait
    time (us), per opcode the mean over layers of its last task's end after the layer's first
    task (a NORM, QKV or ROUTER tile) began (chain_us) and of its tasks' first start, median
    start, median end and last end on the same clock (timeline_us), and the summed run time of
    each SM's tasks: its mean, min and max over the SMs that ran a task (sm_busy_us; records
    without the sm field count as SM 0's). DRAIN records, should a kernel write them, count only as opcode DRAIN."""
    op_of, layer_of, sm_of = t[:, 3] & 0xFF, (t[:, 3] >> 8) & 0xFF, (t[:, 3] >> 16) & 0xFFFF
    ops = {}
    for op in Opcode:
        mine = t[op_of == op]
        if len(mine):
            ops[op.name] = {"tasks": len(mine), "run_us": (mine[:, 2] - mine[:, 1]).sum().item() / 1e3,
                            "wait_us": (mine[:, 1] - mine[:, 0]).sum().item() / 1e3,
                            "max_run_us": (mine[:, 2] - mine[:, 1]).max().item() / 1e3}
    # A layer begins with its first task: a NORM (layer 0), QKV or ROUTER tile (past layer 0 at the
    # end of the previous layer's queue; up to two rows stamped before their wait: vm.cuh's own_wait).
    firsts = (op_of == Opcode.NORM) | (op_of == Opcode.QKV) | (op_of == Opcode.ROUTER)
    chain: dict[str, list[float]] = {}
    timeline: dict[str, list[list[float]]] = {}
    starts = []
    for layer in layer_of[op_of == Opcode.QKV].unique():
        start = t[firsts & (layer_of == layer)][:, 1].min()
        starts.append(start.item())
        for op in Opcode:
            mine = t[(op_of == op) & (layer_of == layer)]
            if len(mine) and op not in (Opcode.FINAL_NORM, Opcode.LM_HEAD, Opcode.ARGMAX, Opcode.DRAIN):
                began, ended = (mine[:, 1] - start).double() / 1e3, (mine[:, 2] - start).double() / 1e3
                chain.setdefault(op.name, []).append(ended.max().item())
                timeline.setdefault(op.name, []).append(
                    [began.min().item(), began.median().item(), ended.median().item(), ended.max().item()])
    layer_us = (max(starts) - min(starts)) / 1e3 / max(1, len(starts) - 1) if starts else 0.0
    work = op_of != Opcode.DRAIN
    busy = torch.zeros(int(sm_of.max().item()) + 1 if len(t) else 0, dtype=torch.int64)
    busy.index_add_(0, sm_of[work], t[work, 2] - t[work, 1])
    busy = busy[torch.bincount(sm_of[work], minlength=len(busy)) > 0].double() / 1e3
    sm_busy = {"mean": busy.mean().item(), "min": busy.min().item(), "max": busy.max().item()} if len(busy) else {}
    return {"span_us": t[:, 2].max().item() / 1e3, "layer_us": layer_us, "ops": ops,
            "chain_us": {name: sum(v) / len(v) for name, v in chain.items()},
            "timeline_us": {name: [sum(col) / len(v) for col in zip(*v)] for name, v in timeline.items()},
            "sm_busy_us": sm_busy}


def print_profile(prof: dict) -> None:
    print(f"  timed step span {prof['span_us']:.0f} us, {prof['layer_us']:.1f} us per layer; per opcode: tasks, summed run / wait us, longest run us")
    chain = ", ".join(f"{name} {us:.1f}" for name, us in sorted(prof.get("chain_us", {}).items(), key=lambda kv: kv[1]))
    print(f"  a layer's opcodes done after its first task began (us): {chain}")
    for name, o in sorted(prof["ops"].items(), key=lambda kv: -kv[1]["run_us"]):
        print(f"  {name:>10} {o['tasks']:6d} {o['run_us']:12.0f} {o['wait_us']:12.0f} {o['max_run_us']:9.1f}")
    timeline = sorted(prof.get("timeline_us", {}).items(), key=lambda kv: kv[1][0])
    if timeline:
        print("  after the layer's first task began, per opcode: first start, median start, median end, last end (us)")
        for name, (first, mid_start, mid_end, last) in timeline:
            print(f"  {name:>10} {first:7.1f} {mid_start:7.1f} {mid_end:7.1f} {last:7.1f}")


def routed_distinct(config: ModelConfig, experts: torch.Tensor) -> float:
    """Mean over sparse layers of the distinct experts a step routed to. experts [L, B, K]."""
    sparse = [l for l, t in enumerate(config.mlp_types) if t != "dense"]
    return sum(experts[l].unique().numel() for l in sparse) / max(1, len(sparse))


# ---- one run ----------------------------------------------------------------------------

def megakernel_rows(args, config, weights, keep) -> None:
    for batch in args.batch:
        row = bench_megakernel(config, weights, batch, args.context, args.steps, args.warmup, not args.wait_each_step)
        # Every task the profiled step ran (wait, start, end ns; op | layer << 8 | sm << 16), in the
        # order of the schedule's task array (lists, then queues) less its DRAIN entries, for
        # timelines off the device.
        path = Path(args.out) / f"task-times-b{batch}-c{args.context}.npy"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, row.pop("task_times").numpy())
        keep(row)
        print_profile(row["profile"])
        torch.cuda.empty_cache()  # the next batch's KV, then the peer, need the room


def peer_rows(args, config, weights, keep) -> None:
    from .bench_peer import bench_peer, build_peer  # imports transformers

    untile_experts_(weights)  # back from the megakernel's layout: transformers reads them row-major
    model = build_peer(config, weights)  # its parameters are views of `weights`
    for batch in args.batch:
        row = bench_peer(model, batch, args.context, args.steps, args.warmup)
        del row["tokens"]
        keep(row)


def report(row: dict, config: ModelConfig, bandwidth: float | None) -> None:
    row["sol_fraction"] = sol_fraction(config, row, bandwidth)
    row["uniform_distinct_experts"] = uniform_distinct(config, row["batch"])
    label = "" if row["backend"] == MEGAKERNEL else f" ({row['backend']})"
    sol = "" if row["sol_fraction"] is None else f", {100 * row['sol_fraction']:.1f}% of SoL"
    print(f"batch {row['batch']}{label}: {row['tok_s']:.1f} tok/s, {row['ms_per_step']:.3f} ms/step{sol}", flush=True)


def git(*cmd: str) -> str:
    try:
        return subprocess.run(["git", *cmd], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def git_commit() -> str:
    """NORTHMK_COMMIT when set (the device copy of the tree may carry stale git metadata), else
    the checkout's short HEAD (-dirty with local changes)."""
    if os.environ.get("NORTHMK_COMMIT"):
        return os.environ["NORTHMK_COMMIT"]
    commit = git("rev-parse", "--short", "HEAD")
    commit = f"{commit}-dirty" if commit and git("status", "--porcelain") else commit
    return commit or "uncommitted"


def decode(args) -> dict:
    """Run the benchmark; the result file is rewritten after every row, so a run cut short
    (an error, a timeout) keeps what it measured."""
    config = geometry(args.geometry)
    cuda = args.device == "cuda"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    bandwidth = datasheet_bandwidth(device)
    copy_bw = copy_bandwidth() if cuda else None
    result = {"device": device, "commit": git_commit(), "date": datetime.date.today().isoformat(),
              "command": args.command, "geometry": args.geometry, "steps": args.steps, "warmup": args.warmup,
              "datasheet_bandwidth_bytes_s": bandwidth, "copy_bandwidth_bytes_s": copy_bw,
              "sol_note": "bytes at the datasheet bandwidth, distinct experts from one more step's routing",
              "rows": []}
    if bandwidth:
        result["sol_curve"] = sol_curve(config, args.context, bandwidth, max(max(args.batch), MAX_BATCH))
    out = unused_path(Path(args.out) / f"decode-{result['date']}-{result['commit']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def keep(row: dict) -> None:
        report(row, config, bandwidth)
        result["rows"].append(row)
        out.write_text(json.dumps(result, indent=2))

    weights = synthetic_weights(config, torch.bfloat16, args.device, seed=0)
    try:
        if not args.peer_only:
            megakernel_rows(args, config, weights, keep)
        if not args.no_peer:
            peer_rows(args, config, weights, keep)
    except Exception as exc:  # device time is scarce: keep the rows measured so far
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    out.write_text(json.dumps(result, indent=2))
    copy = f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; " if copy_bw else ""
    print(f"{copy}wrote {out}")
    if args.record:
        record(result, out, Path(args.record))
    if args.plot and result["rows"]:
        plot(result, Path(args.plot))
    return result


def unused_path(path: Path) -> Path:
    n = 2
    candidate = path
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
        n += 1
    return candidate


# ---- the results log and the plot -------------------------------------------------------

def notes_line(result: dict, json_path: Path) -> str:
    """One results-log line: date, commit, command, device, every row, peer ratios, the file."""
    parts = []
    for backend in dict.fromkeys(r["backend"] for r in result["rows"]):
        cells = [f"batch {r['batch']} {r['tok_s']:.1f} tok/s ({r['ms_per_step']:.3f} ms/step"
                 + ("" if r.get("sol_fraction") is None else f", {100 * r['sol_fraction']:.1f}% of SoL") + ")"
                 for r in result["rows"] if r["backend"] == backend]
        parts.append(f"{backend} " + ", ".join(cells))
    tok_s = {(r["backend"], r["batch"]): r["tok_s"] for r in result["rows"]}
    ratios = [f"batch {b} {tok_s[MEGAKERNEL, b] / tok_s[PEER, b]:.2f}x"
              for (backend, b) in tok_s if backend == MEGAKERNEL and (PEER, b) in tok_s]
    if ratios:
        parts.append("megakernel / hf-transformers " + ", ".join(ratios))
    if result.get("error"):
        parts.append(f"FAILED: {result['error']}")
    if result.get("copy_bandwidth_bytes_s"):
        parts.append(f"copy bandwidth {result['copy_bandwidth_bytes_s'] / 1e12:.2f} TB/s")
    contexts = ", ".join(str(c) for c in dict.fromkeys(r["context"] for r in result["rows"]))
    return (f"- {result['date']}, {result['commit']}, `{result['command']}`, {result['device']}"
            + (f", context {contexts}" if contexts else "") + ": " + "; ".join(parts) + f". `{json_path}`.")


def record(result: dict, json_path: Path, notes: Path) -> None:
    """Append the run's line at the end of the notes' results-log section."""
    text = notes.read_text()
    start = text.find(RESULTS_LOG)
    if start < 0:
        raise ValueError(f"{notes} has no '{RESULTS_LOG}' section")
    end = text.find("\n## ", start + len(RESULTS_LOG))
    end = len(text) if end < 0 else end + 1
    body = text[:end].rstrip("\n") + "\n" + notes_line(result, json_path) + "\n"
    notes.write_text(body + ("\n" + text[end:] if end < len(text) else ""))
    print(f"recorded the run in {notes}")


def with_sol_curve(result: dict) -> dict:
    """The result with its speed-of-light curve (files written before the curve lack it)."""
    bandwidth = datasheet_bandwidth(result.get("device", ""))
    if "sol_curve" in result or bandwidth is None:
        return result
    context = max(r["context"] for r in result["rows"])
    max_batch = max(MAX_BATCH, *(r["batch"] for r in result["rows"]))
    curve = sol_curve(geometry(result.get("geometry", "north")), context, bandwidth, max_batch)
    return {**result, "sol_curve": curve, "datasheet_bandwidth_bytes_s": bandwidth}


def plot(result: dict, path: Path) -> None:
    from .bench_plot import plot_decode

    plot_decode(with_sol_curve(result), path)
    print(f"plotted {path}")


def load_result(path: Path) -> dict:
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable result file ({exc})") from None
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list) or not result["rows"]:
        raise ValueError(f"{path}: a decode result needs a non-empty 'rows' list")
    return result


def profiled_step(args) -> tuple[np.ndarray, object, str]:
    """The task times named on the command line, the schedule the kernel built for that step
    (batch and context from the options or the file's name) and a line that says which."""
    times, schedule, which, _, _ = profiled_run(args)
    return times, schedule, which


def load_times(path: str) -> np.ndarray:
    """A profiled step's task times: a task-times .npy as a decode run writes it, or the same
    file xz-compressed (.npy.xz, as benchmarks/ keeps them: a step's times shrink about 8x)."""
    if str(path).endswith(".xz"):
        try:
            with lzma.open(path) as f:
                return np.load(f, allow_pickle=False)
        except lzma.LZMAError as e:
            raise ValueError(f"{path}: not an xz-compressed .npy ({e})") from None
    return np.load(path, allow_pickle=False)


def profiled_run(args) -> tuple[np.ndarray, object, str, ModelConfig, int]:
    """profiled_step's times, schedule and line, and the geometry and context of the step."""
    from .bench_critical import context_bucket
    from .megakernel import Schedule

    batch, context = args.batch, args.context
    named = re.fullmatch(r"task-times-b(\d+)-c(\d+)\.npy(\.xz)?", Path(args.times).name)
    if named:
        batch = batch or int(named[1])
        context = context or int(named[2])
    if not batch or not context:
        raise ValueError("give --batch and --context (the file's name does not say them)")
    if not 1 <= batch <= MAX_BATCH or context < 1 or args.sms < 1:
        raise ValueError(f"need 1 <= --batch <= {MAX_BATCH}, --context >= 1, --sms >= 1")
    config = geometry(args.geometry)
    schedule = Schedule(config, args.sms, [context_bucket(context)] * batch)
    return (load_times(args.times), schedule, f"{args.times}: batch {batch}, context {context}, {args.sms} SMs", config,
            context)


def critical(args) -> str:
    """The report of `critical`: the chain of the step (northmk.bench_critical)."""
    from .bench_critical import check_times, counter_hops, critical_path_of_run, hops_report, report

    times, schedule, which = profiled_step(args)
    return "\n".join([which, report(critical_path_of_run(times, schedule), args.layer),
                      hops_report(counter_hops(*check_times(times, schedule)))])


TASK_OPCODES = [o.name for o in Opcode if o not in (Opcode.COMBINE, Opcode.DRAIN)]


def opcode_setting(option: str, text: str, what: str) -> tuple[Opcode, str]:
    """An option's OP=VALUE (what: VALUE's name in the message): (the opcode, VALUE)."""
    name, sep, value = text.partition("=")
    if not sep or name.upper() not in TASK_OPCODES:
        raise ValueError(f"{option} {text!r}: want OP={what} with OP one of {', '.join(TASK_OPCODES)}")
    return Opcode[name.upper()], value


def opcode_list(option: str, text: str) -> list[Opcode]:
    """An option's OP,OP,...: the opcodes."""
    names = [n.strip().upper() for n in text.split(",")]
    bad = [n for n in names if n not in TASK_OPCODES]
    if bad:
        raise ValueError(f"{option} {text!r}: {bad[0] or 'an empty name'} is not one of {', '.join(TASK_OPCODES)}")
    return [Opcode[n] for n in names]


def what_if_change(text: str) -> tuple[Opcode, float, float]:
    """--what-if's OP=CHANGE: (opcode, factor, us added); CHANGE is +N / -N (us) or xF."""
    op, change = opcode_setting("--what-if", text, "CHANGE")
    try:
        if change[:1] in ("x", "*"):
            factor, add = float(change[1:]), 0.0
        else:
            factor, add = 1.0, float(change)
    except ValueError:
        raise ValueError(f"--what-if {text!r}: CHANGE is microseconds to add (-1.5) or a factor (x0.7)") from None
    if not (math.isfinite(factor) and math.isfinite(add)) or factor < 0:
        raise ValueError(f"--what-if {text!r}: want a finite change, and a factor >= 0")
    return op, factor, add


def tile_plan(schedule) -> dict:
    """The plan's tile sizes and counts: what a task's key (op, layer, x, y, z) means."""
    return {k: v for k, v in schedule.plan.items() if k not in ("batch", "max_splits", "num_counters", "num_queues")}


def saved_runs(path: str):
    """The run times `simulate --save-runs` wrote, on the schedule this library builds for their
    step: (schedule, keys, runs, the measured step's us, a line that says which)."""
    from .bench_critical import context_bucket
    from .megakernel import Schedule

    try:
        with np.load(path, allow_pickle=False) as f:
            keys, runs = f["keys"], f["runs"]
            batch, context, sms = int(f["batch"]), int(f["context"]), int(f["sms"])
            name, measured_us = str(f["geometry"]), float(f["measured_us"])
            tiles = json.loads(str(f["tiles"]))
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: not the run times of `simulate --save-runs` ({e})") from None
    if name not in PRESETS or keys.ndim != 2 or keys.shape[1] != 5 or len(keys) != len(runs):
        raise ValueError(f"{path}: not the run times of `simulate --save-runs`")
    schedule = Schedule(geometry(name), sms, [context_bucket(context)] * batch)
    changed = {k: (v, schedule.plan.get(k)) for k, v in tiles.items() if schedule.plan.get(k) != v}
    if changed:  # the same keys would name other tasks
        raise ValueError(f"{path}: this library tiles the step otherwise ("
                         + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
                         + "): the saved run times are of other tasks")
    return (schedule, keys, runs, measured_us,
            f"{path}: the run times of a step of batch {batch}, context {context}, {sms} SMs ({name}), "
            f"on this library's schedule for it")


def simulate(args) -> str:
    """The report of `simulate`: the step as measured, replayed with its gaps, and without; with
    --what-if, replayed again with those opcodes' run times changed (a task never below 0). From
    a task-times .npy, --save-runs writes its tasks' run times; given that file instead, the
    replay is of the schedule this library builds for the same step (another order or placement
    of the same tasks; a task the step did not have takes its opcode's mean run)."""
    from .bench_critical import check_times
    from .bench_simulate import measured_runs, runs_for, simulate as replay

    if args.hop_us < 0 or args.turn_us < 0:
        raise ValueError("--hop-us and --turn-us must be >= 0")
    changes = [what_if_change(c) for c in args.what_if]
    if args.times.endswith(".npz"):
        if args.save_runs:
            raise ValueError("--save-runs reads a task-times .npy, not run times it saved")
        schedule, keys, measured, measured_us, which = saved_runs(args.times)
    else:
        times, schedule, which, _, context = profiled_run(args)
        times = check_times(times, schedule)[0]
        keys, measured = measured_runs(schedule, times)
        measured_us = (times[:, 2].max() - times[:, 1].min()) / 1e3
        if args.save_runs:
            np.savez(args.save_runs, keys=keys, runs=measured, batch=schedule.plan["batch"], context=context,
                     sms=args.sms, geometry=args.geometry, measured_us=measured_us, tiles=json.dumps(tile_plan(schedule)))
    runs, guessed = runs_for(schedule, keys, measured)
    if guessed:
        which += f" ({guessed} tasks the step did not have take their opcode's mean run)"
    span = lambda t: (t[:, 2].max() - t[:, 1].min()) / 1e3  # noqa: E731
    hop, turn = round(args.hop_us * 1e3), round(args.turn_us * 1e3)
    gaps = replay(schedule, runs, hop, turn)
    none = replay(schedule, runs, 0, 0)
    report = (f"{which}\n  measured {measured_us:.1f} us; replayed from the measured run times "
              f"{span(gaps):.1f} us with {args.hop_us:g} us hops and {args.turn_us:g} us turns, "
              f"{span(none):.1f} us without gaps")
    if changes:
        changed = runs.astype(np.float64)
        for op, factor, add in changes:
            mine = schedule.tasks["op"] == op
            changed[mine] = np.maximum(changed[mine] * factor + add * 1e3, 0.0)
        step = span(replay(schedule, np.round(changed).astype(np.int64), hop, turn))
        if step <= 0:
            raise ValueError("--what-if leaves the step no time at all: nothing to compare")
        report += (f"\n  what if {', '.join(args.what_if)}: replayed {step:.1f} us, "
                   f"{100 * (span(gaps) / step - 1):+.1f}% tok/s against the replay with the measured run times")
    return report


def op_cap(text: str) -> tuple[Opcode, float]:
    """--op-gbs's OP=GBS: (opcode, its executor cap in GB/s)."""
    op, value = opcode_setting("--op-gbs", text, "GBS")
    try:
        gbs = float(value)
    except ValueError:
        raise ValueError(f"--op-gbs {text!r}: GBS is a rate in GB/s (60)") from None
    if not math.isfinite(gbs) or gbs <= 0:
        raise ValueError(f"--op-gbs {text!r}: want a finite rate > 0")
    return op, gbs


def ahead_label(args, ops) -> str:
    """The compared replay's streaming ahead of waits, as the fluid report names it ('' for none)."""
    if not args.ahead_kb:
        return ""
    return (f", {args.ahead_kb:g} KB ahead of a wait ({'/'.join(op.name for op in ops)}), "
            f"{args.ahead_saves_us:g} us less fixed part")


def fluid(args) -> str:
    """The report of `fluid`: the profiled step's schedule replayed with shared bandwidth, and with
    --executors N, --their-*, --what-if, --op-gbs or --ahead-kb a changed step replayed the same
    way (northmk.bench_fluid)."""
    from .bench_critical import check_times, context_bucket
    from .bench_fluid import fixed_parts, replay, schedule_bytes, step_us, used_slots
    from .bench_timeline import task_bytes
    from .megakernel import Schedule

    if args.executors < 1 or min(args.executor_gbs, args.sm_gbs, args.dram_tbs) <= 0:
        raise ValueError("--executors must be >= 1 and the rates > 0")
    if min(args.hop_us, args.turn_us, args.min_us, args.their_executor_gbs, args.their_fixed) < 0:
        raise ValueError("--hop-us, --turn-us, --min-us, --their-executor-gbs and --their-fixed must be >= 0")
    changes = [what_if_change(c) for c in args.what_if]
    caps = [op_cap(c) for c in args.op_gbs]
    ahead_ops = opcode_list("--ahead-ops", args.ahead_ops)
    if args.ahead_kb < 0 or args.ahead_saves_us < 0:
        raise ValueError("--ahead-kb and --ahead-saves-us must be >= 0")
    times, schedule, which, config, context = profiled_run(args)
    times = check_times(times, schedule)[0]
    nbytes = task_bytes(config, schedule, context, times, args.min_us)
    fixed = fixed_parts(schedule, times, nbytes, args.executor_gbs, args.fixed_quantile)
    used = used_slots(config, schedule, nbytes)
    rates = dict(sm_bpns=args.sm_gbs, dram_bpns=args.dram_tbs * 1e3, hop_ns=args.hop_us * 1e3,
                 turn_ns=args.turn_us * 1e3)

    def play(sched, executors: int, executor_gbs: float, factor: float = 1.0, changed: bool = False) -> float:
        ops = sched.tasks["op"]
        f = np.array([fixed.get(int(op), 0.0) * factor for op in ops])
        for op, times_x, add in changes if changed else []:
            f[ops == op] = np.maximum(f[ops == op] * times_x + add * 1e3, 0.0)
        n = schedule_bytes(config, sched, context, used)
        cap = np.full(len(ops), executor_gbs)
        for op, rate in caps if changed else []:
            cap[ops == op] = rate
        ahead = dict(ahead=np.isin(ops, ahead_ops), ahead_bytes=args.ahead_kb * 1024.0,
                     ahead_saves_ns=args.ahead_saves_us * 1e3) if changed else {}
        return step_us(replay(sched, f, n, args.sms, executors, cap, **rates, **ahead))

    own = play(schedule, 1, args.executor_gbs)
    lines = [which,
             "  fixed parts (us): " + ", ".join(f"{Opcode(op).name} {ns / 1e3:.2f}" for op, ns in sorted(fixed.items())),
             f"  measured {step_us(times):.1f} us; its schedule replayed with shared bandwidth {own:.1f} us "
             f"({100 * (own / step_us(times) - 1):+.1f}%)"]
    if args.executors > 1 or args.their_fixed != 1.0 or args.their_executor_gbs or changes or caps or args.ahead_kb:
        n_exec, gbs = args.executors, args.their_executor_gbs or args.executor_gbs
        other = schedule if n_exec == 1 else \
            Schedule(config, args.sms * n_exec, [context_bucket(context)] * schedule.plan["batch"])
        theirs = play(other, n_exec, gbs, args.their_fixed, True)
        lines.append(f"  {n_exec} executor{'s' if n_exec > 1 else ''} per SM (a schedule for {args.sms * n_exec} "
                     f"lists, each streaming at most {gbs:g} GB/s, fixed parts x{args.their_fixed:g}"
                     f"{''.join(', ' + c for c in args.what_if)}"
                     f"{''.join(f', {op.name} at {rate:g} GB/s' for op, rate in caps)}"
                     f"{ahead_label(args, ahead_ops)}): {theirs:.1f} us, "
                     f"{100 * (own / theirs - 1):+.1f}% tok/s against the replay of one")
    return "\n".join(lines)


def timeline(args) -> str:
    """The report of `timeline` (northmk.bench_timeline)."""
    from .bench_critical import check_times
    from .bench_timeline import report as timeline_report

    times, schedule, which, config, context = profiled_run(args)
    if args.bin_us <= 0 or args.min_us < 0:
        raise ValueError("--bin-us must be > 0 and --min-us >= 0")
    times = check_times(times, schedule)[0]
    return which + "\n" + timeline_report(config, schedule, context, times, args.bin_us, args.layer, args.min_us)


def switches(args) -> str:
    """The report of `switches` (northmk.bench_critical.opcode_switches)."""
    from .bench_critical import opcode_switches, switches_report

    if args.min_us < 0:
        raise ValueError("--min-us must be >= 0")
    return f"{args.times}\n" + switches_report(opcode_switches(load_times(args.times), args.min_us))


def layer_range(text: str | None) -> tuple[int, int] | None:
    """--layers FIRST:LAST as a pair, or None."""
    if not text:
        return None
    try:
        first, last = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--layers {text!r}: want FIRST:LAST (2:46)") from None
    return first, last


def ops(args) -> str:
    """The report of `ops` (northmk.bench_critical.opcode_means of each file)."""
    from .bench_critical import means_report, opcode_means

    layers = layer_range(args.layers)
    return means_report([(path, opcode_means(load_times(path), layers)) for path in args.times])


def phases(args) -> str:
    """The report of `phases` (northmk.bench_critical.opcode_phases)."""
    from .bench_critical import opcode_phases, phases_report

    return f"{args.times}\n" + phases_report(opcode_phases(load_times(args.times), layer_range(args.layers)))


# ---- command line -----------------------------------------------------------------------

class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def step_parser(sub, name: str, what: str,
                times_help: str = "task-times-b{B}-c{C}.npy from a decode run (or .npy.xz: the same, xz-compressed)") -> argparse.ArgumentParser:
    """A command that reads one profiled step's task times (profiled_step)."""
    parser = sub.add_parser(name, help=what)
    parser.add_argument("times", help=times_help)
    parser.add_argument("--batch", type=int, help="rows of the step (default: from the file name)")
    parser.add_argument("--context", type=int, help="tokens of KV per row (default: from the file name)")
    parser.add_argument("--sms", type=int, default=132, help="SMs of the device that ran it")
    parser.add_argument("--geometry", choices=sorted(PRESETS), default="north")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m northmk.bench")
    sub = parser.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decode", help="decode step: megakernel and the transformers peer")
    d.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8])
    d.add_argument("--context", type=int, default=8192, help="tokens of KV each row attends to")
    d.add_argument("--steps", type=int, default=256, help="timed steps per row")
    d.add_argument("--warmup", type=int, default=8, help="untimed steps before them (the peer's compile)")
    d.add_argument("--wait-each-step", action="store_true",
                   help="read each step's tokens before the next step is enqueued (the engine's --no-decode-ahead); "
                        "by default step t + 1 is enqueued first, as the engine runs")
    peer = d.add_mutually_exclusive_group()
    peer.add_argument("--no-peer", action="store_true", help="skip the transformers peer")
    peer.add_argument("--peer-only", action="store_true", help="only the transformers peer (any device)")
    d.add_argument("--geometry", choices=sorted(PRESETS), default="north")
    d.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    d.add_argument("--out", default="benchmarks", help="folder of the result file")
    d.add_argument("--record", nargs="?", const="benchmarks/NOTES.md", help="append the run to this results log")
    d.add_argument("--plot", help="write the tok/s plot here (PNG)")
    r = sub.add_parser("record", help="append a result file's line to the results log")
    r.add_argument("result")
    r.add_argument("--notes", default="benchmarks/NOTES.md")
    p = sub.add_parser("plot", help="plot result files (their rows on one plot)")
    p.add_argument("result", nargs="+")
    p.add_argument("--out", help="PNG path (default: the first result's path with .png)")
    c = step_parser(sub, "critical", "the chain of tasks that set a profiled step's length")
    c.add_argument("--layer", type=int, help="the layer whose links to list (default: the chain's middle one)")
    m = step_parser(sub, "simulate", "replay a profiled step's schedule from its tasks' run times",
                    "task-times-b{B}-c{C}.npy from a decode run, or a FILE.npz of --save-runs (its step's "
                    "batch, context, SMs and geometry then come from it)")
    m.add_argument("--save-runs", metavar="FILE.npz",
                   help="write the step's tasks' run times; given as TIMES to a build of the library with "
                        "another schedule, they replay that schedule")
    m.add_argument("--hop-us", type=float, default=0.5, help="a counter complete -> its waiter running")
    m.add_argument("--turn-us", type=float, default=0.7, help="an SM's task ended -> its next running")
    m.add_argument("--what-if", action="append", default=[], metavar="OP=CHANGE",
                   help="replay again with every OP task's run time changed: -1.5 (us) or x0.7 (a factor); "
                        "repeat for several opcodes")
    f = step_parser(sub, "fluid", "replay a profiled step's schedule with its tasks sharing DRAM bandwidth")
    f.add_argument("--executors", type=int, default=1, help="executors per SM of the schedule to compare")
    f.add_argument("--executor-gbs", type=float, default=45.0,
                   help="the profiled step's executor's streaming cap, GB/s (its fixed parts are its run less that)")
    f.add_argument("--their-executor-gbs", type=float, default=0.0,
                   help="an executor's cap in the compared replay (default: --executor-gbs)")
    f.add_argument("--their-fixed", type=float, default=1.0,
                   help="the fixed parts in the compared replay, as a factor of the profiled step's")
    f.add_argument("--sm-gbs", type=float, default=45.0, help="an SM's executors' streaming cap together, GB/s")
    f.add_argument("--dram-tbs", type=float, default=4.24, help="DRAM's cap, TB/s (the device's copy bandwidth)")
    f.add_argument("--hop-us", type=float, default=0.5, help="a counter complete -> its waiter running")
    f.add_argument("--turn-us", type=float, default=0.7, help="an executor's task ended -> its next running")
    f.add_argument("--fixed-quantile", type=float, default=0.1,
                   help="an opcode's fixed part: this quantile of its tasks' run less bytes at the executor cap")
    f.add_argument("--min-us", type=float, default=1.5,
                   help="routed expert tasks that ran shorter read nothing (an unused slot's)")
    f.add_argument("--what-if", action="append", default=[], metavar="OP=CHANGE",
                   help="in the compared replay, every OP task's fixed part changed: -0.5 (us) or x0.5 (a factor)")
    f.add_argument("--ahead-kb", type=float, default=0.0,
                   help="in the compared replay, an executor whose task waits streams up to this many KB of "
                        "it meanwhile (a producer filling a ring that deep), if its opcode is in --ahead-ops")
    f.add_argument("--ahead-ops", default="QKV,ROUTER,OPROJ,DOWN,LM_HEAD", metavar="OP,OP",
                   help="the opcodes whose weights do not depend on what they wait for")
    f.add_argument("--ahead-saves-us", type=float, default=0.0,
                   help="a task that streamed ahead has this much less fixed part (its first round trip)")
    f.add_argument("--op-gbs", action="append", default=[], metavar="OP=GBS",
                   help="in the compared replay, an OP task's executor streams at most GBS GB/s (the SM's "
                        "cap still holds); repeat for several opcodes")
    t = step_parser(sub, "timeline", "the bandwidth a profiled step asked of DRAM over time, and who ran")
    t.add_argument("--bin-us", type=float, default=5.0, help="width of a bin of time")
    t.add_argument("--layer", type=int, help="the layer whose bins to list (default: the middle one)")
    t.add_argument("--min-us", type=float, default=1.5,
                   help="routed expert tasks that ran shorter read nothing (an unused slot's)")
    w = sub.add_parser("switches", help="per opcode, a task's run after its own opcode and after another")
    w.add_argument("times", help="task-times-b{B}-c{C}.npy from a decode run (or .npy.xz: the same, xz-compressed)")
    w.add_argument("--min-us", type=float, default=0.0,
                   help="leave out of the means tasks that ran shorter (an unused expert slot's)")
    o = sub.add_parser("ops", help="per opcode, the mean run and wait of a task and the SM time a layer, for one "
                                   "or more profiled steps")
    o.add_argument("times", nargs="+", help="task-times-b{B}-c{C}.npy from decode runs (an A/B's variants; .npy.xz too)")
    o.add_argument("--layers", metavar="FIRST:LAST",
                   help="the layers whose tasks to average (default: all but the first two and the last two)")
    h = sub.add_parser("phases", help="per layer and opcode, when its tasks started, over how long, their median "
                                      "run and the phase's end")
    h.add_argument("times", help="task-times-b{B}-c{C}.npy from a decode run (or .npy.xz: the same, xz-compressed)")
    h.add_argument("--layers", metavar="FIRST:LAST", help="the layers to list (default: all)")
    args = parser.parse_args(argv)
    problem = check_decode(args) if args.what == "decode" else None
    if problem:
        sub.choices[args.what].error(problem)
    args.command = "python -m northmk.bench " + shlex.join(argv)
    return args


def check_decode(args) -> str | None:
    """Why these decode arguments cannot run (before any device work), or None."""
    if any(b < 1 for b in args.batch):
        return f"--batch sizes must be >= 1, got {args.batch}"
    if not args.peer_only and max(args.batch) > MAX_BATCH:
        return f"the megakernel runs batch 1..{MAX_BATCH}, got {args.batch} (use --peer-only for larger)"
    if args.context < 1 or args.steps < 1 or args.warmup < 0:
        return f"need --context >= 1, --steps >= 1, --warmup >= 0; got {args.context}, {args.steps}, {args.warmup}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device here; use --device cpu --peer-only (with a small --geometry)"
    if args.device == "cpu" and not args.peer_only:
        return "the megakernel needs a CUDA GPU; on --device cpu pass --peer-only"
    if not args.no_peer and importlib.util.find_spec("transformers") is None:
        return "the transformers peer needs transformers (pip install 'northmk[bench]'); or pass --no-peer"
    if args.record and not Path(args.record).is_file():
        return f"--record: no results log at {args.record}"
    if args.record and RESULTS_LOG not in Path(args.record).read_text():
        return f"--record: {args.record} has no '{RESULTS_LOG}' section"
    if args.plot:
        from .bench_plot import plotting_available

        if not plotting_available():
            return "--plot needs matplotlib (pip install 'northmk[bench]'), or plot the result file later"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.what == "decode":
        return 1 if decode(args).get("error") else 0
    try:
        if args.what == "critical":
            print(critical(args))
        elif args.what == "simulate":
            print(simulate(args))
        elif args.what == "fluid":
            print(fluid(args))
        elif args.what == "timeline":
            print(timeline(args))
        elif args.what == "switches":
            print(switches(args))
        elif args.what == "ops":
            print(ops(args))
        elif args.what == "phases":
            print(phases(args))
        elif args.what == "record":
            record(load_result(Path(args.result)), Path(args.result), Path(args.notes))
        else:
            results = [load_result(Path(r)) for r in args.result]
            rows = [{**row, "commit": r.get("commit", "?")} for r in results for row in r["rows"]]
            result = {**results[0], "rows": rows}
            plot(result, Path(args.out) if args.out else Path(args.result[0]).with_suffix(".png"))
    except (ValueError, OSError, ImportError) as exc:
        print(f"python -m northmk.bench {args.what}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
