"""The DRAM timeline of a profiled step (northmk.bench_timeline, `python -m northmk.bench
timeline`): each task's bytes from the schedule's tiles and the kernel's attention cut, and their
spread over time."""

from __future__ import annotations

import numpy as np
import pytest

from northmk import bench
from northmk.bench_critical import context_bucket
from northmk.bench_timeline import bandwidth, report, split_pages, task_bytes
from northmk.config import DENSE, SLIDING
from northmk.megakernel import Opcode, Schedule

from .test_bench_critical import timed_step


def test_split_pages_follow_the_kernels_cut():
    north = bench.geometry("north")  # layer 0 full, layer 1 sliding (4096 keys)
    assert north.layer_types[1] == SLIDING and north.layer_types[0] != SLIDING
    assert split_pages(north, 0, 8191, 0, 1) == 128
    assert split_pages(north, 1, 8191, 0, 1) == 64  # keys 4096..8191
    assert [split_pages(north, 1, 8191, s, 2) for s in range(2)] == [32, 32]
    assert sum(split_pages(north, 0, 100, s, 16) for s in range(16)) == 2  # more splits than pages
    assert split_pages(north, 1, 4200, 0, 1) == 65  # keys 105..4200: pages 1..65


def test_task_bytes_cover_each_matrix_once_and_the_live_pages():
    config = bench.geometry("mk-small")
    context, rows = 300, 2
    schedule = Schedule(config, 4, [context_bucket(context)] * rows)
    times = timed_step(schedule)  # every task 1 us
    tasks = schedule.tasks[schedule.tasks["op"] != Opcode.DRAIN]
    c = config
    H, Q, KV = c.hidden_size, c.q_size, c.kv_size
    counted = task_bytes(config, schedule, context, times, min_run_us=0.0)
    idle = task_bytes(config, schedule, context, times, min_run_us=1.5)
    for layer in range(c.num_layers):
        mine = tasks["layer"] == layer
        of = lambda op: int(counted[mine & (tasks["op"] == op)].sum())  # noqa: E731
        assert of(Opcode.QKV) == (Q + 2 * KV) * H * 2
        assert of(Opcode.OPROJ) == H * Q * 2
        live = sum(split_pages(c, layer, context - 1, 0, 1) for _ in range(rows * c.num_kv_heads))
        assert of(Opcode.ATTN) == live * 2 * 64 * c.head_dim * 2
        if c.mlp_types[layer] == DENSE:
            assert of(Opcode.GATE_UP) == 2 * c.dense_intermediate_size * H * 2
            assert of(Opcode.DOWN) == H * c.dense_intermediate_size * 2
        else:
            assert of(Opcode.ROUTER) == c.num_experts * H * 2
            slots = schedule.plan["expert_slots"]
            assert of(Opcode.GATE_UP) == slots * 2 * c.moe_intermediate_size * H * 2
            # 1 us tasks under --min-us 1.5 count as unused slots' and read nothing; dense ones still do
            assert int(idle[mine & (tasks["op"] == Opcode.GATE_UP)].sum()) == 0
    assert int(counted[tasks["op"] == Opcode.LM_HEAD].sum()) == c.vocab_size * H * 2
    with pytest.raises(ValueError, match="another batch, context or SM count"):
        task_bytes(config, schedule, context, times[:-1])


def test_bandwidth_spreads_each_tasks_bytes_over_its_run():
    times = np.array([[0, 0, 10_000, 0], [0, 2_500, 7_500, 0]], dtype=np.int64)
    edges, tbps = bandwidth(times, np.array([10_000_000, 5_000_000]), 5.0)
    assert list(edges) == [0.0, 5.0, 10.0]
    # 1e7 bytes over 10 us and 5e6 over 5 us (half in each bin): 1.5e6 bytes per us in both bins
    assert tbps[:2] == pytest.approx([1.5, 1.5]) and tbps[2] == 0
    assert (tbps * 5e-6 * 1e12).sum() == pytest.approx(15_000_000)
    with pytest.raises(ValueError, match="longer than 0"):
        bandwidth(times, np.array([1, 1]), 0)


def test_timeline_command_lists_a_layers_bins(tmp_path, capsys):
    config = bench.geometry("mk-small")
    schedule = Schedule(config, 4, [context_bucket(300)] * 2)
    path = tmp_path / "task-times-b2-c300.npy"
    np.save(path, timed_step(schedule))
    assert bench.main(["timeline", str(path), "--sms", "4", "--geometry", "mk-small", "--bin-us", "1",
                       "--layer", "2", "--min-us", "0"]) == 0
    out = capsys.readouterr().out
    assert "GB streamed in" in out and "layer 2:" in out and "QKV, ATTN, OPROJ, GATE_UP, DOWN, idle" in out
    assert bench.main(["timeline", str(path), "--sms", "4", "--geometry", "mk-small", "--layer", "9"]) == 2
    assert "--layer must be one of" in capsys.readouterr().err
    text = report(config, schedule, 300, timed_step(schedule), bin_us=2.0)
    assert text.splitlines()[0].endswith("(2 us bins):")
