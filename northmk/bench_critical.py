"""The critical path of one profiled decode step: `python -m northmk.bench critical`.

The decode bench saves, per batch, the task times of one step (task-times-b{B}-c{C}.npy: for
each task of the step's schedule, less its DRAIN entries, the ns when its SM began waiting
for it, when it ran and when it ended, and op | layer << 8 | sm << 16). With the schedule that
step ran (rebuilt here from the geometry, the SM count and the rows' lengths), each task has
two constraints on when it ran: when its counters reached their target (each counter's
target-th end among its signallers; a reader of a layer's input waits on the counters of all of
its column blocks, its wait span, and the latest of those ends holds it) and when its SM ended
the task before it. Walking back from the step's last task through whichever of the two came
later gives the chain that set the step's length, as links of three kinds:

    run    a task running (its start to its end stamp, which follows its signal)
    hop    its counters complete -> the waiting task running (the poll, the barrier after it)
    turn   its SM's previous task ended -> this one running (claim, descriptor, barriers)

Per counter (per wait span of counters), the hop from its last signaller's end to its first
waiter's start (counter_hops, in the same report): how long a completed stage takes to start
the stages that wait for it, by the opcodes on either side (the layer's boundary: DOWN and
OPROJ -> QKV and ROUTER, through NORM in steps before v0.5; the routing: ROUTER -> GATE_UP).

The same times also say what a change of opcode costs a task (opcode_switches, `python -m
northmk.bench switches`): its run after a task of its own opcode on its SM against after another.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from .megakernel import Opcode

HOP, TURN, START = "hop", "turn", "start"


@dataclass
class Link:
    task: int  # row of the times (the schedule's task array less its DRAIN entries)
    op: str
    layer: int
    run_ns: int  # its start to its end
    how: str  # what it waited for last: HOP (its counter), TURN (its SM), START (nothing)
    gap_ns: int  # from that constraint's time to its start
    after: int | None  # the task it waited for (its counters' completing signaller, or the SM's previous)


def previous_on_sm(began: np.ndarray, sm: np.ndarray) -> np.ndarray:
    """For each task, the row of the task its SM ran before it (by when each began waiting),
    -1 for an SM's first."""
    previous = np.full(len(began), -1, dtype=np.int64)
    for s in np.unique(sm):
        mine = np.flatnonzero(sm == s)
        order = mine[np.argsort(began[mine], kind="stable")]
        previous[order[1:]] = order[:-1]
    return previous


def counter_times(times: np.ndarray, wait: np.ndarray, target: np.ndarray, signal: np.ndarray,
                  span: np.ndarray) -> np.ndarray:
    """times as int64 once they are [N, 4] with N of each counter field; else ValueError."""
    times = np.asarray(times, dtype=np.int64)
    if (not (len(wait) == len(target) == len(signal) == len(span) == len(times)) or times.ndim != 2
            or times.shape[1] != 4):
        raise ValueError(f"times must be [N, 4] with N counter fields each; got {times.shape}, {len(wait)}")
    return times


def completers(times: np.ndarray, wait: np.ndarray, target: np.ndarray, signal: np.ndarray,
               span: np.ndarray) -> np.ndarray:
    """Per task, the signaller whose end brought the last of its counters (wait .. wait + span
    - 1) to its target: of each counter's target-th signal by end stamp, the one that ended
    last (-1 where it waits for nothing). ValueError when a counter has fewer signals than a
    task waits for."""
    end = np.asarray(times, dtype=np.int64)[:, 2]
    by_end = {int(c): np.flatnonzero(signal == c)[np.argsort(end[signal == c], kind="stable")]
              for c in np.unique(signal[signal >= 0])}
    out = np.full(len(wait), -1, dtype=np.int64)
    for i in np.flatnonzero((wait >= 0) & (target > 0)):
        for c in range(int(wait[i]), int(wait[i] + span[i])):
            ts = by_end.get(c, np.empty(0, dtype=np.int64))
            if len(ts) < target[i]:
                raise ValueError(f"task {i} waits for {target[i]} signals of counter {c}, the step has {len(ts)}")
            j = ts[int(target[i]) - 1]
            if out[i] < 0 or end[j] > end[out[i]]:
                out[i] = j
    return out


def critical_path(times: np.ndarray, wait: np.ndarray, target: np.ndarray, signal: np.ndarray,
                  span: np.ndarray) -> list[Link]:
    """The chain that ended last, first link first. times [N, 4] as the bench saves them; wait,
    target, signal [N] the tasks' counter fields (wait -1: none; signal -1: none), span [N] how
    many counters from wait each waits on (megakernel.wait_spans: 0 where wait is -1)."""
    times = counter_times(times, wait, target, signal, span)
    n = len(times)
    if n == 0:
        return []
    began, start, end = times[:, 0], times[:, 1], times[:, 2]
    op, layer, sm = times[:, 3] & 0xFF, (times[:, 3] >> 8) & 0xFF, (times[:, 3] >> 16) & 0xFFFF
    deps = [int(j) if j >= 0 else None for j in completers(times, wait, target, signal, span)]
    previous = [int(j) if j >= 0 else None for j in previous_on_sm(began, sm)]

    chain = []
    i: int | None = int(np.argmax(end))
    while i is not None:
        dep, prev = deps[i], previous[i]
        if dep is not None and (prev is None or end[dep] >= end[prev]):
            how, after, since = HOP, dep, end[dep]
        elif prev is not None:
            how, after, since = TURN, prev, end[prev]
        else:
            how, after, since = START, None, start[i]
        chain.append(Link(i, Opcode(int(op[i])).name, int(layer[i]), int(end[i] - start[i]), how,
                          int(start[i] - since), after))
        i = after
    return chain[::-1]


def summarize(chain: list[Link]) -> dict:
    """Totals of a chain (us): its length, run time per opcode, and per kind of gap the count,
    total and mean."""
    if not chain:
        return {"length_us": 0.0, "runs_us": {}, "gaps": {}}
    runs: dict[str, float] = defaultdict(float)
    gaps: dict[str, list[float]] = defaultdict(list)
    for link in chain:
        runs[link.op] += link.run_ns / 1e3
        if link.how != START:
            gaps[link.how].append(link.gap_ns / 1e3)
    length = sum(runs.values()) + sum(sum(g) for g in gaps.values())
    return {"length_us": length,
            "runs_us": dict(sorted(runs.items(), key=lambda kv: -kv[1])),
            "gaps": {how: {"count": len(g), "total_us": sum(g), "mean_us": sum(g) / len(g)} for how, g in gaps.items()}}


def report(chain: list[Link], layer: int | None = None) -> str:
    """The summary as text, then the links of one layer (by default the middle one of the chain)."""
    s = summarize(chain)
    out = [f"critical path: {s['length_us']:.1f} us, {len(chain)} tasks"]
    runs = sum(s["runs_us"].values())
    out.append(f"  runs {runs:.1f} us ({runs / max(s['length_us'], 1e-9):.0%}): " +
               ", ".join(f"{op} {us:.1f}" for op, us in s["runs_us"].items()))
    for how, g in s["gaps"].items():
        out.append(f"  {how}s {g['total_us']:.1f} us ({g['total_us'] / max(s['length_us'], 1e-9):.0%}) in "
                   f"{g['count']}, mean {g['mean_us']:.2f} us")
    layers = sorted({link.layer for link in chain if link.op not in ("FINAL_NORM", "LM_HEAD", "ARGMAX")})
    if layers:
        pick = layers[len(layers) // 2] if layer is None else layer
        out.append(f"  layer {pick}'s links (op, what it waited for, gap us, run us):")
        out += [f"    {link.op:>10} {link.how:>5} {link.gap_ns / 1e3:7.2f} {link.run_ns / 1e3:8.2f}"
                for link in chain if link.layer == pick and link.op not in ("FINAL_NORM", "LM_HEAD", "ARGMAX")]
    return "\n".join(out)


def counter_hops(times: np.ndarray, wait: np.ndarray, target: np.ndarray, signal: np.ndarray,
                 span: np.ndarray) -> dict[str, dict]:
    """Per (signalling opcodes -> waiting opcode), over the counters between them (a wait span
    of several counters as one): the hop from the end that brought the last of them to its
    waiters' target to the first waiter's start, us (count, median, mean). A task's end stamp
    follows its signal, so a hop may be slightly negative. Arguments as critical_path's."""
    times = counter_times(times, wait, target, signal, span)
    start, op = times[:, 1], times[:, 3] & 0xFF
    done = counter_done(times, wait, target, signal, span)
    sources: dict[int, set[str]] = defaultdict(set)
    for i in np.flatnonzero(signal >= 0):
        sources[int(signal[i])].add(Opcode(int(op[i])).name)
    first: dict[tuple[int, int, int], int] = {}  # (first counter, span, target) -> its earliest waiter
    for i in np.flatnonzero(done >= 0):
        key = (int(wait[i]), int(span[i]), int(target[i]))
        if key not in first or start[i] < start[first[key]]:
            first[key] = int(i)
    hops: dict[str, list[float]] = defaultdict(list)
    for (c, n, _), i in first.items():
        ops = set().union(*(sources[k] for k in range(c, c + n)))
        hops[f"{'+'.join(sorted(ops))} -> {Opcode(int(op[i])).name}"].append((start[i] - done[i]) / 1e3)
    return {pair: {"count": len(h), "median_us": float(np.median(h)), "mean_us": float(np.mean(h))}
            for pair, h in sorted(hops.items(), key=lambda kv: -len(kv[1]))}


def hops_report(hops: dict[str, dict]) -> str:
    """counter_hops as lines: the pair, how many counters, the median and mean hop."""
    out = ["counter hops (last signaller's end -> first waiter's start, us: counters, median, mean):"]
    out += [f"  {pair:>28} {h['count']:5d} {h['median_us']:7.2f} {h['mean_us']:7.2f}" for pair, h in hops.items()]
    return "\n".join(out)


def context_bucket(length: int) -> int:
    """The key length the kernel builds a step's schedule for (cuda/mk/megakernel.cu's
    context_bucket): the longest row's length rounded up to a power of two, at least 64."""
    bucket = 64
    while bucket < length:
        bucket *= 2
    return bucket


def schedule_fields(schedule) -> tuple[np.ndarray, ...]:
    """op, layer, wait, target, signal and wait span (Schedule.wait_spans) of a Schedule's
    tasks less the DRAIN entries: the rows of the bench's task times."""
    work = schedule.tasks["op"] != Opcode.DRAIN
    tasks = schedule.tasks[work]
    return (tasks["op"].astype(np.int64), tasks["layer"].astype(np.int64), tasks["wait"].astype(np.int64),
            tasks["target"].astype(np.int64), tasks["signal"].astype(np.int64),
            schedule.wait_spans()[work].astype(np.int64))


def counter_done(times: np.ndarray, wait: np.ndarray, target: np.ndarray, signal: np.ndarray,
                 span: np.ndarray) -> np.ndarray:
    """Per task, the end stamp of the signal that brought the last of its counters to its
    target (ns; -1 where it waits for nothing); completers' errors."""
    by = completers(times, wait, target, signal, span)
    return np.where(by >= 0, np.asarray(times, dtype=np.int64)[:, 2][by], -1)


def check_times(times: np.ndarray, schedule) -> tuple[np.ndarray, ...]:
    """A step's task times as int64 and its Schedule's wait, target, signal and wait span
    fields (critical_path's arguments); ValueError when they do not belong together (another
    batch, context or SM count). A task that waits inside its run (Schedule.waits_in_run) gets
    the start of its run moved to its counters' completion (counter_done: the last of them) when
    that came later: its wait is then the wait, and its run what followed."""
    op, layer, wait, target, signal, span = schedule_fields(schedule)
    times = np.asarray(times, dtype=np.int64)
    if times.ndim != 2 or len(times) != len(op):
        raise ValueError(f"the times have {len(times)} tasks, the schedule {len(op)}: another batch, context or SM count?")
    if not ((times[:, 3] & 0xFF) == op).all() or not (((times[:, 3] >> 8) & 0xFF) == layer).all():
        raise ValueError("the times' opcodes and layers differ from the schedule's: another batch, context or SM count?")
    inside = schedule.waits_in_run()[schedule.tasks["op"] != Opcode.DRAIN] & (target > 0)
    if inside.any():
        times = times.copy()
        times[inside, 1] = np.maximum(times[inside, 1], counter_done(times, wait, target, signal, span)[inside])
    return times, wait, target, signal, span


def critical_path_of_run(times: np.ndarray, schedule) -> list[Link]:
    """critical_path of a step's task times and the Schedule it ran (check_times first)."""
    return critical_path(*check_times(times, schedule))


def opcode_switches(times: np.ndarray, min_run_us: float = 0.0) -> dict[str, dict]:
    """Per opcode, its tasks' mean run (us) after a task of the same opcode on their SM
    ("same") and after another opcode or as the SM's first task ("switch"), with their counts:
    what changing opcode costs a task (its code cold in the instruction cache, its input staged
    again, the layer's routing computed). Tasks that ran under min_run_us (an unused expert
    slot's returns at once) are left out of the means but still count as an SM's previous task."""
    times = np.asarray(times, dtype=np.int64)
    if times.ndim != 2 or times.shape[1] != 4:
        raise ValueError(f"times must be [N, 4]; got {times.shape}")
    began, start, end = times[:, 0], times[:, 1], times[:, 2]
    op, sm = times[:, 3] & 0xFF, (times[:, 3] >> 16) & 0xFFFF
    run_us = (end - start) / 1e3
    previous = previous_on_sm(began, sm)
    after_same = (previous >= 0) & (op[np.maximum(previous, 0)] == op)
    out = {}
    for code in sorted(np.unique(op)):
        kept = (op == code) & (run_us >= min_run_us)
        row = {}
        for name, which in (("same", kept & after_same), ("switch", kept & ~after_same)):
            row[name] = {"count": int(which.sum()), "mean_us": float(run_us[which].mean()) if which.any() else None}
        out[Opcode(int(code)).name] = row
    return out


def switches_report(switches: dict[str, dict]) -> str:
    """opcode_switches as a table: per opcode the two means, their counts and the difference."""
    fmt = lambda r: "        -" if r["mean_us"] is None else f"{r['mean_us']:9.2f}"  # noqa: E731
    out = ["run us of an opcode's tasks after its own opcode on their SM / after another (tasks):"]
    for name, row in switches.items():
        same, switch = row["same"], row["switch"]
        cost = (f"{switch['mean_us'] - same['mean_us']:+8.2f}" if same["mean_us"] is not None
                and switch["mean_us"] is not None else "")
        out.append(f"  {name:>10} {fmt(same)} ({same['count']:5d}) {fmt(switch)} ({switch['count']:5d}) {cost}".rstrip())
    return "\n".join(out)


# The opcodes a layer's tasks have, in a layer's order (opcode_means' columns).
LAYER_OPS = ("NORM", "QKV", "ROUTER", "ATTN", "OPROJ", "GATE_UP", "DOWN")


def step_layers(times: np.ndarray, layers: tuple[int, int] | None, trim: int = 0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """A profiled step's records as int64 [N, 4] (N > 0), their opcodes and layers, and the layers
    [first, last] to read: `layers`, or those with QKV tasks less `trim` at each end."""
    times = np.asarray(times, dtype=np.int64)
    if times.ndim != 2 or times.shape[1] != 4 or len(times) == 0:
        raise ValueError(f"times must be [N, 4] with N > 0; got {times.shape}")
    op, layer = times[:, 3] & 0xFF, (times[:, 3] >> 8) & 0xFF
    if layers is None:
        in_layers = layer[op == Opcode.QKV]
        if len(in_layers) == 0:
            raise ValueError("the step has no QKV task: give the layers")
        layers = (int(in_layers.min()) + trim, int(in_layers.max()) - trim)
    first, last = layers
    if first > last:
        raise ValueError(f"no layers in {first}:{last}")
    return times, op, layer, first, last


def opcode_means(times: np.ndarray, layers: tuple[int, int] | None = None) -> dict:
    """A profiled step's span (us, the first wait to the last end) and, per opcode of LAYER_OPS,
    its tasks in layers [first, last] (default: of the layers with QKV tasks, all but the first
    two and the last two, whose tasks overlap the step's start and end), their mean run and
    mean wait (us) and their runs and waits summed a layer (sm_us): how two builds' steps differ
    opcode by opcode; and the layer's SM time with the part between tasks (sm_budget). The timing records' upper 32
    bits (a build's diagnostic marks) are ignored. Without the schedule, a task that waits inside
    its run (Schedule.waits_in_run: QKV and ROUTER up to two rows, a sparse layer's GATE_UP)
    counts that wait in its run."""
    times, op, layer, first, last = step_layers(times, layers, trim=2)
    run_us, wait_us = (times[:, 2] - times[:, 1]) / 1e3, (times[:, 1] - times[:, 0]) / 1e3
    n_layers = last - first + 1
    ops = {}
    for name in LAYER_OPS:
        mine = (op == Opcode[name]) & (layer >= first) & (layer <= last)
        if mine.any():
            ops[name] = {"tasks": int(mine.sum()), "run_us": float(run_us[mine].mean()),
                         "wait_us": float(wait_us[mine].mean()),
                         "sm_us": float((run_us[mine] + wait_us[mine]).sum() / n_layers)}
    return {"span_us": float((times[:, 2].max() - times[:, 0].min()) / 1e3), "layers": (first, last), "ops": ops,
            "budget": sm_budget(times, first, last)}


def sm_budget(times: np.ndarray, first: int, last: int) -> dict | None:
    """Where the SMs' time of a layer goes, over layers [first, last]: sm_us, the SMs times the
    mean layer (from the first wait of layer first's tasks to layer last + 1's; None without
    that layer or with no SM field), and between_us, the SMs' time from the end of a task of
    those layers to the next record's wait on the same SM, a layer (the DRAIN's entry and claim
    or a drain run dry; SM 0 holds records without an SM field)."""
    op, layer, sm = times[:, 3] & 0xFF, (times[:, 3] >> 8) & 0xFF, (times[:, 3] >> 16) & 0xFFFF
    starts = [times[layer == l, 0].min() for l in (first, last + 1) if (layer == l).any()]
    if len(starts) < 2 or sm.max() == 0:
        return None
    order = np.lexsort((times[:, 0], sm))
    t, s, l = times[order], sm[order], layer[order]
    after = (s[1:] == s[:-1]) & (l[:-1] >= first) & (l[:-1] <= last) & (op[order][:-1] != Opcode.DRAIN)
    between = np.clip(t[1:, 0] - t[:-1, 2], 0, None)[after].sum() / 1e3
    n_layers = last - first + 1
    return {"sm_us": float((sm.max() + 1) * (starts[1] - starts[0]) / 1e3 / n_layers),
            "between_us": float(between / n_layers)}


def opcode_phases(times: np.ndarray, layers: tuple[int, int] | None = None) -> list[dict]:
    """Per layer in [first, last] (default: every layer with QKV tasks) and opcode of LAYER_OPS,
    then the LM head (layer None), a row: its tasks, the first one's start (us from the step's
    first stamp), over how long they all started (spread), their median run and the last one's
    end: a phase whose tasks start on every SM at once against one whose tasks start apart
    (benchmarks/NOTES.md, session 48). A start is a task's start stamp: after its wait, or before
    it where the task waits inside its run."""
    times, op, layer, first, last = step_layers(times, layers)
    t0 = times[:, 0].min()

    def row(l: int | None, name: str, mine: np.ndarray) -> dict:
        start, end = (times[mine, 1] - t0) / 1e3, (times[mine, 2] - t0) / 1e3
        return {"layer": l, "op": name, "tasks": int(mine.sum()), "first_start_us": float(start.min()),
                "spread_us": float(start.max() - start.min()), "run_us": float(np.median(end - start)),
                "last_end_us": float(end.max())}

    rows = [row(l, name, (op == Opcode[name]) & (layer == l)) for l in range(first, last + 1) for name in LAYER_OPS
            if ((op == Opcode[name]) & (layer == l)).any()]
    if (op == Opcode.LM_HEAD).any():
        rows.append(row(None, "LM_HEAD", op == Opcode.LM_HEAD))
    return rows


def phases_report(rows: list[dict]) -> str:
    """opcode_phases as a table, a line a (layer, opcode)."""
    out = ["us from the step's first stamp: a phase's first start, the spread of its starts, its tasks' median "
           "run, its last end", f"{'layer':>5}  {'op':<8}  {'tasks':>5}  {'start':>8}  {'spread':>6}  {'run':>6}  {'end':>8}"]
    for r in rows:
        layer = "-" if r["layer"] is None else r["layer"]
        out.append(f"{layer:>5}  {r['op']:<8}  {r['tasks']:>5}  {r['first_start_us']:8.1f}  {r['spread_us']:6.1f}"
                   f"  {r['run_us']:6.2f}  {r['last_end_us']:8.1f}")
    return "\n".join(out)


def means_report(named: list[tuple[str, dict]]) -> str:
    """opcode_means of several steps as one table: a row a step (its name, span, layers), per
    opcode its mean run / mean wait in us."""
    ops = [name for name in LAYER_OPS if any(name in m["ops"] for _, m in named)]
    width = max(len(n) for n, _ in named)
    head = f"{'':{width}}  {'span us':>8}  {'layers':>7}" + "".join(f"  {name:>11}" for name in ops)
    out = ["mean run / mean wait of a task (us), by opcode:", head]
    for n, m in named:
        cells = "".join(f"  {m['ops'][name]['run_us']:5.2f}/{m['ops'][name]['wait_us']:<5.2f}"
                        if name in m["ops"] else f"  {'-':>11}" for name in ops)
        out.append(f"{n:{width}}  {m['span_us']:8.1f}  {m['layers'][0]:>3}-{m['layers'][1]:<3}{cells}".rstrip())
    budgets = [(n, m) for n, m in named if m.get("budget")]
    if budgets:
        out.append("SM-us a layer: the SMs times the layer, then per opcode its tasks' runs and waits, then the "
                   "SMs' time between tasks (% of the SMs' time):")
        out.append(f"{'':{width}}  {'SMs':>8}" + "".join(f"  {name:>11}" for name in ops) + f"  {'between':>11}")
        for n, m in budgets:
            total = m["budget"]["sm_us"]
            cells = "".join(f"  {m['ops'][name]['sm_us']:5.0f} {100 * m['ops'][name]['sm_us'] / total:4.1f}%"
                            if name in m["ops"] else f"  {'-':>11}" for name in ops)
            between = m["budget"]["between_us"]
            out.append(f"{n:{width}}  {total:8.0f}{cells}  {between:5.0f} {100 * between / total:4.1f}%")
    return "\n".join(out)
