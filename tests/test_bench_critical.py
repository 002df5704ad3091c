"""The critical path of a profiled step (northmk.bench_critical, `python -m northmk.bench
critical`): which constraint held each task last, on hand-built timings and on a schedule timed
as the kernel would run it; and the timed replay of a schedule (northmk.bench_simulate,
`python -m northmk.bench simulate`)."""

from __future__ import annotations

import copy
import json

import lzma

import numpy as np
import pytest

from northmk import bench
from northmk.bench_critical import (HOP, START, TURN, check_times, context_bucket, counter_done, counter_hops,
                                    critical_path, critical_path_of_run, hops_report, opcode_means, opcode_phases,
                                    opcode_switches, report, summarize, switches_report)
from northmk.bench_simulate import replay_runs, simulate
from northmk.megakernel import TASK_DTYPE, Opcode, Schedule
from northmk.megakernel_interpreter import execution_order


def record(op: Opcode, sm: int, began: int, start: int, end: int, layer: int = 0) -> list[int]:
    return [began, start, end, int(op) | layer << 8 | sm << 16]


def one_counter(wait: np.ndarray) -> np.ndarray:
    """The wait spans of hand-built tasks that each wait on one counter (or none)."""
    return (np.asarray(wait) >= 0).astype(np.int64)


def hand_made(lists: list[list[tuple[Opcode, int, int, int, int, int]]], batch: int = 1) -> Schedule:
    """A Schedule of mk-small's geometry (hidden 512: two column blocks, a reader of a layer's
    input waits on two counters) with these SM lists of (op, layer, x, wait, target, signal)
    and no queues."""
    s = Schedule.__new__(Schedule)
    rows = [(op, layer, x, 0, 0, wait, target, signal)
            for tasks in lists for op, layer, x, wait, target, signal in tasks]
    s.config, s.tasks = bench.geometry("mk-small"), np.array(rows, dtype=TASK_DTYPE)
    s.sm_offsets = np.cumsum([0] + [len(tasks) for tasks in lists]).astype(np.uint32)
    s.queue_offsets = np.array([len(rows)], dtype=np.uint32)
    last = s.tasks["wait"].astype(np.int64) + s.wait_spans() - 1  # the last counter each task waits on
    s.plan = {"batch": batch, "num_counters": 1 + int(max(last.max(), s.tasks["signal"].max()))}
    return s


# Layer 0's two OPROJ tiles each complete one column block of layer 1's input (counters 0 and 1):
# SM 0's at 1 us, SM 1's at 5 us. Layer 1's QKV tile (SM 2) waits on both (its wait: counter 0).
BLOCKS = [[(Opcode.OPROJ, 0, 0, -1, 0, 0)], [(Opcode.OPROJ, 0, 1, -1, 0, 1)], [(Opcode.QKV, 1, 0, 0, 1, 2)]]


def test_the_chain_follows_the_later_of_counter_and_sm():
    # SM 0: NORM (signals c0), OPROJ, DOWN (waits c1); SM 1: QKV (waits c0, signals c1), ROUTER.
    times = np.array([
        record(Opcode.NORM, 0, 0, 0, 10_000),
        record(Opcode.QKV, 1, 0, 12_000, 30_000),
        record(Opcode.OPROJ, 0, 10_500, 11_000, 20_000),
        record(Opcode.DOWN, 0, 20_500, 31_000, 40_000),
        record(Opcode.ROUTER, 1, 30_500, 31_500, 50_000),
    ])
    wait = np.array([-1, 0, -1, 1, -1])
    target = np.array([0, 1, 0, 1, 0])
    signal = np.array([0, 1, -1, -1, -1])
    chain = critical_path(times, wait, target, signal, one_counter(wait))
    # ROUTER ended last; its SM's previous task was QKV (a turn), QKV waited for NORM (a hop).
    assert [(link.op, link.how, link.gap_ns) for link in chain] == [
        ("NORM", START, 0), ("QKV", HOP, 2_000), ("ROUTER", TURN, 1_500)]
    assert [link.after for link in chain] == [None, 0, 1]
    s = summarize(chain)
    assert s["length_us"] == pytest.approx(50.0)  # the chain covers the step: runs plus gaps
    assert s["runs_us"] == pytest.approx({"QKV": 18.0, "ROUTER": 18.5, "NORM": 10.0})
    assert s["gaps"][HOP] == pytest.approx({"count": 1, "total_us": 2.0, "mean_us": 2.0})
    assert "critical path: 50.0 us, 3 tasks" in report(chain)


def test_a_counter_is_complete_at_its_target_th_signal():
    # Three signallers of c0 end at 5, 9 and 30 us; the waiter needs two of them.
    times = np.array([
        record(Opcode.NORM, 0, 0, 0, 5_000),
        record(Opcode.NORM, 1, 0, 0, 9_000),
        record(Opcode.NORM, 2, 0, 0, 30_000),
        record(Opcode.QKV, 3, 0, 10_000, 60_000),
    ])
    wait = np.array([-1, -1, -1, 0])
    chain = critical_path(times, wait, np.array([0, 0, 0, 2]), np.array([0, 0, 0, -1]), one_counter(wait))
    assert [(link.task, link.how) for link in chain] == [(1, START), (3, HOP)]
    assert chain[1].gap_ns == 1_000


def test_bad_timings_are_refused():
    times = np.array([record(Opcode.QKV, 0, 0, 0, 10)])
    with pytest.raises(ValueError, match="waits for 2 signals of counter 0, the step has 0"):
        critical_path(times, np.array([0]), np.array([2]), np.array([-1]), np.array([1]))
    with pytest.raises(ValueError, match="waits for 1 signals of counter 1, the step has 0"):
        critical_path(times, np.array([0]), np.array([1]), np.array([0]), np.array([2]))  # its second counter
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        critical_path(times[:, :3], np.array([-1]), np.array([0]), np.array([-1]), np.array([0]))
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        critical_path(times, np.array([-1]), np.array([0]), np.array([-1]), np.array([]))
    assert critical_path(np.zeros((0, 4)), np.array([]), np.array([]), np.array([]), np.array([])) == []


def test_counter_hops_go_from_the_completing_end_to_the_first_waiter():
    # c0: DOWN and OPROJ -> two NORM tiles; c1: NORM -> QKV; c2: QKV -> ATTN, two layers of it.
    times = np.array([
        record(Opcode.DOWN, 0, 0, 0, 10_000),
        record(Opcode.OPROJ, 1, 0, 0, 20_000),
        record(Opcode.NORM, 2, 0, 20_500, 25_000),
        record(Opcode.NORM, 3, 0, 21_000, 24_000),
        record(Opcode.QKV, 0, 11_000, 26_000, 30_000),
        record(Opcode.ATTN, 1, 21_000, 31_000, 40_000),
        record(Opcode.QKV, 2, 26_000, 41_000, 50_000, layer=1),
        record(Opcode.ATTN, 3, 26_000, 50_500, 60_000, layer=1),
    ])
    wait = np.array([-1, -1, 0, 0, 1, 2, -1, 3])
    target = np.array([0, 0, 2, 2, 2, 1, 0, 1])
    signal = np.array([0, 0, 1, 1, 2, -1, 3, -1])
    span = one_counter(wait)
    hops = counter_hops(times, wait, target, signal, span)
    assert list(hops) == ["QKV -> ATTN", "DOWN+OPROJ -> NORM", "NORM -> QKV"]  # most counters first
    assert hops["DOWN+OPROJ -> NORM"] == {"count": 1, "median_us": 0.5, "mean_us": 0.5}
    assert hops["NORM -> QKV"]["median_us"] == 1.0  # the later NORM's end completed it
    assert hops["QKV -> ATTN"] == {"count": 2, "median_us": 0.75, "mean_us": 0.75}
    text = hops_report(hops)
    assert text.splitlines()[0].startswith("counter hops") and "DOWN+OPROJ -> NORM" in text
    with pytest.raises(ValueError, match="waits for 3 signals of counter 1, the step has 2"):
        counter_hops(times, wait, np.array([0, 0, 2, 2, 3, 1, 0, 1]), signal, span)
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        counter_hops(times[:, :3], wait, target, signal, span)


def test_a_reader_of_a_layers_input_waits_for_the_last_of_its_blocks():
    # BLOCKS: QKV's first counter is complete at 1 us, its second at 5 us; it ran at 5.2 us.
    times = np.array([
        record(Opcode.OPROJ, 0, 0, 0, 1_000),
        record(Opcode.OPROJ, 1, 0, 0, 5_000),
        record(Opcode.QKV, 2, 0, 5_200, 8_000, layer=1),
    ])
    wait, target, signal, span = np.array([-1, -1, 0]), np.array([0, 0, 1]), np.array([0, 1, 2]), np.array([0, 0, 2])
    assert counter_done(times, wait, target, signal, span).tolist() == [-1, -1, 5_000]
    chain = critical_path(times, wait, target, signal, span)
    assert [(link.task, link.how, link.gap_ns) for link in chain] == [(1, START, 0), (2, HOP, 200)]
    assert counter_hops(times, wait, target, signal, span) == {"OPROJ -> QKV": {"count": 1, "median_us": 0.2,
                                                                                "mean_us": 0.2}}
    # the same fields from a Schedule: wait_spans says the QKV tile waits on both blocks
    checked, *fields = check_times(times, hand_made(BLOCKS, batch=3))
    assert [f.tolist() for f in fields] == [wait.tolist(), target.tolist(), signal.tolist(), span.tolist()]
    assert (checked == times).all()
    # up to two rows the tile is stamped before its wait (own_wait): its run starts at the last block's end
    early = times.copy()
    early[2, 1] = 1_500
    checked, *fields = check_times(early, hand_made(BLOCKS, batch=2))
    assert checked[2, 1] == 5_000 and (checked[:2] == early[:2]).all()


def timed_step(schedule: Schedule, run_ns: int = 1000) -> np.ndarray:
    """The step's task times as the kernel records them (DRAIN entries left out), every task
    run_ns long, starting when its SM is free and each counter of its wait span reached its
    target, the SMs taking their tasks in the interpreter's execution order."""
    tasks, spans = schedule.tasks, schedule.wait_spans()
    rows = np.zeros((len(tasks), 4), dtype=np.int64)
    clock, ends = [0] * schedule.num_sms, {}
    for sm, i in execution_order(schedule):
        wait, target, signal = int(tasks["wait"][i]), int(tasks["target"][i]), int(tasks["signal"][i])
        counters = range(wait, wait + int(spans[i]))
        ready = max((sorted(ends.get(c, []))[target - 1] for c in counters), default=0) if target else 0
        start = max(clock[sm], ready)
        rows[i] = [clock[sm], start, start + run_ns, int(tasks["op"][i]) | int(tasks["layer"][i]) << 8 | sm << 16]
        clock[sm] = start + run_ns
        if signal >= 0:
            ends.setdefault(signal, []).append(start + run_ns)
    return rows[tasks["op"] != Opcode.DRAIN]


def test_a_scheduled_step_chains_from_its_first_task_to_its_last():
    schedule = Schedule(bench.geometry("mk-small"), 4, [128, 128])
    times = timed_step(schedule)
    chain = critical_path_of_run(times, schedule)
    assert chain[0].how == START and chain[-1].task == int(np.argmax(times[:, 2]))
    assert chain[-1].op == "ARGMAX"
    # Back-to-back 1 us tasks: the chain is the whole step, every link a task of 1 us.
    assert summarize(chain)["length_us"] == pytest.approx(times[:, 2].max() / 1e3)
    assert all(link.run_ns == 1000 for link in chain)
    for before, link in zip(chain, chain[1:]):
        assert link.after == before.task
        assert times[link.task, 1] >= times[before.task, 2]


def test_tasks_that_wait_inside_their_run_are_read_from_their_counters_completion():
    # Up to two rows QKV and ROUTER tasks are stamped as started before their wait for their
    # layer's input (vm.cuh's own_wait), and a sparse layer's GATE_UP before its poll of the
    # routing: the tools that have the schedule read their run from the completion of the last
    # of their counters.
    for rows, inside in (([128, 128], True), ([128], True), ([128, 128, 128], False)):
        schedule = Schedule(bench.geometry("mk-small"), 4, rows)
        times = timed_step(schedule)
        _, wait, target, signal, span = check_times(times, schedule)
        op = times[:, 3] & 0xFF
        own = (op == Opcode.ROUTER) | (op == Opcode.QKV)
        assert (span[own] == 2).all(), "mk-small's input is two column blocks"
        waited = own & (times[:, 1] == counter_done(times, wait, target, signal, span))  # ran as the last completed
        assert set(op[waited]) == {Opcode.QKV, Opcode.ROUTER}
        early = times.copy()
        early[waited, 1] -= 700  # stamped 0.7 us before the counters let them run
        checked, *fields = check_times(early, schedule)
        assert (counter_done(early, *fields)[waited] == times[waited, 1]).all()
        if inside:
            assert (checked == times).all()  # the timed step's own starts
            assert all(link.gap_ns >= 0 for link in critical_path(checked, *fields))
        else:
            assert (checked == early).all()
        # At any batch size a sparse layer's GATE_UP (its wait the routing's one counter) polls
        # the routing's table inside its run; a dense layer's (its input's blocks) waits first.
        done = counter_done(times, wait, target, signal, span)
        gate_up = op == Opcode.GATE_UP
        assert (gate_up & (span == 1)).any() and (gate_up & (span == 2)).any()
        early = times.copy()
        early[gate_up, 1] = done[gate_up] - 700
        checked = check_times(early, schedule)[0]
        assert (checked[gate_up & (span == 1), 1] == done[gate_up & (span == 1)]).all()
        assert (checked[gate_up & (span == 2), 1] == early[gate_up & (span == 2), 1]).all()


def test_times_of_another_schedule_are_refused():
    schedule = Schedule(bench.geometry("mk-small"), 4, [128, 128])
    times = timed_step(schedule)
    with pytest.raises(ValueError, match="another batch, context or SM count"):
        critical_path_of_run(times, Schedule(bench.geometry("mk-small"), 4, [128]))
    shuffled = times.copy()
    shuffled[[0, -1], 3] = shuffled[[-1, 0], 3]
    with pytest.raises(ValueError, match="opcodes and layers differ"):
        critical_path_of_run(shuffled, schedule)


def test_context_bucket_is_the_kernels():
    assert [context_bucket(n) for n in (1, 64, 65, 100, 8192, 8193)] == [64, 64, 128, 128, 8192, 16384]


def test_critical_command_reads_the_batch_and_context_from_the_file_name(tmp_path, capsys):
    schedule = Schedule(bench.geometry("mk-small"), 4, [context_bucket(100)] * 2)
    path = tmp_path / "task-times-b2-c100.npy"
    np.save(path, timed_step(schedule))
    assert bench.main(["critical", str(path), "--sms", "4", "--geometry", "mk-small", "--layer", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{path}: batch 2, context 100, 4 SMs" in out and "critical path:" in out and "layer 1's links" in out
    assert "counter hops" in out and "NORM -> QKV" in out
    assert bench.main(["critical", str(path), "--sms", "4", "--geometry", "mk-small", "--batch", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another batch, context or SM count" in err[0]
    other = tmp_path / "times.npy"
    np.save(other, timed_step(schedule))
    assert bench.main(["critical", str(other), "--sms", "4", "--geometry", "mk-small"]) == 2
    assert "give --batch and --context" in capsys.readouterr().err


def test_reports_read_a_compressed_step_as_the_step(tmp_path, capsys):
    schedule = Schedule(bench.geometry("mk-small"), 4, [context_bucket(100)] * 2)
    path = tmp_path / "task-times-b2-c100.npy"
    np.save(path, timed_step(schedule))
    packed = tmp_path / "task-times-b2-c100.npy.xz"
    packed.write_bytes(lzma.compress(path.read_bytes()))
    for command in (["critical"], ["simulate"], ["ops"], ["switches"]):
        args = command + ["--sms", "4", "--geometry", "mk-small"] if command[0] in ("critical", "simulate") else command
        assert bench.main(args[:1] + [str(path)] + args[1:]) == 0
        plain = capsys.readouterr().out
        assert bench.main(args[:1] + [str(packed)] + args[1:]) == 0  # batch and context from its name too
        words = capsys.readouterr().out.split()  # ops pads its columns to the file's name
        assert words == plain.replace(str(path), str(packed)).split()
    junk = tmp_path / "task-times-b2-c100.npy.xz"
    junk.write_bytes(path.read_bytes())  # not compressed
    assert bench.main(["critical", str(junk), "--sms", "4", "--geometry", "mk-small"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an xz-compressed .npy" in err[0]


def test_opcode_switches_split_each_opcodes_runs_by_the_sms_previous_task(tmp_path, capsys):
    # SM 0: GATE_UP 5 us, GATE_UP 3 us, DOWN 4 us; SM 1 (its list in another order in the
    # array): DOWN 6 us, DOWN 2 us, then an unused slot's GATE_UP of 0.5 us and DOWN 1 us.
    times = np.array([
        record(Opcode.DOWN, 1, 20_000, 20_000, 22_000),
        record(Opcode.GATE_UP, 0, 0, 0, 5_000),
        record(Opcode.GATE_UP, 0, 5_000, 5_000, 8_000),
        record(Opcode.DOWN, 0, 8_000, 8_000, 12_000),
        record(Opcode.DOWN, 1, 0, 10_000, 16_000),
        record(Opcode.GATE_UP, 1, 22_000, 22_000, 22_500),
        record(Opcode.DOWN, 1, 22_500, 22_500, 23_500),
    ])
    s = opcode_switches(times)
    assert s["GATE_UP"] == {"same": {"count": 1, "mean_us": 3.0}, "switch": {"count": 2, "mean_us": 2.75}}
    assert s["DOWN"] == {"same": {"count": 1, "mean_us": 2.0}, "switch": {"count": 3, "mean_us": 11 / 3}}
    # the 0.5 us task leaves the means but still makes the next DOWN a switch
    s = opcode_switches(times, min_run_us=0.6)
    assert s["GATE_UP"] == {"same": {"count": 1, "mean_us": 3.0}, "switch": {"count": 1, "mean_us": 5.0}}
    assert s["DOWN"]["switch"] == {"count": 3, "mean_us": 11 / 3}
    assert "GATE_UP      3.00 (    1)      5.00 (    1)    +2.00" in switches_report(s)
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        opcode_switches(times[:, :3])
    path = tmp_path / "task-times-b1-c64.npy"
    np.save(path, times)
    assert bench.main(["switches", str(path), "--min-us", "0.6"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}\n") and "+2.00" in out
    assert bench.main(["switches", str(path), "--min-us", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "python -m northmk.bench switches: error: --min-us must be >= 0"


def test_opcode_means_average_the_middle_layers_tasks_and_put_steps_side_by_side(tmp_path, capsys):
    # Layers 0..5 of QKV (1 us) and GATE_UP tasks; layer l's GATE_UP runs 2 + l us after
    # waiting l us, so the middle layers 2..3 average 4.5 us run and 2.5 us wait. Marks in the
    # upper 32 bits of a record are not part of the opcode or layer.
    rows = []
    for layer in range(6):
        t0 = layer * 100_000
        rows.append(record(Opcode.QKV, 0, t0, t0, t0 + 1_000, layer))
        rows.append(record(Opcode.GATE_UP, 1, t0, t0 + layer * 1_000, t0 + layer * 1_000 + (2 + layer) * 1_000, layer))
    times = np.array(rows, dtype=np.int64)
    times[:, 3] |= 0x7F << 40
    m = opcode_means(times)
    assert m["layers"] == (2, 3) and m["span_us"] == pytest.approx(512.0)
    assert m["ops"]["GATE_UP"] == {"tasks": 2, "run_us": pytest.approx(4.5), "wait_us": pytest.approx(2.5),
                                   "sm_us": pytest.approx(7.0)}
    assert m["ops"]["QKV"] == {"tasks": 2, "run_us": pytest.approx(1.0), "wait_us": 0.0, "sm_us": pytest.approx(1.0)}
    assert set(m["ops"]) == {"QKV", "GATE_UP"}
    # Two SMs over layers 2-3 (200 us from layer 2's first wait to layer 4's): 200 SM-us a layer.
    # Between tasks: SM 0 from each QKV's end to the next one's wait (99 us twice), SM 1 from each
    # GATE_UP's end (206, 308 us) to the next one's wait (300, 400): 384 us over two layers.
    assert m["budget"] == {"sm_us": pytest.approx(200.0), "between_us": pytest.approx(192.0)}
    assert opcode_means(times, (0, 5))["budget"] is None  # no layer 6 to end layer 5
    assert opcode_means(times, (0, 5))["ops"]["GATE_UP"]["run_us"] == pytest.approx(4.5)
    with pytest.raises(ValueError, match="no layers in 4:3"):
        opcode_means(times, (4, 3))
    with pytest.raises(ValueError, match="no QKV task"):
        opcode_means(times[times[:, 3] & 0xFF == Opcode.GATE_UP])
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        opcode_means(times[:, :3])
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(a, times)
    slower = times.copy()
    slower[1::2, 2] += 1_000  # every GATE_UP 1 us longer
    np.save(b, slower)
    assert bench.main(["ops", str(a), str(b)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["span", "us", "layers", "QKV", "GATE_UP"]
    assert out[2].split() == [str(a), "512.0", "2-3", "1.00/0.00", "4.50/2.50"]
    assert out[3].split() == [str(b), "513.0", "2-3", "1.00/0.00", "5.50/2.50"]
    assert out[4].startswith("SM-us a layer") and out[5].split() == ["SMs", "QKV", "GATE_UP", "between"]
    assert out[6].split() == [str(a), "200", "1", "0.5%", "7", "3.5%", "192", "96.0%"]
    assert out[7].split() == [str(b), "200", "1", "0.5%", "8", "4.0%", "191", "95.5%"]
    assert bench.main(["ops", str(a), "--layers", "0:1"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[1:] == ["512.0", "0-1", "1.00/0.00", "2.50/0.50"]
    assert bench.main(["ops", str(a), "--layers", "2"]) == 2
    assert capsys.readouterr().err.strip() == "python -m northmk.bench ops: error: --layers '2': want FIRST:LAST (2:46)"


def test_opcode_phases_give_each_layers_phase_its_start_spread_run_and_end(tmp_path, capsys):
    # Layer 0: three QKV tasks started together (1000 ns after the step's first stamp, each
    # waiting 500 ns before it) running 4, 6, 5 us; layer 1: two o-proj tasks started 3 us apart
    # running 2 and 4 us; then two LM head tasks (layer field 0).
    rows = [record(Opcode.QKV, sm, 500, 1_000, 1_000 + run, 0) for sm, run in enumerate((4_000, 6_000, 5_000))]
    rows += [record(Opcode.QKV, 0, 9_000, 9_000, 10_000, 1),
             record(Opcode.OPROJ, 1, 20_000, 20_000, 22_000, 1), record(Opcode.OPROJ, 2, 20_000, 23_000, 27_000, 1),
             record(Opcode.LM_HEAD, 0, 28_000, 28_000, 38_000), record(Opcode.LM_HEAD, 1, 28_000, 28_500, 40_500)]
    times = np.array(rows, dtype=np.int64)
    times[:, 3] |= 0x55 << 36  # marks above the SM field are not part of the record's fields
    got = opcode_phases(times)
    assert [(r["layer"], r["op"], r["tasks"]) for r in got] == [(0, "QKV", 3), (1, "QKV", 1), (1, "OPROJ", 2),
                                                                 (None, "LM_HEAD", 2)]
    assert got[0] == {"layer": 0, "op": "QKV", "tasks": 3, "first_start_us": pytest.approx(0.5),
                      "spread_us": pytest.approx(0.0), "run_us": pytest.approx(5.0), "last_end_us": pytest.approx(6.5)}
    assert got[2]["first_start_us"] == pytest.approx(19.5) and got[2]["spread_us"] == pytest.approx(3.0)
    assert got[2]["run_us"] == pytest.approx(3.0) and got[2]["last_end_us"] == pytest.approx(26.5)
    assert got[3]["run_us"] == pytest.approx(11.0) and got[3]["last_end_us"] == pytest.approx(40.0)
    assert [r["op"] for r in opcode_phases(times, (1, 1))] == ["QKV", "OPROJ", "LM_HEAD"]
    with pytest.raises(ValueError, match="no layers in 2:1"):
        opcode_phases(times, (2, 1))
    with pytest.raises(ValueError, match="no QKV task"):
        opcode_phases(times[times[:, 3] & 0xFF == Opcode.OPROJ])
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        opcode_phases(times[:, :3])
    path = tmp_path / "t.npy"
    np.save(path, times)
    assert bench.main(["phases", str(path), "--layers", "1:1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(path) and out[2].split() == ["layer", "op", "tasks", "start", "spread", "run", "end"]
    assert [line.split() for line in out[3:]] == [["1", "QKV", "1", "8.5", "0.0", "1.00", "9.5"],
                                                 ["1", "OPROJ", "2", "19.5", "3.0", "3.00", "26.5"],
                                                 ["-", "LM_HEAD", "2", "27.5", "0.5", "11.00", "40.0"]]
    assert bench.main(["phases", str(path), "--layers", "1"]) == 2
    assert capsys.readouterr().err.strip() == "python -m northmk.bench phases: error: --layers '1': want FIRST:LAST (2:46)"


# ---- the timed replay ----------------------------------------------------------------------

def test_a_replayed_step_keeps_every_constraint_of_the_kernel():
    schedule = Schedule(bench.geometry("mk-small"), 4, [128, 128])
    tasks = schedule.tasks
    runs = np.where(tasks["op"] == Opcode.GATE_UP, 3000, 1000)
    hop, turn = 200, 300
    times = simulate(schedule, runs, hop, turn)
    work = tasks[tasks["op"] != Opcode.DRAIN]
    assert len(times) == len(work)
    assert ((times[:, 2] - times[:, 1]) == runs[tasks["op"] != Opcode.DRAIN]).all()
    sm = times[:, 3] >> 16
    for s in range(schedule.num_sms):  # an SM runs one task at a time, a turn apart
        mine = times[sm == s]
        mine = mine[np.argsort(mine[:, 1])]
        assert (mine[1:, 1] >= mine[:-1, 2] + turn).all()
    spans = schedule.wait_spans()[tasks["op"] != Opcode.DRAIN]
    assert spans.max() == 2, "readers of a layer's input wait on two block counters"
    for i in range(len(work)):  # a task runs a hop after each of its counters' target-th signal
        for c in range(work["wait"][i], work["wait"][i] + spans[i]):
            ends = np.sort(times[work["signal"] == c, 2])
            assert times[i, 1] >= ends[work["target"][i] - 1] + hop
    # the queues' tasks are claimed in queue order: when their SM became free for them, or for
    # the list task before them (which claims its DRAIN's first task as it begins)
    offsets = schedule.queue_offsets
    drains = np.cumsum(tasks["op"] == Opcode.DRAIN)  # DRAIN entries before each task (all in the lists)
    in_lists = np.arange(len(work)) < offsets[0] - drains[-1]
    claimed = times[:, 0].copy()
    ahead = 0
    for s in range(schedule.num_sms):
        mine = np.flatnonzero(sm == s)
        mine = mine[np.argsort(times[mine, 1])]
        for before, task in zip(mine[:-1], mine[1:]):
            if in_lists[before] and not in_lists[task]:
                claimed[task] = times[before, 0]
                ahead += 1
    assert ahead > 0
    for q in range(len(offsets) - 1):
        rows = np.arange(offsets[q], offsets[q + 1]) - drains[-1]
        assert (np.diff(claimed[rows]) >= 0).all()
    # critical_path reads a replay like a profiled step, back to the first task
    assert critical_path_of_run(times, schedule)[0].how == START


def test_replay_takes_each_tasks_own_run_time_or_its_opcodes_mean():
    schedule = Schedule(bench.geometry("mk-small"), 4, [128, 128])
    times = timed_step(schedule)
    times[:, 2] = times[:, 1] + 1000 + np.arange(len(times))  # every task its own run time
    runs, guessed = replay_runs(schedule, schedule, times)
    assert guessed == 0
    assert (runs[schedule.tasks["op"] != Opcode.DRAIN] == times[:, 2] - times[:, 1]).all()
    other = Schedule(bench.geometry("mk-small"), 16, [2048, 2048])  # more SMs, longer rows: other splits
    runs, guessed = replay_runs(other, schedule, times)
    assert guessed > 0 and (runs[other.tasks["op"] != Opcode.DRAIN] > 0).all()
    with pytest.raises(ValueError, match="the times have"):
        replay_runs(schedule, schedule, times[:-1])


def test_a_replay_that_cannot_finish_says_so():
    schedule = Schedule(bench.geometry("mk-small"), 4, [128, 128])
    tasks = schedule.tasks.copy()
    first = np.flatnonzero(tasks["op"] == Opcode.QKV)[0]
    tasks["target"][first] += 1000  # more signals than the step will ever send
    broken = copy.copy(schedule)
    broken.tasks = tasks
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(broken, np.full(len(tasks), 1000))


def test_a_replayed_list_task_claims_its_drains_first_task_as_it_begins():
    # SM 0: a 5 us QKV tile, then DRAIN(0); SM 1: a 1 us QKV tile, then DRAIN(0); queue 0: two
    # GATE_UP tiles. Each QKV tile claims one as it begins (SM 0 first), so SM 1, free at 1 us,
    # runs the second while the first waits for SM 0, and then finds the queue dry.
    s = Schedule.__new__(Schedule)
    rows = [(Opcode.QKV, 1, 0, 0, 0, -1, 0, -1), (Opcode.DRAIN, 0, 0, 0, 0, -1, 0, -1),
            (Opcode.QKV, 1, 1, 0, 0, -1, 0, -1), (Opcode.DRAIN, 0, 0, 0, 0, -1, 0, -1),
            (Opcode.GATE_UP, 1, 0, 0, 0, -1, 0, -1), (Opcode.GATE_UP, 1, 1, 0, 0, -1, 0, -1)]
    s.config, s.tasks = bench.geometry("mk-small"), np.array(rows, dtype=TASK_DTYPE)
    s.sm_offsets = np.array([0, 2, 4], dtype=np.uint32)
    s.queue_offsets = np.array([4, 6], dtype=np.uint32)
    s.plan = {"batch": 1, "num_counters": 1}
    times = simulate(s, np.array([5_000, 0, 1_000, 0, 2_000, 2_000]), 0, 0)
    sm = times[:, 3] >> 16
    assert sm.tolist() == [0, 1, 0, 1]  # QKV, QKV, GATE_UP 0, GATE_UP 1
    assert times[2, 1:3].tolist() == [5_000, 7_000]
    assert times[3, 1:3].tolist() == [1_000, 3_000]


def test_a_replayed_reader_of_a_layers_input_waits_for_the_last_of_its_blocks():
    times = simulate(hand_made(BLOCKS), np.array([1_000, 5_000, 3_000]), 200, 0)
    assert times[2, 1] == 5_000 + 200  # not 1 us + the hop: its first block was complete then
    assert [link.task for link in critical_path_of_run(times, hand_made(BLOCKS))] == [1, 2]
    # SM 0 reaches the QKV tile at 1 us with one block complete; SM 1's OPROJ tile, after a 4 us
    # ATTN task, completes the other at 5.1 us: its signal wakes SM 0, which runs QKV a hop later
    later = hand_made([[(Opcode.OPROJ, 0, 0, -1, 0, 0), (Opcode.QKV, 1, 0, 0, 1, 2)],
                       [(Opcode.ATTN, 0, 0, -1, 0, -1), (Opcode.OPROJ, 0, 1, -1, 0, 1)]])
    times = simulate(later, np.array([1_000, 3_000, 4_000, 1_000]), 200, 100)
    assert times[3, 1:3].tolist() == [4_100, 5_100]
    assert times[1, :3].tolist() == [1_000, 5_300, 8_300]


def test_simulate_command_compares_the_replay_with_the_measured_step(tmp_path, capsys):
    schedule = Schedule(bench.geometry("mk-small"), 4, [context_bucket(100)] * 2)
    path = tmp_path / "task-times-b2-c100.npy"
    np.save(path, simulate(schedule, np.full(len(schedule.tasks), 2000), 0, 0))
    assert bench.main(["simulate", str(path), "--sms", "4", "--geometry", "mk-small", "--hop-us", "0",
                       "--turn-us", "0"]) == 0
    out = capsys.readouterr().out.splitlines()
    measured, replayed = out[1].split(" us; replayed from the measured run times ")
    assert measured.strip() == "measured " + replayed.split(" us ")[0]  # its own replay: the same length
    assert bench.main(["simulate", str(path), "--sms", "4", "--geometry", "mk-small", "--hop-us", "-1"]) == 2
    assert "--hop-us and --turn-us must be >= 0" in capsys.readouterr().err
    assert bench.main(["simulate", str(path), "--sms", "4", "--geometry", "mk-small", "--batch", "1"]) == 2
    assert "another batch, context or SM count" in capsys.readouterr().err


def test_simulate_what_if_replays_the_step_with_some_run_times_changed(tmp_path, capsys):
    schedule = Schedule(bench.geometry("mk-small"), 4, [context_bucket(100)] * 2)
    path = tmp_path / "task-times-b2-c100.npy"
    np.save(path, simulate(schedule, np.full(len(schedule.tasks), 2000), 0, 0))
    step = ["simulate", str(path), "--sms", "4", "--geometry", "mk-small"]

    def what_if(*changes: str) -> tuple[float, float]:
        assert bench.main(step + [arg for c in changes for arg in ("--what-if", c)]) == 0
        lines = capsys.readouterr().out.splitlines()
        base = float(lines[1].split("replayed from the measured run times ")[1].split(" us")[0])
        assert lines[2].startswith(f"  what if {', '.join(changes)}: replayed ")
        return base, float(lines[2].split("replayed ")[1].split(" us")[0])

    base, same = what_if("QKV=x1", "down=+0")
    assert same == base
    base, longer = what_if("QKV=+50")  # every QKV task of the 2 us ones 50 us longer, on the chain
    assert longer >= base + 50
    base, shorter = what_if("GATE_UP=x0.5", "DOWN=-1")
    assert shorter < base
    for bad, message in (("QKV", "want OP=CHANGE with OP one of NORM, QKV"), ("DRAIN=-1", "OP one of"),
                         ("QKV=x-1", "a factor >= 0"), ("QKV=fast", "microseconds to add (-1.5) or a factor"),
                         ("QKV=inf", "want a finite change")):
        assert bench.main(step + ["--what-if", bad]) == 2
        assert message in capsys.readouterr().err
    nothing = [arg for op in Opcode if op not in (Opcode.COMBINE, Opcode.DRAIN) for arg in ("--what-if", f"{op.name}=x0")]
    assert bench.main(step + ["--hop-us", "0", "--turn-us", "0"] + nothing) == 2
    assert "leaves the step no time at all" in capsys.readouterr().err


def test_saved_runs_replay_the_schedule_this_library_builds(tmp_path, capsys):
    schedule = Schedule(bench.geometry("mk-small"), 4, [context_bucket(100)] * 2)
    times = simulate(schedule, np.full(len(schedule.tasks), 2000), 300, 400)
    times[:, 2] += np.arange(len(times))  # every task its own run time
    path, runs = tmp_path / "task-times-b2-c100.npy", tmp_path / "runs.npz"
    np.save(path, times)
    step = ["--sms", "4", "--geometry", "mk-small", "--what-if", "QKV=-1"]
    assert bench.main(["simulate", str(path), "--save-runs", str(runs)] + step) == 0
    from_times = capsys.readouterr().out.splitlines()
    assert bench.main(["simulate", str(runs), "--what-if", "QKV=-1"]) == 0  # batch, context, SMs from the file
    from_runs = capsys.readouterr().out.splitlines()
    assert from_runs[0] == (f"{runs}: the run times of a step of batch 2, context 100, 4 SMs "
                            "(mk-small), on this library's schedule for it")
    assert from_runs[1:] == from_times[1:]  # the same tasks, the same schedule: the same replays
    saved = dict(np.load(runs))
    assert saved["keys"].shape == (len(times), 5) and (saved["runs"] == times[:, 2] - times[:, 1]).all()

    assert bench.main(["simulate", str(runs), "--save-runs", str(tmp_path / "again.npz")]) == 2
    assert "--save-runs reads a task-times .npy" in capsys.readouterr().err
    (tmp_path / "junk.npz").write_text("not numpy")
    assert bench.main(["simulate", str(tmp_path / "junk.npz")]) == 2
    assert "not the run times of `simulate --save-runs`" in capsys.readouterr().err
    # a library whose tiles differ would read the same keys as other tasks
    other = {**saved, "tiles": json.dumps({**json.loads(str(saved["tiles"])), "moe_cols": 48})}
    np.savez(tmp_path / "other.npz", **other)
    assert bench.main(["simulate", str(tmp_path / "other.npz")]) == 2
    err = capsys.readouterr().err
    assert "this library tiles the step otherwise (moe_cols 48 -> " in err and "are of other tasks" in err
