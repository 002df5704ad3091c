"""The replay with shared bandwidth (northmk.bench_fluid, `python -m northmk.bench fluid`): with caps
that never bind it is bench_simulate's replay; the DRAM and SM caps bound the step from below;
several executors per SM run their own lists of a schedule built for them."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from northmk import bench
from northmk.bench_critical import context_bucket
from northmk.config import DENSE
from northmk.bench_fluid import fixed_parts, replay, schedule_bytes, step_us, used_slots
from northmk.bench_simulate import simulate
from northmk.bench_timeline import task_bytes
from northmk.megakernel import Opcode, Schedule

from .test_bench_critical import BLOCKS, hand_made

WIDE = 1e9  # bytes per ns: a cap that never binds


def schedule_of(lists: int) -> Schedule:
    return Schedule(bench.geometry("mk-small"), lists, [128, 128])


def parts(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """Fixed parts and bytes per task: a few us and a few hundred KB, distinct per task."""
    n = len(schedule.tasks)
    rng = np.random.default_rng(0)
    fixed = rng.integers(500, 3000, n).astype(np.float64)
    nbytes = np.where(schedule.tasks["op"] == Opcode.NORM, 0, rng.integers(50_000, 400_000, n))
    return fixed, nbytes


def test_with_caps_that_never_bind_it_is_the_timed_replay():
    schedule = schedule_of(4)
    fixed, nbytes = parts(schedule)
    rate = 40.0  # each executor streams alone at 40 GB/s: a task takes fixed + bytes / 40
    fluid = replay(schedule, fixed, nbytes, 4, 1, rate, WIDE, WIDE, 300, 400)
    timed = simulate(schedule, np.round(fixed + nbytes / rate).astype(np.int64), 300, 400)
    assert fluid.shape == timed.shape
    assert (fluid[:, 3] == timed[:, 3]).all()  # the same tasks on the same lists
    assert np.abs(fluid[:, 1:3] - timed[:, 1:3]).max() <= 16  # ns: only rounding apart


def test_a_reader_of_a_layers_input_waits_for_the_last_of_its_blocks():
    # test_bench_critical's BLOCKS: the QKV tile's first input block is complete at 1 us, its
    # second at 5 us; and an executor held at the tile is woken by its second counter's signal
    times = replay(hand_made(BLOCKS), np.array([1_000.0, 5_000.0, 3_000.0]), np.zeros(3), 3, 1, 40.0, WIDE, WIDE,
                   200, 0)
    assert times[2, 1] == 5_000 + 200
    later = hand_made([[(Opcode.OPROJ, 0, 0, -1, 0, 0), (Opcode.QKV, 1, 0, 0, 1, 2)],
                       [(Opcode.ATTN, 0, 0, -1, 0, -1), (Opcode.OPROJ, 0, 1, -1, 0, 1)]])
    times = replay(later, np.array([1_000.0, 3_000.0, 4_000.0, 1_000.0]), np.zeros(4), 2, 1, 40.0, WIDE, WIDE, 200, 100)
    assert times[1, :3].tolist() == [1_000, 5_300, 8_300]
    assert (times == simulate(later, np.array([1_000, 3_000, 4_000, 1_000]), 200, 100)).all()


def test_dram_and_sm_caps_bound_the_step_from_below():
    schedule = schedule_of(4)
    fixed, nbytes = parts(schedule)
    work = schedule.tasks["op"] != Opcode.DRAIN
    free = step_us(replay(schedule, fixed, nbytes, 4, 1, 40.0, WIDE, WIDE, 0, 0))
    dram = 20.0  # less than the four executors' 160 GB/s
    capped = step_us(replay(schedule, fixed, nbytes, 4, 1, 40.0, WIDE, dram, 0, 0))
    assert capped > free
    assert capped * 1e3 >= nbytes[work].sum() / dram * (1 - 1e-9)
    # two executors of one SM share its cap: the SM streams no faster than the cap however many run
    two = schedule_of(8)
    fixed2, nbytes2 = parts(two)
    times = replay(two, np.zeros(len(two.tasks)), nbytes2, 4, 2, 40.0, 40.0, WIDE, 0, 0)
    sm = (times[:, 3] >> 16) % 4
    per_sm = np.bincount(sm, weights=nbytes2[two.tasks["op"] != Opcode.DRAIN], minlength=4)
    assert step_us(times) * 1e3 >= per_sm.max() / 40.0 * (1 - 1e-9)
    wider = replay(two, np.zeros(len(two.tasks)), nbytes2, 4, 2, 40.0, 80.0, WIDE, 0, 0)
    assert step_us(wider) < step_us(times)


def test_a_cap_per_task_is_each_tasks_own():
    schedule = schedule_of(4)
    fixed, nbytes = parts(schedule)
    one = replay(schedule, fixed, nbytes, 4, 1, 40.0, WIDE, 100.0, 300, 400)
    same = replay(schedule, fixed, nbytes, 4, 1, np.full(len(schedule.tasks), 40.0), WIDE, 100.0, 300, 400)
    assert (one == same).all()
    ops = schedule.tasks["op"]
    norm = np.where(ops == Opcode.NORM, 5.0, 40.0)  # NORM tasks stream nothing: their cap is never used
    assert (replay(schedule, fixed, nbytes, 4, 1, norm, WIDE, 100.0, 300, 400) == one).all()
    qkv = np.where(ops == Opcode.QKV, 4.0, 40.0)  # QKV's streams at a tenth: its tasks run longer
    slow = replay(schedule, fixed, nbytes, 4, 1, qkv, WIDE, 100.0, 300, 400)
    mine = schedule.tasks[ops != Opcode.DRAIN]["op"] == Opcode.QKV
    run = lambda t: t[:, 2] - t[:, 1]  # noqa: E731
    assert (run(slow)[mine] > run(one)[mine]).all()
    with pytest.raises(ValueError, match="rates must be > 0"):
        replay(schedule, fixed, nbytes, 4, 1, np.where(ops == Opcode.QKV, 0.0, 40.0))


def test_a_task_that_waits_streams_ahead_what_its_ring_holds():
    schedule = schedule_of(4)
    fixed, nbytes = parts(schedule)
    work = schedule.tasks["op"] != Opcode.DRAIN
    plain = replay(schedule, fixed, nbytes, 4, 1, 40.0, WIDE, WIDE, 300, 400)
    none = np.zeros(len(schedule.tasks), dtype=bool)
    assert (replay(schedule, fixed, nbytes, 4, 1, 40.0, WIDE, WIDE, 300, 400, none, 1e9, 500.0) == plain).all()
    everyone = np.ones(len(schedule.tasks), dtype=bool)
    ahead = replay(schedule, fixed, nbytes, 4, 1, 40.0, WIDE, WIDE, 300, 400, everyone, 1e12, 0.0)
    # the stream ahead runs from the task's take to its bytes' turn, half its fixed part in: a task
    # that waited (longer than a turn and a hop: its counter was not there when it was taken) and
    # whose wait and that half outlasted its whole stream runs only its fixed part
    blocked = lambda t: t[:, 1] - t[:, 0] > 300 + 400  # noqa: E731
    run, waited = ahead[:, 2] - ahead[:, 1], ahead[:, 1] - ahead[:, 0] + fixed[work] / 2
    done = blocked(ahead) & (nbytes[work] > 0) & (waited >= nbytes[work] / 40.0 + 16)
    assert done.sum() > 3
    assert np.abs(run[done] - fixed[work][done]).max() <= 16
    # a bounded ring: at most its bytes ahead, the rest after the wait
    ring = 20_000.0
    part = replay(schedule, fixed, nbytes, 4, 1, 40.0, WIDE, WIDE, 300, 400, everyone, ring, 0.0)
    run, waited = part[:, 2] - part[:, 1], part[:, 1] - part[:, 0] + fixed[work] / 2
    full = blocked(part) & (nbytes[work] > ring) & (waited >= ring / 40.0 + 16)
    assert full.sum() > 3
    assert np.abs(run[full] - fixed[work][full] - (nbytes[work][full] - ring) / 40.0).max() <= 16
    # and the first round trip saved where it streamed ahead
    saved = replay(schedule, fixed, nbytes, 4, 1, 40.0, WIDE, WIDE, 300, 400, everyone, ring, 400.0)
    assert step_us(saved) < step_us(part)
    with pytest.raises(ValueError, match="streamed ahead"):
        replay(schedule, fixed, nbytes, 4, 1, 40.0, WIDE, WIDE, 300, 400, everyone, -1.0)


def test_fixed_parts_are_the_run_less_the_stream_at_the_cap():
    schedule = schedule_of(4)
    fixed, nbytes = parts(schedule)
    work = schedule.tasks["op"] != Opcode.DRAIN
    times = simulate(schedule, np.round(fixed + nbytes / 40.0).astype(np.int64), 0, 0)
    got = fixed_parts(schedule, times, nbytes[work], 40.0, quantile=0.0)
    ops = schedule.tasks["op"][work]
    for op, ns in got.items():
        assert ns == pytest.approx(fixed[work][ops == op].min(), abs=1.0)
    with pytest.raises(ValueError, match="quantile"):
        fixed_parts(schedule, times, nbytes[work], 40.0, quantile=2.0)


def test_a_slot_unused_in_the_profiled_step_reads_nothing_on_any_schedule():
    config = bench.geometry("mk-small")
    schedule = Schedule(config, 4, [128])
    work = schedule.tasks[schedule.tasks["op"] != Opcode.DRAIN]
    times = simulate(schedule, np.full(len(schedule.tasks), 4000), 0, 0)
    short = np.isin(work["op"], (Opcode.GATE_UP, Opcode.DOWN)) & (work["y"] == 1)
    times[short, 2] = times[short, 1] + 500  # slot 1 picked by no row: its tasks return at once
    profiled = task_bytes(config, schedule, 128, times)
    used = used_slots(config, schedule, profiled)
    assert used and all(slot != 1 for _, slot in used)
    assert (schedule_bytes(config, schedule, 128, used)[schedule.tasks["op"] != Opcode.DRAIN] == profiled).all()
    other = Schedule(config, 8, [128])  # other tiles, the same slots
    theirs = schedule_bytes(config, other, 128, used)
    sparse = np.isin(other.tasks["op"], (Opcode.GATE_UP, Opcode.DOWN)) & \
        np.array([config.mlp_types[int(layer)] != DENSE for layer in other.tasks["layer"]])
    assert (theirs[sparse & (other.tasks["y"] == 1)] == 0).all() and theirs[sparse & (other.tasks["y"] == 0)].min() > 0


def test_a_replay_that_does_not_fit_or_cannot_finish_says_so():
    schedule = schedule_of(4)
    fixed, nbytes = parts(schedule)
    with pytest.raises(ValueError, match="lists, not 4 SMs x 2 executors"):
        replay(schedule, fixed, nbytes, 4, 2)
    with pytest.raises(ValueError, match="rates must be > 0"):
        replay(schedule, fixed, nbytes, 4, 1, 0.0)
    tasks = schedule.tasks.copy()
    tasks["target"][np.flatnonzero(tasks["op"] == Opcode.QKV)[0]] += 1000
    broken = copy.copy(schedule)
    broken.tasks = tasks
    with pytest.raises(RuntimeError, match="deadlock"):
        replay(broken, fixed, nbytes, 4)


def test_fluid_command_compares_a_schedule_for_two_executors_per_sm(tmp_path, capsys):
    schedule = Schedule(bench.geometry("mk-small"), 4, [context_bucket(100)] * 2)
    path = tmp_path / "task-times-b2-c100.npy"
    np.save(path, simulate(schedule, np.full(len(schedule.tasks), 4000), 500, 700))
    step = ["fluid", str(path), "--sms", "4", "--geometry", "mk-small"]
    assert bench.main(step) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("  fixed parts (us): NORM ")
    assert out[2].startswith("  measured ") and "replayed with shared bandwidth" in out[2]
    assert len(out) == 3
    assert bench.main(step + ["--executors", "2", "--their-executor-gbs", "30"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3].startswith("  2 executors per SM (a schedule for 8 lists, each streaming at most 30 GB/s")
    assert "tok/s against the replay of one" in out[3]
    assert bench.main(step + ["--their-fixed", "0"]) == 0  # no fixed parts: a shorter step
    last = capsys.readouterr().out.splitlines()[-1]
    assert "fixed parts x0" in last and float(last.split("us, ")[1].split("%")[0]) > 0
    assert bench.main(step + ["--what-if", "QKV=x0", "--what-if", "NORM=-0.5"]) == 0  # one opcode's, then another's
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("  1 executor per SM") and "fixed parts x1, QKV=x0, NORM=-0.5)" in last
    assert float(last.split("us, ")[1].split("%")[0]) > 0
    assert bench.main(step + ["--what-if", "FOO=x2"]) == 2
    assert "want OP=CHANGE" in capsys.readouterr().err
    assert bench.main(step + ["--sm-gbs", "1000", "--op-gbs", "GATE_UP=90", "--op-gbs", "down=90"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "fixed parts x1, GATE_UP at 90 GB/s, DOWN at 90 GB/s)" in last
    assert float(last.split("us, ")[1].split("%")[0]) > 0  # faster expert streams: a shorter step
    for bad, says in (("FOO=9", "want OP=GBS"), ("QKV=fast", "a rate in GB/s"), ("QKV=0", "a finite rate > 0")):
        assert bench.main(step + ["--op-gbs", bad]) == 2
        assert says in capsys.readouterr().err
    assert bench.main(step + ["--ahead-kb", "32", "--ahead-ops", "qkv,Router", "--ahead-saves-us", "1"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "fixed parts x1, 32 KB ahead of a wait (QKV/ROUTER), 1 us less fixed part)" in last
    for bad, says in ((["--ahead-kb", "-1"], "must be >= 0"), (["--ahead-ops", "QKV,FOO"], "FOO is not one of"),
                      (["--ahead-ops", "QKV,"], "an empty name is not one of")):
        assert bench.main(step + bad) == 2
        assert says in capsys.readouterr().err
    assert bench.main(step + ["--executors", "0"]) == 2
    assert "--executors must be >= 1" in capsys.readouterr().err
    assert bench.main(step + ["--hop-us", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err
