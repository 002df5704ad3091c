"""The DRAM bytes a profiled decode step's tasks stream over time: `python -m northmk.bench timeline`.

Each task reads its weights' rows (and an attention split its pages of keys and values, as the
kernel cuts them at the bench's positions: every row at context - 1); spread evenly over the
task's run, those bytes give the bandwidth the step asked of DRAM in each bin of time, and the
runs give how many SMs ran each opcode there. Bins well under the device's copy bandwidth
(about 4.2 TB/s on the H200) are time the step spent on something other than streaming.
A routed expert slot that no row picked returns at once: tasks that ran under `min_run_us`
count as reading nothing (the task times do not say which slots were used).
"""

from __future__ import annotations

import numpy as np

from .config import DENSE, PAGE_SIZE, ModelConfig
from .megakernel import Opcode
from .megakernel_interpreter import split_keys

BF16 = 2
BANDS_TBPS = (0.0, 1.0, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, float("inf"))
SHOWN = (Opcode.QKV, Opcode.ATTN, Opcode.OPROJ, Opcode.GATE_UP, Opcode.DOWN)


def split_pages(config: ModelConfig, layer: int, position: int, split: int, splits: int) -> int:
    """Pages one attention split reads for a row at `position` (the interpreter's split_keys)."""
    key0, key1 = split_keys(config, layer, position, split, splits)
    return (key1 - 1) // PAGE_SIZE - key0 // PAGE_SIZE + 1 if key1 > key0 else 0


def task_bytes(config: ModelConfig, schedule, context: int, times: np.ndarray, min_run_us: float = 1.5
               ) -> np.ndarray:
    """Bytes each task of the times read from DRAM (its rows of weights, its pages of KV); the
    times' rows are the schedule's tasks less its DRAIN entries, as the bench saves them."""
    tasks = schedule.tasks[schedule.tasks["op"] != Opcode.DRAIN]
    if len(tasks) != len(times):
        raise ValueError(f"the times have {len(times)} tasks, the schedule {len(tasks)}: another batch, context "
                         "or SM count?")
    plan, c = schedule.plan, config
    H, Q, KV, E = c.hidden_size, c.q_size, c.kv_size, c.num_experts
    I, D, V = c.moe_intermediate_size, c.dense_intermediate_size, c.vocab_size
    run_us = (np.asarray(times[:, 2], dtype=np.int64) - np.asarray(times[:, 1], dtype=np.int64)) / 1e3
    out = np.zeros(len(tasks), dtype=np.int64)

    def tile(size: int, rows: int, x: int) -> int:
        return max(0, min(rows, size - x * rows))

    for i, t in enumerate(tasks):
        op, layer, x, y, z = Opcode(int(t["op"])), int(t["layer"]), int(t["x"]), int(t["y"]), int(t["z"])
        dense = op in (Opcode.GATE_UP, Opcode.DOWN) and c.mlp_types[layer] == DENSE
        if op == Opcode.QKV:
            n = tile(Q + 2 * KV, plan["qkv_rows"], x) * H
        elif op == Opcode.ROUTER:
            n = tile(E, plan["router_rows"], x) * H
        elif op == Opcode.OPROJ:
            n = tile(H, plan["oproj_rows"], x) * Q
        elif op == Opcode.GATE_UP:
            n = 2 * (tile(D, plan["dense_cols"], x) if dense else tile(I, plan["moe_cols"], x)) * H
        elif op == Opcode.DOWN:
            n = tile(H, plan["dense_down_rows"], x) * D if dense else tile(H, plan["moe_down_rows"], x) * I
        elif op == Opcode.LM_HEAD:
            n = tile(V, plan["lm_rows"], x) * H
        elif op == Opcode.ATTN:
            n = split_pages(c, layer, context - 1, z & 0xFF, z >> 8) * 2 * PAGE_SIZE * c.head_dim
        else:  # NORM, ARGMAX (and FINAL_NORM in steps before v0.5): a few KB of activations
            n = 0
        if op in (Opcode.GATE_UP, Opcode.DOWN) and not dense and run_us[i] < min_run_us:
            n = 0
        out[i] = n * BF16
    return out


def bandwidth(times: np.ndarray, nbytes: np.ndarray, bin_us: float) -> tuple[np.ndarray, np.ndarray]:
    """Bin starts (us from the step's first task) and TB/s per bin: each task's bytes spread
    evenly over its run."""
    if bin_us <= 0:
        raise ValueError("the bin must be longer than 0 us")
    t0 = int(times[:, 0].min())
    start, end = (times[:, 1] - t0) / 1e3, (times[:, 2] - t0) / 1e3
    edges = np.arange(0.0, end.max() + bin_us, bin_us)
    per_bin = np.zeros(len(edges))
    for s, e, n in zip(start, end, nbytes):
        if n <= 0 or e <= s:
            continue
        first, last = int(s // bin_us), int(e // bin_us)
        for k in range(first, min(last, len(edges) - 1) + 1):
            overlap = min(e, edges[k] + bin_us) - max(s, edges[k])
            if overlap > 0:
                per_bin[k] += n * overlap / (e - s)
    return edges, per_bin / (bin_us * 1e-6) / 1e12


def busy_sms(times: np.ndarray, op: int, lo_us: float, hi_us: float, t0: int) -> float:
    """SMs running opcode op over [lo_us, hi_us) of the step (fractions for partial overlap)."""
    mine = (times[:, 3] & 0xFF) == op
    s, e = (times[mine, 1] - t0) / 1e3, (times[mine, 2] - t0) / 1e3
    return float(np.clip(np.minimum(e, hi_us) - np.maximum(s, lo_us), 0, None).sum() / (hi_us - lo_us))


def report(config: ModelConfig, schedule, context: int, times: np.ndarray, bin_us: float = 5.0,
           layer: int | None = None, min_run_us: float = 1.5) -> str:
    """The step's time in bands of bandwidth, then one layer's bins: TB/s and SMs per opcode."""
    times = np.asarray(times, dtype=np.int64)
    nbytes = task_bytes(config, schedule, context, times, min_run_us)
    edges, tbps = bandwidth(times, nbytes, bin_us)
    t0 = int(times[:, 0].min())
    span_us = (times[:, 2].max() - t0) / 1e3
    out = [f"{nbytes.sum() / 1e9:.2f} GB streamed in {span_us:.1f} us: {nbytes.sum() / span_us / 1e6:.2f} TB/s "
           f"on average; time per band of bandwidth ({bin_us:g} us bins):"]
    for lo, hi in zip(BANDS_TBPS, BANDS_TBPS[1:]):
        n = int(((tbps >= lo) & (tbps < hi)).sum())
        out.append(f"  {lo:3.1f}-{hi:3.1f} TB/s {n * bin_us:8.0f} us ({n / len(tbps):5.1%})")
    ops, layers = times[:, 3] & 0xFF, (times[:, 3] >> 8) & 0xFF
    qkv_layers = sorted(set(layers[ops == Opcode.QKV].tolist()))
    if len(qkv_layers) < 2:
        return "\n".join(out)
    pick = qkv_layers[len(qkv_layers) // 2 - 1] if layer is None else layer
    if pick not in qkv_layers or pick + 1 not in qkv_layers:
        raise ValueError(f"--layer must be one of {qkv_layers[0]}..{qkv_layers[-2]}, got {pick}")
    begin = (times[(ops == Opcode.QKV) & (layers == pick), 1].min() - t0) / 1e3
    finish = (times[(ops == Opcode.QKV) & (layers == pick + 1), 1].min() - t0) / 1e3
    num_sms = schedule.num_sms
    out.append(f"layer {pick}: {finish - begin:.1f} us; per bin from its first QKV tile's start: TB/s, then SMs "
               "running " + ", ".join(o.name for o in SHOWN) + ", idle")
    for k in range(int(begin // bin_us), min(int(finish // bin_us) + 1, len(edges))):
        lo = edges[k]
        counts = [busy_sms(times, int(o), lo, lo + bin_us, t0) for o in SHOWN]
        idle = num_sms - sum(busy_sms(times, int(o), lo, lo + bin_us, t0) for o in np.unique(ops))
        out.append(f"  {lo - begin:6.0f} {tbps[k]:5.2f}  " + " ".join(f"{n:5.0f}" for n in counts) + f"  {idle:5.0f}")
    return "\n".join(out)
