"""A timed replay of a decode step's schedule: `python -m northmk.bench simulate`.

The megakernel's SMs walk their task lists; at DRAIN(q) each claims queue q's next task when
it is free (the list task before a DRAIN(q) claims q's first task as it begins) and runs it
once its counters reached its target (a reader of a layer's input: every block counter of its
wait span). `simulate` plays that out in time
for a Schedule, given each task's run time and two gaps (a counter complete -> its waiter
running: `hop`; an SM's previous task ended -> its next running: `turn`), and returns the task
times in the kernel's own format ([tasks less DRAIN entries, 4]: began waiting, ran, ended in
ns, op | layer << 8 | sm << 16), so that bench.summarize_tasks and bench_critical read it like
a profiled step.

Replayed with the run times a profiled step measured, it should give back about that step's
length; a schedule that differs only in order (queue positions, list placement) then gets a
prediction from the same run times (`replay_runs` keys them by the task, not by its position;
`measured_runs` and `runs_for` split that in two, so that the runs can be saved and replayed on
the schedule another build of the library makes). What it cannot see: tasks slowing each other down through shared DRAM bandwidth.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

import numpy as np

from .megakernel import Opcode
from .megakernel_interpreter import Lists

Key = tuple[int, int, int, int, int]  # op, layer, x, y, z


def task_keys(tasks: np.ndarray) -> list[Key]:
    return list(zip(*(tasks[f].astype(int).tolist() for f in ("op", "layer", "x", "y", "z"))))


def simulate(schedule, run_ns, hop_ns: int = 500, turn_ns: int = 700) -> np.ndarray:
    """Task times of one step of `schedule` (rows: its tasks less the DRAIN entries, in order).
    run_ns[i]: the run time of schedule.tasks[i] (DRAIN entries' ignored). RuntimeError when
    the SMs cannot all finish (a deadlock). A task runs a hop after the latest of its counters'
    (schedule.wait_spans()) target-th signals: the target-th end among the counter's signallers
    placed so far when its waiter is placed (SMs are placed in the order they become free, so a
    later placement rarely ends earlier)."""
    tasks = schedule.tasks
    ops, waits, targets, signals = (tasks[f].astype(int).tolist() for f in ("op", "wait", "target", "signal"))
    spans = schedule.wait_spans().tolist()
    lists = Lists(schedule)
    num_sms = schedule.num_sms
    free = [0] * num_sms  # when each SM ended its last task
    ends: dict[int, list[int]] = defaultdict(list)  # counter -> its signallers' ends, placed so far
    # counter -> SMs whose next task waits on it, short of its target (each SM under its task's
    # first such counter: woken by a signal of it, the SM checks all of them again)
    blocked: dict[int, list[int]] = defaultdict(list)
    rows = np.zeros((len(tasks), 4), dtype=np.int64)
    placed = np.zeros(len(tasks), dtype=bool)
    ready_sms = [(0, sm) for sm in range(num_sms)]
    heapq.heapify(ready_sms)
    first_turn = [True] * num_sms

    while ready_sms:
        now, sm = heapq.heappop(ready_sms)
        i = lists.next(sm)
        if i is None:
            continue
        counters, target = range(waits[i], waits[i] + spans[i]), targets[i]
        short = next((c for c in counters if target > len(ends[c])), None)
        if short is not None:
            blocked[short].append(sm)
            continue
        ready = max(sorted(ends[c])[target - 1] for c in counters) + hop_ns if counters and target > 0 else 0
        start = max(free[sm] + (0 if first_turn[sm] else turn_ns), ready)
        end = start + int(run_ns[i])
        rows[i] = [free[sm], start, end, ops[i] | int(tasks["layer"][i]) << 8 | sm << 16]
        placed[i] = True
        first_turn[sm] = False
        free[sm] = end
        lists.ran(sm, i)
        if signals[i] >= 0:
            ends[signals[i]].append(end)
            for waiter in blocked.pop(signals[i], []):
                heapq.heappush(ready_sms, (free[waiter], waiter))
        heapq.heappush(ready_sms, (end, sm))
    work = np.array([op != Opcode.DRAIN for op in ops])
    if not placed[work].all():
        stuck = sorted({sm for sms in blocked.values() for sm in sms})
        raise RuntimeError(f"deadlock: {int((~placed[work]).sum())} tasks never run; SMs {stuck[:8]} wait forever")
    return rows[work]


def measured_runs(measured_schedule, measured_times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A profiled step of measured_schedule: its tasks' keys [n, 5] (op, layer, x, y, z) and
    each one's measured run time (ns)."""
    measured = measured_schedule.tasks[measured_schedule.tasks["op"] != Opcode.DRAIN]
    times = np.asarray(measured_times, dtype=np.int64)
    if len(times) != len(measured):
        raise ValueError(f"the times have {len(times)} tasks, their schedule {len(measured)}")
    return np.array(task_keys(measured), dtype=np.int64).reshape(-1, 5), times[:, 2] - times[:, 1]


def runs_for(schedule, keys: np.ndarray, runs: np.ndarray) -> tuple[np.ndarray, int]:
    """Run times for schedule.tasks from measured_runs' keys and runs: each task's own where the
    step had the same task, else its opcode's mean there. Returns them and how many took the mean."""
    by_key = {tuple(k): int(r) for k, r in zip(np.asarray(keys).tolist(), np.asarray(runs).tolist())}
    per_op: dict[int, list[int]] = defaultdict(list)
    for (op, *_), r in by_key.items():
        per_op[op].append(r)
    mean = {op: sum(v) / len(v) for op, v in per_op.items()}
    out, guessed = np.zeros(len(schedule.tasks), dtype=np.int64), 0
    for i, key in enumerate(task_keys(schedule.tasks)):
        if key[0] == Opcode.DRAIN:
            continue
        if key in by_key:
            out[i] = by_key[key]
        elif key[0] in mean:
            out[i], guessed = int(mean[key[0]]), guessed + 1
        else:
            raise ValueError(f"no measured {Opcode(key[0]).name} task to take a run time from")
    return out, guessed


def replay_runs(schedule, measured_schedule, measured_times: np.ndarray) -> tuple[np.ndarray, int]:
    """Run times for schedule.tasks from a profiled step of measured_schedule (runs_for of its
    measured_runs). Returns them and how many took their opcode's mean."""
    return runs_for(schedule, *measured_runs(measured_schedule, measured_times))
