"""A decode step's schedule replayed with its tasks sharing DRAM bandwidth: `python -m northmk.bench fluid`.

bench_simulate replays a step from each task's measured run time, so it cannot see tasks slowing
each other down, nor ask what a task would take on another schedule. Here a task is a fixed part
(staging, reductions, writes, the signal: time in which its executor streams nothing), half before
and half after, around the bytes it streams (bench_timeline.task_bytes: its weights, its pages of
KV). The bytes flow at rates that share three caps, recomputed whenever a task starts or stops
streaming: each executor's own (how fast one executor's loads can stream), each SM's (its executors
together) and DRAM's (all of them: above it every streaming executor slows by the same factor).

An executor is what runs one task list: the megakernel runs one per SM, and `executors` > 1 asks
what several per SM would give, each with its own list of a schedule built for SMs x executors
(executor e of SM s runs list e * SMs + s). Waits, hops, turns and queue claims are
bench_simulate's. The fixed part of each opcode comes from a profiled step: the `fixed_quantile`
of its tasks' (run - bytes / executor cap) over the tasks that streamed anything (all of them
for opcodes that stream nothing), the least contended tasks being the nearest to streaming
alone. Replaying the profiled step's own schedule this way says how far the model is from the
measured step; a change is read as the ratio of two replays, which that error mostly cancels.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

import numpy as np

from .megakernel_interpreter import Lists
from .config import DENSE, ModelConfig
from .megakernel import Opcode


def fixed_parts(schedule, times: np.ndarray, nbytes: np.ndarray, executor_bpns: float,
                quantile: float = 0.1) -> dict[int, float]:
    """ns of fixed part per opcode of a profiled step (its times, the bytes of its tasks)."""
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"the fixed part's quantile must be in [0, 1], got {quantile}")
    ops = schedule.tasks["op"][schedule.tasks["op"] != Opcode.DRAIN].astype(int)
    run = (times[:, 2] - times[:, 1]).astype(np.float64)
    out = {}
    for op in np.unique(ops):
        mine = ops == op
        streams = mine & (nbytes > 0)
        if streams.any():
            left = run[streams] - nbytes[streams] / executor_bpns
        else:
            left = run[mine]
        out[int(op)] = max(0.0, float(np.quantile(left, quantile)))
    return out


def used_slots(config: ModelConfig, schedule, nbytes: np.ndarray) -> set[tuple[int, int]]:
    """(layer, slot) of the sparse layers' expert slots that read anything in a profiled step
    (nbytes: bench_timeline.task_bytes of its tasks less DRAIN entries)."""
    tasks = schedule.tasks[schedule.tasks["op"] != Opcode.DRAIN]
    return {(int(t["layer"]), int(t["y"])) for t, n in zip(tasks, nbytes)
            if n > 0 and t["op"] in (Opcode.GATE_UP, Opcode.DOWN) and config.mlp_types[int(t["layer"])] != DENSE}


def schedule_bytes(config: ModelConfig, schedule, context: int, used: set[tuple[int, int]]) -> np.ndarray:
    """Bytes per task of `schedule` (DRAIN entries 0), every expert slot of a sparse layer reading
    its tile but those not in `used`, which read nothing (a slot no row picked)."""
    from .bench_timeline import task_bytes

    work = schedule.tasks["op"] != Opcode.DRAIN
    ran = np.zeros((int(work.sum()), 4), dtype=np.int64)
    ran[:, 2] = 1 << 40  # no task "ran short": task_bytes clears no slot
    out = np.zeros(len(schedule.tasks), dtype=np.int64)
    out[work] = task_bytes(config, schedule, context, ran)
    for i in np.flatnonzero(work):
        t = schedule.tasks[i]
        if t["op"] in (Opcode.GATE_UP, Opcode.DOWN) and config.mlp_types[int(t["layer"])] != DENSE \
                and (int(t["layer"]), int(t["y"])) not in used:
            out[i] = 0
    return out


def replay(schedule, fixed_ns, nbytes, sms: int, executors: int = 1, executor_bpns=45.0,
           sm_bpns: float = 45.0, dram_bpns: float = 4240.0, hop_ns: float = 500.0,
           turn_ns: float = 700.0, ahead=None, ahead_bytes: float = 0.0, ahead_saves_ns: float = 0.0) -> np.ndarray:
    """Task times of one step of `schedule` (built for sms * executors lists) in the kernel's
    format ([tasks less DRAIN entries, 4]: began waiting, ran, ended in ns, op | layer << 8 |
    list << 16). fixed_ns[i] and nbytes[i]: task i's fixed part and bytes (DRAIN entries'
    ignored); executor_bpns: an executor's cap, one for all tasks or task i's at [i]. Rates in
    bytes per ns (= GB/s). With ahead (task i's at [i]: its bytes do not depend on what it waits
    for), an executor whose task must wait streams up to ahead_bytes of it from the moment it
    takes the task until its bytes are due (a producer filling a ring that deep), the rest then; a
    task that streamed any ahead has its fixed part less ahead_saves_ns (its first round trip).
    RuntimeError on a deadlock."""
    if schedule.num_sms != sms * executors:
        raise ValueError(f"the schedule has {schedule.num_sms} lists, not {sms} SMs x {executors} executors")
    task_cap = np.broadcast_to(np.asarray(executor_bpns, dtype=np.float64), (len(schedule.tasks),))
    if min(task_cap.min(initial=np.inf), sm_bpns, dram_bpns) <= 0 or min(hop_ns, turn_ns) < 0:
        raise ValueError("the rates must be > 0 and the hop and turn >= 0")
    if min(ahead_bytes, ahead_saves_ns) < 0:
        raise ValueError("the bytes streamed ahead and the time it saves must be >= 0")
    may_ahead = np.zeros(len(schedule.tasks), dtype=bool) if ahead is None else np.asarray(ahead, dtype=bool)
    tasks = schedule.tasks
    ops, waits, targets, signals = (tasks[f].astype(int).tolist() for f in ("op", "wait", "target", "signal"))
    spans = schedule.wait_spans().tolist()
    layers = tasks["layer"].astype(int).tolist()
    n_exec = schedule.num_sms
    lists = Lists(schedule)
    sm_of = np.arange(n_exec) % sms
    current = [-1] * n_exec  # the task an executor runs or waits for
    free = [0.0] * n_exec  # when the executor ended its last task
    first = [True] * n_exec
    left = np.zeros(n_exec)  # bytes left to stream
    cap = np.zeros(n_exec)  # the streaming task's executor cap
    streaming = np.zeros(n_exec, dtype=bool)
    prefetching = np.zeros(n_exec, dtype=bool)  # streaming ahead of its task's wait
    early = np.zeros(n_exec)  # bytes of the current task streamed ahead (the target while prefetching)
    fixed_now = np.zeros(n_exec)  # the current task's fixed part
    reached: dict[int, list[float]] = defaultdict(list)  # counter -> when it reached 1, 2, ...
    blocked: dict[int, list[int]] = defaultdict(list)  # counter -> executors whose task waits on it
    rows = np.zeros((len(tasks), 4), dtype=np.int64)
    placed = np.zeros(len(tasks), dtype=bool)
    # an executor's fixed part ends: (when, executor, True: the part before its bytes, False: after)
    timed: list[tuple[float, int, bool]] = []

    def start(x: int, ready: float) -> None:
        i = current[x]
        fixed_now[x] = max(0.0, fixed_ns[i] - (ahead_saves_ns if early[x] > 0 else 0.0))
        begin = max(free[x] + (0.0 if first[x] else turn_ns), ready)
        rows[i, 0], rows[i, 1] = int(free[x]), int(begin)
        heapq.heappush(timed, (begin + fixed_now[x] / 2, x, True))

    def short(i: int) -> int | None:
        """The first counter of task i's wait span short of its target, None when all reached it."""
        return next((c for c in range(waits[i], waits[i] + spans[i]) if targets[i] > len(reached[c])), None)

    def take(x: int) -> None:
        i = lists.next(x)
        if i is None:
            return
        current[x] = i
        c = short(i)
        if c is not None:
            blocked[c].append(x)
            if may_ahead[i] and ahead_bytes > 0 and nbytes[i] > 0:
                early[x] = left[x] = min(ahead_bytes, float(nbytes[i]))
                cap[x], prefetching[x], streaming[x] = task_cap[i], True, True
        else:
            counters, target = range(waits[i], waits[i] + spans[i]), targets[i]
            start(x, max(reached[c][target - 1] for c in counters) + hop_ns if counters and target > 0 else 0.0)

    def end(x: int, now: float) -> None:
        i = current[x]
        early[x] = 0.0
        rows[i, 2], rows[i, 3] = int(now), ops[i] | layers[i] << 8 | x << 16
        placed[i] = True
        first[x], free[x] = False, now
        lists.ran(x, i)
        s = signals[i]
        if s >= 0:
            reached[s].append(now)
            for waiter in blocked.pop(s, []):  # each waits on s, or on a later counter of its span
                c = short(current[waiter])
                if c is None:
                    start(waiter, now + hop_ns)
                else:
                    blocked[c].append(waiter)
        take(x)

    for x in range(n_exec):
        take(x)
    now = 0.0
    while True:
        rates = np.zeros(n_exec)
        if streaming.any():
            per_sm = np.bincount(sm_of[streaming], minlength=sms)
            rates[streaming] = np.minimum(cap[streaming], sm_bpns / per_sm[sm_of[streaming]])
            total = rates.sum()
            if total > dram_bpns:
                rates *= dram_bpns / total
        t_timed = timed[0][0] if timed else np.inf
        t_stream = now + float(np.min(left[streaming] / rates[streaming])) if streaming.any() else np.inf
        t = min(t_timed, t_stream)
        if t == np.inf:
            break
        left[streaming] -= rates[streaming] * (t - now)
        now = t
        for x in np.flatnonzero(streaming & (left <= 1e-3)).tolist():  # bytes: what rounding leaves
            streaming[x] = False
            if prefetching[x]:  # streamed all it may ahead: it waits with its ring full
                prefetching[x], left[x] = False, 0.0
            else:
                heapq.heappush(timed, (now + fixed_now[x] / 2, x, False))
        while timed and timed[0][0] <= now:
            _, x, before = heapq.heappop(timed)
            i = current[x]
            rest = float(nbytes[i]) - early[x]
            if before and prefetching[x]:  # still filling its ring: the stream runs on into the rest
                left[x] += rest
                prefetching[x] = False
            elif before and rest > 1e-3:
                left[x], cap[x], streaming[x] = rest, task_cap[i], True
            elif before:
                heapq.heappush(timed, (now + fixed_now[x] / 2, x, False))
            else:
                end(x, now)
    work = np.array([op != Opcode.DRAIN for op in ops])
    if not placed[work].all():
        stuck = sorted({x for xs in blocked.values() for x in xs})
        raise RuntimeError(f"deadlock: {int((~placed[work]).sum())} tasks never run; executors {stuck[:8]} wait forever")
    return rows[work]


def step_us(times: np.ndarray) -> float:
    return float(times[:, 2].max() - times[:, 1].min()) / 1e3
