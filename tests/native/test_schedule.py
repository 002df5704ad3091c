"""The decode step's task schedule: per-SM lists and the work queues the SMs drain, proven
safe on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from northmk.config import DENSE, ModelConfig
from northmk.megakernel import (
    BLOCK_COLS, MAX_SPLITS, TASK_DTYPE, Opcode, Schedule, check_schedule, unsupported_reason, wait_spans,
    waits_in_run,
)
from northmk.megakernel_interpreter import execution_order
from northmk.native import NativeError


def north(num_layers: int = 49, **overrides) -> ModelConfig:
    raw = {
        "model_type": "cohere2_moe", "hidden_size": 2048, "num_hidden_layers": num_layers,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 262144,
        "num_experts": 128, "num_experts_per_tok": 8, "intermediate_size": 768,
        "prefix_dense_intermediate_size": 3072, "first_k_dense_replace": 1, "sliding_window": 4096,
        "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "expert_selection_fn": "sigmoid", "norm_topk_prob": False,
        "logit_scale": 1.0, "tie_word_embeddings": True,
    }
    raw.update(overrides)
    return ModelConfig.from_dict(raw)


SMALL = north(num_layers=5)


def counts(s: Schedule) -> dict[Opcode, int]:
    ops, n = np.unique(s.tasks["op"], return_counts=True)
    return {Opcode(int(o)): int(c) for o, c in zip(ops, n)}


def check(config: ModelConfig, s: Schedule) -> None:
    check_schedule(config, s.plan, s.tasks, s.sm_offsets, s.queue_offsets)


def test_full_geometry_schedule_passes_the_checker_at_every_batch():
    for batch in (1, 2, 5, 8):
        s = Schedule(north(), 132, [8192] * batch)
        check(north(), s)
        assert s.num_sms == 132
        assert s.plan["batch"] == batch
        assert s.plan["expert_slots"] == min(8 * batch, 128)
        assert s.plan["num_queues"] == s.num_queues == 49


@pytest.mark.parametrize("num_sms, lens", [(132, [1]), (132, [8192, 1, 70]), (16, [300, 70, 1]), (7, [300, 2]),
                                           (1, [64] * 3), (3, [5000] * 8)])
def test_schedules_pass_the_checker_at_other_sizes(num_sms, lens):
    for config in (SMALL, north(num_layers=3, sliding_window=128)):
        check(config, Schedule(config, num_sms, lens))


def test_lists_hold_layer_0s_tiles_then_one_drain_per_queue_then_the_lm_head():
    s = Schedule(SMALL, 8, [300, 70, 1])
    assert s.queue_offsets[0] == s.sm_offsets[-1] and s.queue_offsets[-1] == len(s.tasks)
    assert (np.diff(s.queue_offsets) > 0).all()
    for sm in range(s.num_sms):
        listed = s.tasks_of(sm)
        drains = np.flatnonzero(listed["op"] == Opcode.DRAIN)
        assert drains.tolist() == list(range(drains[0], drains[0] + 5)), "the DRAIN entries back to back"
        assert listed["x"][drains].tolist() == list(range(5)), "one DRAIN per queue, in layer order"
        drained = listed[drains]
        assert (drained["wait"] == -1).all() and (drained["signal"] == -1).all() and (drained["target"] == 0).all()
        assert (drained["y"] == 0).all() and (drained["z"] == 0).all()
        before, after = listed[:drains[0]], listed[drains[-1] + 1:]
        assert (before["layer"] == 0).all() and set(before["op"].tolist()) <= {Opcode.NORM, Opcode.QKV}
        assert set(after["op"].tolist()) <= {Opcode.LM_HEAD, Opcode.ARGMAX}
    listed = np.concatenate([s.tasks_of(sm) for sm in range(s.num_sms)])
    assert set(np.unique(listed["op"])) == {Opcode.NORM, Opcode.QKV, Opcode.DRAIN, Opcode.LM_HEAD, Opcode.ARGMAX}


def test_queue_l_holds_gate_up_attention_down_and_oproj_then_the_next_layers_router_and_qkv():
    s = Schedule(SMALL, 8, [300, 70, 1])
    p = s.plan
    for layer in range(5):
        q = s.queue(layer)
        runs = [(int(op), int(l)) for i, (op, l) in enumerate(zip(q["op"], q["layer"]))
                if i == 0 or (op, l) != (q["op"][i - 1], q["layer"][i - 1])]
        # The attention splits after the first num_sms - splits GATE_UP tasks (none here: 8 SMs).
        tail = [(Opcode.ROUTER, layer + 1), (Opcode.QKV, layer + 1)] if layer < 4 else []
        assert runs == [(Opcode.ATTN, layer), (Opcode.GATE_UP, layer), (Opcode.DOWN, layer),
                        (Opcode.OPROJ, layer)] + tail
        q = q[q["layer"] == layer]
        for op in (Opcode.GATE_UP, Opcode.DOWN):  # slot-major, then tile
            of = q[q["op"] == op]
            assert [(int(y), int(x)) for x, y in zip(of["x"], of["y"])] == sorted(zip(of["y"].tolist(), of["x"].tolist()))
            assert len(set(of["y"].tolist())) == (1 if layer == 0 else p["expert_slots"])
        attn = q[q["op"] == Opcode.ATTN]
        keys = [(int(r), int(h), int(z) & 0xFF) for r, h, z in zip(attn["x"], attn["y"], attn["z"])]
        assert keys == sorted(keys) and {k[0] for k in keys} == {0, 1, 2}
        oproj = q[q["op"] == Opcode.OPROJ]
        assert oproj["x"].tolist() == list(range(len(oproj)))


@pytest.mark.parametrize("lens", [[8192], [300, 70, 1], [64] * 8])
def test_writers_signal_their_column_block_and_readers_wait_on_every_block(lens):
    c = north(num_layers=4)
    s = Schedule(c, 132, lens)
    t, p, blocks = s.tasks, s.plan, 2048 // BLOCK_COLS
    rows = {Opcode.NORM: p["norm_cols"], Opcode.OPROJ: p["oproj_rows"]}

    def first_column(task) -> int:
        op = int(task["op"])
        per = rows.get(op) or (p["dense_down_rows"] if int(task["layer"]) == 0 else p["moe_down_rows"])
        assert BLOCK_COLS % per == 0, (op, per)
        return int(task["x"]) * per

    for layer in range(5):  # layer 4: the LM head's input
        writers = t[(t["op"] == Opcode.NORM)] if layer == 0 else \
            t[np.isin(t["op"], (Opcode.OPROJ, Opcode.DOWN)) & (t["layer"] == layer - 1)]
        base = int(writers["signal"].min())
        assert [int(w["signal"]) - base for w in writers] == [first_column(w) // BLOCK_COLS for w in writers]
        per_block = np.bincount(writers["signal"] - base, minlength=blocks)
        assert len(per_block) == blocks and (per_block == per_block[0]).all()
        readers = t[np.isin(t["op"], (Opcode.QKV, Opcode.ROUTER)) & (t["layer"] == layer)] if layer < 4 else \
            t[t["op"] == Opcode.LM_HEAD]
        assert len(readers) and (readers["wait"] == base).all() and (readers["target"] == per_block[0]).all()
        assert (s.wait_spans()[np.isin(t["op"], (Opcode.QKV, Opcode.LM_HEAD))] == blocks).all()


def test_every_sm_helps_drain_the_queues():
    s = Schedule(SMALL, 8, [300, 70, 1])
    order = execution_order(s)
    assert sorted(i for _, i in order) == [i for i in range(len(s.tasks)) if s.tasks["op"][i] != Opcode.DRAIN]
    queued = [sm for sm, i in order if i >= s.queue_offsets[0]]
    assert len(set(queued)) > 1


def test_every_stage_has_the_tiles_the_geometry_needs():
    c = north()
    s = Schedule(c, 132, [100, 5000])
    n = counts(s)
    p = s.plan
    assert p["norm_cols"] == 32 and p["norm_tiles"] == 2048 // 32
    assert p["router_rows"] == 16 and p["router_tiles"] == 128 // 16
    # NORM tiles only write layer 0's input; later layers' inputs are sums their predecessors add into
    assert n[Opcode.NORM] == p["norm_tiles"] and Opcode.FINAL_NORM not in n
    assert n[Opcode.ROUTER] == 48 * p["router_tiles"]  # layer 0 is dense
    assert n[Opcode.QKV] == 49 * -(-(4096 + 2 * 512) // p["qkv_rows"])
    assert n[Opcode.OPROJ] == 49 * -(-2048 // p["oproj_rows"])
    assert Opcode.COMBINE not in n, "retired in v0.3: the last attention split merges"
    assert n[Opcode.ARGMAX] == 2
    assert n[Opcode.LM_HEAD] == p["lm_tiles"] == -(-262144 // p["lm_rows"])
    moe_gate_up = 48 * p["expert_slots"] * -(-768 // p["moe_cols"])
    assert n[Opcode.GATE_UP] == moe_gate_up + -(-3072 // p["dense_cols"])
    for layer in (0, 7):  # each NORM tile once (layer 0), each ROUTER tile once per sparse layer
        of_layer = s.tasks[s.tasks["layer"] == layer]
        norms = sorted(of_layer["x"][of_layer["op"] == Opcode.NORM])
        assert norms == (list(range(p["norm_tiles"])) if layer == 0 else [])
        assert sorted(of_layer["x"][of_layer["op"] == Opcode.ROUTER]) == ([] if layer == 0 else list(range(8)))


@pytest.mark.parametrize("num_sms, lens", [(132, [8192] * 8), (132, [1]), (7, [300, 2]), (1, [64] * 3)])
def test_tiles_are_tensor_core_multiples_within_the_kernels_limits(num_sms, lens):
    p = Schedule(north(num_layers=2), num_sms, lens).plan
    limits = {"qkv_rows": 128, "oproj_rows": 128, "moe_cols": 128, "moe_down_rows": 256, "dense_cols": 128,
              "dense_down_rows": 128, "lm_rows": 512, "router_rows": 16}
    for name, most in limits.items():
        assert p[name] % 16 == 0 and 16 <= p[name] <= most, (name, p[name])


def test_about_one_task_per_sm_per_stage():
    p = Schedule(north(num_layers=2), 132, [100] * 8).plan
    assert -(-(4096 + 2 * 512) // p["qkv_rows"]) <= 132 < 2 * -(-(4096 + 2 * 512) // p["qkv_rows"])
    assert p["oproj_rows"] == 16  # 2048 rows over 132 SMs: the smallest tile
    assert -(-64 * 768 // p["moe_cols"]) >= 132 // 2


@pytest.mark.parametrize("batch, cols", [(1, 32), (2, 64), (8, 128)])
def test_expert_tiles_are_sized_for_one_and_a_half_times_the_sms(batch, cols):
    # Attention splits hold SMs while the experts stream: the tiles left over for a second
    # round must be small. From batch 4 the 128-column cap decides.
    p = Schedule(north(num_layers=2), 132, [4096] * batch).plan
    assert p["moe_cols"] == cols
    tiles = p["expert_slots"] * -(-768 // p["moe_cols"])
    assert tiles > 132 if batch <= 2 else p["moe_cols"] == 128


def test_tasks_are_spread_evenly_over_the_sms():
    s = Schedule(north(), 132, [8192] * 8)
    per_sm = np.diff(s.sm_offsets)
    assert per_sm.max() - per_sm.min() <= 1 * 49 * 8 + 8  # round-robin: at most one extra per stage


def test_longer_rows_get_more_attention_splits_and_short_rows_one():
    s = Schedule(north(), 132, [1, 8192])
    attn = s.tasks[s.tasks["op"] == Opcode.ATTN]
    full_layer = attn[attn["layer"] == 4]  # layer 4 is full attention
    splits = {int(r): int(z >> 8) for r, z in zip(full_layer["x"], full_layer["z"])}
    assert splits[0] == 1 and splits[1] > 1
    sliding = attn[(attn["layer"] == 5) & (attn["x"] == 1)]
    assert int(sliding["z"][0] >> 8) <= splits[1], "a sliding layer sees at most the window"
    assert (attn["z"] >> 8).max() <= MAX_SPLITS
    for (r, h), n in {(int(r), int(h)): int(z >> 8) for r, h, z in zip(*(full_layer[f] for f in "xyz"))}.items():
        pair = full_layer[(full_layer["x"] == r) & (full_layer["y"] == h)]
        assert sorted(pair["z"] & 0xFF) == list(range(n)), "each pair has all its splits, the last one merges"


def test_a_short_row_gets_attention_splits_of_about_ten_pages():
    # One row of 8192 keys over 132 SMs: 128 pages per kv head over half the SMs would give
    # 8-page splits, and a split's fixed work (queries, partials, ticket) is worth ~9 pages:
    # at most ceil(pages / 10) splits: 13 of 9 or 10 pages (7 of 9 or 10 in the window).
    s = Schedule(north(num_layers=8), 132, [8192])
    attn = s.tasks[s.tasks["op"] == Opcode.ATTN]
    assert set((attn[attn["layer"] == 4]["z"] >> 8).tolist()) == {13}
    assert set((attn[attn["layer"] == 5]["z"] >> 8).tolist()) == {7}  # the 4096-key window
    # Rows enough to fill half the SMs get longer splits (the other half streams experts): 8
    # rows x 4 kv heads x 128 pages over 66 SMs is 63 pages a split, 3 splits a pair (96
    # tasks); the window's 64 pages 32 a split, 2 (64 tasks).
    many = Schedule(north(num_layers=8), 132, [8192] * 8).tasks
    attn = many[many["op"] == Opcode.ATTN]
    assert set((attn[attn["layer"] == 4]["z"] >> 8).tolist()) == {3} and (attn["layer"] == 4).sum() == 96
    assert set((attn[attn["layer"] == 5]["z"] >> 8).tolist()) == {2} and (attn["layer"] == 5).sum() == 64


def test_long_rows_give_attention_a_share_of_the_sms_by_its_bytes():
    # A full layer's keys and values against its experts' weights (8 slots x 3 x 2048 x 768
    # bf16, 75 MB at batch 1): at 32768 keys (67 MB) attention keeps half the SMs, 64 splits of
    # 16 a pair as before; at 65536 (134 MB) 64% of 132 SMs, 84 splits; at 131072 (268 MB) 78%,
    # 104 splits of 80 pages, 26 a pair. The window's splits do not change.
    def splits(lens: list[int], layer: int) -> tuple[int, set[int]]:
        attn = Schedule(north(num_layers=8), 132, lens).tasks
        attn = attn[(attn["op"] == Opcode.ATTN) & (attn["layer"] == layer)]
        return len(attn), set((attn["z"] >> 8).tolist())

    assert splits([32768], 4) == (64, {16})
    assert splits([65536], 4) == (84, {21})
    assert splits([131072], 4) == (104, {26})
    assert splits([131072], 5) == splits([8192], 5) == (28, {7})
    # 8 rows (64 slots, 604 MB): at 65536 keys (1.07 GB) the share, 84 SMs, still rounds to 3 splits
    # a pair (96) as half the SMs does; at 131072, 103 SMs, to 4 (128).
    assert splits([65536] * 8, 4) == (96, {3})
    assert splits([131072] * 8, 4) == (128, {4})


def test_oproj_waits_for_every_attention_split_of_its_layer():
    s = Schedule(SMALL, 16, [300, 70, 1])
    for layer in range(5):
        of_layer = s.tasks[s.tasks["layer"] == layer]
        attn, oproj = of_layer[of_layer["op"] == Opcode.ATTN], of_layer[of_layer["op"] == Opcode.OPROJ]
        assert set(attn["signal"]) == set(oproj["wait"]) and len(set(oproj["wait"])) == 1
        assert (oproj["target"] == len(attn)).all()


def test_sparse_gate_up_waits_for_every_router_tile_and_norm_for_nothing_at_layer_0():
    s = Schedule(SMALL, 16, [300, 70, 1])
    t = s.tasks
    router = t[(t["op"] == Opcode.ROUTER) & (t["layer"] == 2)]
    gate_up = t[(t["op"] == Opcode.GATE_UP) & (t["layer"] == 2)]
    assert len(router) == s.plan["router_tiles"] and set(gate_up["wait"]) == set(router["signal"])
    assert (gate_up["target"] == len(router)).all()
    dense = t[(t["op"] == Opcode.GATE_UP) & (t["layer"] == 0)]
    norm0 = t[(t["op"] == Opcode.NORM) & (t["layer"] == 0)]
    assert set(dense["wait"]) == {norm0["signal"].min()}, "the first of the input's block counters"
    assert set(norm0["signal"]) == set(range(norm0["signal"].min(), norm0["signal"].min() + 2048 // BLOCK_COLS))
    assert (dense["target"] == BLOCK_COLS // s.plan["norm_cols"]).all(), "the NORM tiles of one block"
    assert (norm0["wait"] == -1).all()


def test_wait_targets_count_all_signallers():
    s = Schedule(SMALL, 16, [300, 70, 1])
    signals = np.bincount(s.tasks["signal"][s.tasks["signal"] >= 0], minlength=s.plan["num_counters"])
    spans = s.wait_spans()
    waits, spans = s.tasks[spans > 0], spans[spans > 0]
    assert set(spans.tolist()) == {1, 2048 // BLOCK_COLS}
    for b in range(2048 // BLOCK_COLS):  # each counter of a block waiter's span
        at = spans > b
        assert (waits["target"][at] == signals[waits["wait"][at] + b]).all()
    work = s.tasks[s.tasks["op"] != Opcode.DRAIN]
    assert (work["wait"] < 0).sum() == s.plan["norm_tiles"], "only layer 0's norm tiles start without waiting"


# A mutation takes and returns (tasks, sm_offsets, queue_offsets).
def _mutated(s: Schedule, mutate) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return mutate(s.tasks.copy(), s.sm_offsets.copy(), s.queue_offsets.copy())


@pytest.mark.parametrize(
    "name, mutate, message",
    [
        ("unknown opcode", lambda t, o, q: (_set(t, 0, "op", 99), o, q), "unknown opcode"),
        ("target too high", lambda t, o, q: (_bump(t, "target", 1), o, q), "target differs"),
        ("missing task", lambda t, o, q: _remove(t, o, q, len(t) - 1), "missing task"),
        ("duplicate task", lambda t, o, q: _insert(t, o, q, 0, t[-1]), "duplicate"),
        ("reversed list", lambda t, o, q: (_reverse_sm(t, o, 0), o, q), "deadlock"),
        ("retired COMBINE", lambda t, o, q: (_set(t, int(np.flatnonzero(t["op"] == Opcode.ATTN)[0]), "op",
                                                  Opcode.COMBINE), o, q), "retired opcode COMBINE"),
        ("a router tile missing", lambda t, o, q: _drop(t, o, q, Opcode.ROUTER), "missing task op=3"),
        ("a norm tile missing", lambda t, o, q: _drop(t, o, q, Opcode.NORM), "missing task op=1"),
        ("an attention split missing", lambda t, o, q: _drop(t, o, q, Opcode.ATTN), "missing task op=4"),
        # ---- queues ----
        ("a queue task waits on a list task after its DRAIN", lambda t, o, q: _norm_after_drain(t, o, q, 3, 0),
         r"may deadlock: queue 0 #\d+ task\(op=7 .*which SM 3 #\d+ task\(op=1 .* signals after DRAIN\(0\) in its list"),
        ("a list task before the DRAIN of a queue it waits on", lambda t, o, q: _lm_head_before_drain(t, o, q, 2, 4),
         r"may deadlock: SM 2 #\d+ task\(op=10 layer=0 .*which queue 4 #\d+ .* yet it comes before DRAIN\(4\)"),
        ("a queue task waits on a block signalled after its DRAIN",
         lambda t, o, q: _block_after_drain(t, o, q, 1),
         r"may deadlock: queue 0 #\d+ task\(op=7 .* waits on counter \d+, which SM \d+ #\d+ task\(op=1 layer=0 x=8 "
         r".* signals after DRAIN\(0\) in its list"),
        ("a queue task waits on a later one of its queue", lambda t, o, q: _oproj_first(t, o, q, 2),
         r"may deadlock: queue 2 #0 task\(op=6 .*which queue 2 #\d+ task\(op=4 .* not earlier in the queue"),
        ("a queue task waits on a queue drained later", lambda t, o, q: _attention_to_next_queue(t, o, q, 1),
         r"may deadlock: queue 1 #\d+ task\(op=6 .*which queue 2 #\d+ task\(op=4 .* but DRAIN\(2\) comes after "
         r"DRAIN\(1\) in SM 0's list"),
        ("a qkv tile after its layer's DRAIN", lambda t, o, q: _qkv_after_drain(t, o, q, 4, 0),
         r"may deadlock: queue 0 #\d+ task\(op=4 .*which SM 4 #\d+ task\(op=2 layer=0 .* signals after DRAIN\(0\)"),
        ("retired FINAL_NORM", lambda t, o, q: (_set(t, int(np.flatnonzero(t["op"] == Opcode.NORM)[0]), "op",
                                                     Opcode.FINAL_NORM), o, q), "retired opcode FINAL_NORM"),
        ("a cycle within a list", lambda t, o, q: _qkv_before_norm(t, o, q, 0),
         r"deadlock possible under some claim order: a cycle of must-finish-before: SM 0 #"),
        ("a missing DRAIN", lambda t, o, q: _remove(t, o, q, _drain_index(t, o, 3, 2)),
         "SM 3's list has no DRAIN of queue 2; every list holds one DRAIN per queue"),
        ("a DRAIN twice", lambda t, o, q: _insert(t, o, q, int(o[5]), t[_drain_index(t, o, 5, 1)]),
         "SM 5's list drains queue 1 twice"),
        ("a DRAIN with a wait", lambda t, o, q: (_set(_set(t, _drain_index(t, o, 1, 0), "wait", 0),
                                                      _drain_index(t, o, 1, 0), "target", 1), o, q),
         r"DRAIN must have y = z = 0, wait = -1, target = 0 and signal = -1: SM 1 #\d+ task\(op=12"),
        ("a DRAIN with a signal", lambda t, o, q: (_set(t, _drain_index(t, o, 1, 0), "signal", 0), o, q),
         "DRAIN must have y = z = 0, wait = -1, target = 0 and signal = -1"),
        ("a DRAIN of an unknown queue", lambda t, o, q: (_set(t, _drain_index(t, o, 0, 4), "x", 5), o, q),
         r"DRAIN of unknown queue 5 \(plan.num_queues = 5\)"),
        ("a DRAIN inside a queue", lambda t, o, q: _insert(t, o, q, int(q[2]) + 1, t[_drain_index(t, o, 0, 0)]),
         r"DRAIN inside a queue \(queues hold ordinary tasks only\): queue 2 #1"),
        ("a task in a list and a queue", lambda t, o, q: _insert(t, o, q, 0, t[int(q[1])]),
         r"duplicate queue 1 #0 task\(op=\d+ .*, also at SM 0 #0"),
        ("decreasing queue offsets", lambda t, o, q: (t, o, _set_offset(q, 2, int(q[1]) - 1)),
         "queue_offsets decrease at queue 1"),
        ("queues not after the lists", lambda t, o, q: (t, o, _set_offset(q, 0, int(q[0]) - 1)),
         r"queue_offsets\[0\] must equal sm_offsets\[num_sms\]"),
    ],
)
def test_checker_rejects_broken_schedules(name, mutate, message):
    s = Schedule(SMALL, 8, [200, 3])
    check(SMALL, s)
    tasks, offsets, queue_offsets = _mutated(s, mutate)
    with pytest.raises(NativeError, match=message):
        check_schedule(SMALL, s.plan, tasks, offsets, queue_offsets)


def test_a_cycle_through_a_queue_is_found_and_reported():
    """With a sparse layer 0, only list tasks (its QKV and ROUTER tiles) wait for its NORM
    tiles. An SM whose only tiles of layer 0 are NORM tiles moves one after DRAIN(0): the
    QKV and ROUTER tiles wait for it, queue 0 waits for them, and that SM leaves DRAIN(0) only
    once queue 0 is done. No named rule sees it; the cycle goes through the whole queue."""
    config = north(num_layers=3, first_k_dense_replace=0)
    s = Schedule(config, 132, [200, 3])
    check(config, s)

    def before_drain(sm: int) -> set[int]:
        ops = s.tasks_of(sm)["op"].tolist()
        return set(ops[:ops.index(Opcode.DRAIN)])

    lone = [sm for sm in range(s.num_sms) if before_drain(sm) == {Opcode.NORM}]
    assert lone
    tasks, offsets, queue_offsets = _mutated(s, lambda t, o, q: _norm_after_drain(t, o, q, lone[0], 0))
    with pytest.raises(NativeError) as error:
        check_schedule(config, s.plan, tasks, offsets, queue_offsets)
    message = str(error.value)
    assert "deadlock possible under some claim order: a cycle of must-finish-before: " in message
    assert f"SM {lone[0]} #0 task(op=12 layer=0 x=0 " in message and f"SM {lone[0]} #1 task(op=1 layer=0 " in message
    assert "queue 0 #" in message and "may deadlock" not in message


def test_queue_offsets_that_do_not_describe_the_array_are_refused():
    s = Schedule(SMALL, 8, [200, 3])
    with pytest.raises(ValueError, match="must end at the task array's end"):
        check_schedule(SMALL, s.plan, s.tasks[:-1], s.sm_offsets, s.queue_offsets)
    with pytest.raises(ValueError, match="must end at the task array's end"):
        check_schedule(SMALL, s.plan, s.tasks, s.sm_offsets, _set_offset(s.queue_offsets.copy(), 2, len(s.tasks) + 5))
    with pytest.raises(ValueError, match=r"queue_offsets needs plan\['num_queues'\] \+ 1 = 6 entries, got 5"):
        check_schedule(SMALL, s.plan, s.tasks, s.sm_offsets, s.queue_offsets[:-1])
    with pytest.raises(NativeError, match="queue_offsets is NULL but plan->num_queues is 5"):
        check_schedule(SMALL, s.plan, s.tasks, s.sm_offsets)


def _rewire(s: Schedule, op: Opcode, layer: int, to: Opcode) -> np.ndarray:
    """The tasks with each (op, layer) task waiting on the counter `to` of that layer signals, fully."""
    tasks = s.tasks.copy()
    source = tasks[(tasks["op"] == to) & (tasks["layer"] == layer)]
    counter = int(source["signal"][0])
    target = int((tasks["signal"] == counter).sum())
    which = (tasks["op"] == op) & (tasks["layer"] == layer)
    tasks["wait"][which], tasks["target"][which] = counter, target
    return tasks


MISSED_STAGE = "does not wait for all of a stage it reads"


@pytest.mark.parametrize("op, layer, to, message", [
    (Opcode.ATTN, 1, Opcode.ROUTER, MISSED_STAGE),  # attention before q exists
    (Opcode.OPROJ, 1, Opcode.QKV, MISSED_STAGE),  # o-proj before the merged attention output
    (Opcode.GATE_UP, 2, Opcode.QKV, MISSED_STAGE),  # experts before the router logits
    # logits from layer 0's outputs, not the last layer's
    (Opcode.LM_HEAD, 0, Opcode.OPROJ,
     r"block counter \d+ \(columns 0\.\.256\) of SM \d+ #\d+ task\(op=10 .* is signalled by queue 0 #\d+ "
     r"task\(op=\d+ layer=0 .*, which does not write the input it reads"),
])
def test_checker_rejects_a_wait_on_the_wrong_stage(op, layer, to, message):
    s = Schedule(SMALL, 8, [64, 300])
    tasks = _rewire(s, op, layer, to)
    with pytest.raises(NativeError, match=message):
        check_schedule(SMALL, s.plan, tasks, s.sm_offsets, s.queue_offsets)


def test_checker_rejects_a_norm_tile_that_does_not_signal_its_block():
    s = Schedule(SMALL, 8, [64])
    tasks = s.tasks.copy()
    norm = np.flatnonzero((tasks["op"] == Opcode.NORM) & (tasks["layer"] == 0))[0]
    block = tasks["signal"][norm]
    tasks["signal"][norm] = -1  # one NORM tile's columns of the embedding go unwaited for
    tasks["target"][tasks["wait"] == block] -= 1  # block 0 is then complete, the others are not
    with pytest.raises(NativeError, match=f"target differs from the signallers of counter {block + 1} in "):
        check_schedule(SMALL, s.plan, tasks, s.sm_offsets, s.queue_offsets)


@pytest.mark.parametrize("op, layer", [(Opcode.NORM, 0), (Opcode.OPROJ, 2), (Opcode.DOWN, 3)])
def test_checker_rejects_a_writer_that_signals_another_columns_block(op, layer):
    """Two writers of a layer's input in different column blocks swap their signals: every
    count and every stage is still complete, but a reader of block 0 would read the other
    block's writer's columns before they are summed."""
    s = Schedule(SMALL, 8, [64])
    tasks = s.tasks.copy()
    writers = np.flatnonzero((tasks["op"] == op) & (tasks["layer"] == layer))
    first = writers[0]
    other = next(w for w in writers if tasks["signal"][w] != tasks["signal"][first])
    tasks["signal"][first], tasks["signal"][other] = tasks["signal"][other], tasks["signal"][first]
    with pytest.raises(NativeError, match=rf"block counter \d+ \(columns 0\.\.256\) of .* is signalled by "
                                          rf".*task\(op={int(op)} "
                                          rf"layer={layer} x={int(tasks['x'][other])} .*, which writes columns [1-9]"):
        check_schedule(SMALL, s.plan, tasks, s.sm_offsets, s.queue_offsets)


@pytest.mark.parametrize("field, value, message", [
    ("qkv_rows", 24, "qkv_rows must be a positive multiple of 16 up to 128"),
    ("oproj_rows", 144, "oproj_rows must be a positive multiple of 16 up to 128"),
    ("moe_down_rows", 272, "moe_down_rows must be a positive multiple of 16 up to 256"),
    ("oproj_rows", 48, r"oproj_rows must divide NMK_MK_BLOCK_COLS \(256\), got 48"),
    ("dense_down_rows", 96, r"dense_down_rows must divide NMK_MK_BLOCK_COLS \(256\), got 96"),
    ("lm_rows", 0, "lm_rows must be"),
    ("norm_cols", 256, "norm_cols must be 32"),
    ("norm_tiles", 1, "norm_tiles"),
    ("router_rows", 32, "router_rows must be 16"),
    ("router_tiles", 7, "router_tiles"),
    ("expert_slots", 4, "expert_slots"),
    ("lm_tiles", 3, "lm_tiles"),
    ("max_splits", 65, "max_splits"),
])
def test_checker_rejects_a_plan_the_kernel_cannot_run(field, value, message):
    s = Schedule(SMALL, 8, [64, 300])
    plan = dict(s.plan, **{field: value})
    with pytest.raises(NativeError, match=message):
        check_schedule(SMALL, plan, s.tasks, s.sm_offsets, s.queue_offsets)


def test_bad_requests_get_clear_errors():
    with pytest.raises(NativeError, match="batch"):
        Schedule(SMALL, 8, [10] * 9)
    with pytest.raises(NativeError, match="context length"):
        Schedule(SMALL, 8, [0])
    with pytest.raises(NativeError, match="num_sms"):
        Schedule(SMALL, 0, [10])
    with pytest.raises(NativeError, match="head_dim must be 128"):
        Schedule(north(num_layers=2, head_dim=64), 8, [10])


def test_wait_spans_are_the_librarys_rule():
    """A reader of a layer's input (QKV, ROUTER, a dense layer's GATE_UP, the LM head of the last
    layer's output) waits on its block counters, any other waiting task on one, a task with no
    wait on none: the rule nmk_schedule_wait_spans shares with the builder, checker and kernel."""
    rows = [(Opcode.QKV, 1, 7), (Opcode.ROUTER, 2, 7), (Opcode.GATE_UP, 0, 7), (Opcode.GATE_UP, 1, 7),
            (Opcode.LM_HEAD, SMALL.num_layers, 7), (Opcode.OPROJ, 1, 7), (Opcode.DOWN, 1, 7), (Opcode.NORM, 0, -1),
            (Opcode.QKV, 0, -1)]
    tasks = np.zeros(len(rows), dtype=TASK_DTYPE)
    tasks["op"], tasks["layer"], tasks["wait"] = zip(*rows)
    blocks = SMALL.hidden_size // BLOCK_COLS
    assert wait_spans(SMALL, tasks).tolist() == [blocks, blocks, blocks, 1, blocks, 1, 1, 0, 0]
    assert wait_spans(SMALL, tasks[:0]).tolist() == []
    # the spans of a built schedule: its group waits are exactly the checked ones (the checker
    # counts each waiter's signallers over its whole span)
    s = Schedule(SMALL, 8, [100])
    spans = s.wait_spans()
    assert set(spans.tolist()) == {0, 1, blocks}
    assert (spans[s.tasks["op"] == Opcode.LM_HEAD] == blocks).all()
    check(SMALL, s)


def test_waits_in_run_are_the_kernels_rule():
    """Up to two rows the QKV and ROUTER tiles wait for their input's blocks inside their run, and
    at any batch a sparse layer's GATE_UP polls the routing and an attention split waits for QKV
    inside its run; everything else (a dense layer's GATE_UP, a task without a wait) is waited for
    before it runs: the rule nmk_schedule_waits_in_run shares with the kernel (block_wait.hpp)."""
    rows = [(Opcode.QKV, 1, 7), (Opcode.ROUTER, 2, 7), (Opcode.GATE_UP, 1, 7), (Opcode.GATE_UP, 0, 7),
            (Opcode.LM_HEAD, SMALL.num_layers, 7), (Opcode.OPROJ, 1, 7), (Opcode.NORM, 0, -1), (Opcode.QKV, 0, -1),
            (Opcode.ATTN, 1, 7)]
    tasks = np.zeros(len(rows), dtype=TASK_DTYPE)
    tasks["op"], tasks["layer"], tasks["wait"] = zip(*rows)
    assert SMALL.mlp_types[0] == DENSE and SMALL.mlp_types[1] != DENSE
    for batch in (1, 2):
        assert waits_in_run(SMALL, batch, tasks).tolist() == [True, True, True, False, False, False, False, False, True]
    for batch in (3, 8):
        assert waits_in_run(SMALL, batch, tasks).tolist() == [False, False, True, False, False, False, False, False, True]
    assert waits_in_run(SMALL, 1, tasks[:0]).tolist() == []
    for lens, staged in (([100, 100], True), ([100, 100, 100], False)):  # a built schedule's tasks
        s = Schedule(SMALL, 8, lens)
        inside, op = s.waits_in_run(), s.tasks["op"]
        reader = np.isin(op, (Opcode.QKV, Opcode.ROUTER)) & (s.tasks["wait"] >= 0)
        assert (inside[reader] == staged).all() and not inside[s.tasks["wait"] < 0].any()
        assert (op == Opcode.ATTN).any() and inside[op == Opcode.ATTN].all()
        assert (inside[op == Opcode.GATE_UP] == (s.wait_spans()[op == Opcode.GATE_UP] == 1)).all()
    for batch in (0, 9):
        with pytest.raises(NativeError, match=r"batch must be in \[1, 8\]"):
            waits_in_run(SMALL, batch, tasks)
    stray = tasks[2:3].copy()
    stray["layer"] = SMALL.num_layers
    with pytest.raises(NativeError, match="a GATE_UP of layer 5 of 5"):
        waits_in_run(SMALL, 1, stray)
    with pytest.raises(NativeError, match="task 0: a GATE_UP of layer 5 of 5"):  # the same rule for spans
        wait_spans(SMALL, stray)


def test_wait_spans_refuse_a_geometry_the_schedule_cannot_take():
    tasks = np.zeros(1, dtype=TASK_DTYPE)
    with pytest.raises(NativeError, match="head_dim must be 128"):
        wait_spans(north(num_layers=2, head_dim=64), tasks)


@pytest.mark.parametrize("overrides, message, reason", [
    ({"intermediate_size": 784}, "intermediate_size must be a positive multiple of 32", "multiples of 32"),
    ({"prefix_dense_intermediate_size": 3088}, "dense intermediate size must be a positive multiple of 32",
     "multiples of 32"),
    ({"num_attention_heads": 40, "num_key_value_heads": 8}, r"num_heads \* head_dim must be at most 4096",
     "num_heads * head_dim <= 4096, got 5120"),
    ({"hidden_size": 4352}, "hidden_size and the intermediate sizes must be at most 4096", "got 4352"),
    ({"prefix_dense_intermediate_size": 4128}, "hidden_size and the intermediate sizes must be at most 4096",
     "got 4128"),
])
def test_geometries_the_kernel_cannot_run_are_refused_here_and_by_unsupported_reason(overrides, message, reason):
    config = north(num_layers=2, **overrides)
    with pytest.raises(NativeError, match=message):
        Schedule(config, 8, [10])
    assert reason in unsupported_reason(config)
    assert unsupported_reason(north(num_layers=2)) is None


def test_a_model_deeper_than_the_kernels_layer_table_schedules_but_is_not_megakernel_material():
    """The schedule takes up to 255 layers; the kernel's parameters hold 128 layers' table."""
    deep = north(num_layers=129)
    assert Schedule(deep, 8, [10]).plan["batch"] == 1
    assert "at most 128 layers, got 129" in unsupported_reason(deep)
    assert unsupported_reason(north(num_layers=128)) is None


def _set(t, i, field, value):
    t[field][i] = value
    return t


def _bump(t, field, delta):
    i = np.flatnonzero(t["wait"] >= 0)[0]
    t[field][i] += delta
    return t


def _reverse_sm(t, o, sm):
    t[o[sm]:o[sm + 1]] = t[o[sm]:o[sm + 1]][::-1].copy()
    return t


def _remove(t, o, q, i):
    """Removes task i, shrinking the offsets past it."""
    return np.delete(t, i), np.where(o > i, o - 1, o), np.where(q > i, q - 1, q)


def _insert(t, o, q, i, task):
    """Inserts a copy of `task` at index i: at the front of the list or queue starting there."""
    return np.insert(t, i, task.copy()), np.where(o > i, o + 1, o), np.where(q > i, q + 1, q)


def _drop(t, o, q, op):
    """Removes the first task of `op`."""
    return _remove(t, o, q, int(np.flatnonzero(t["op"] == op)[0]))


def _set_offset(offsets, i, value):
    offsets[i] = value
    return offsets


def _find(tasks, op, layer, first=True):
    """Index in `tasks` of the first (or last) task of op at layer; an AssertionError if none."""
    hits = np.flatnonzero((tasks["op"] == op) & (tasks["layer"] == layer) if op != Opcode.DRAIN
                          else (tasks["op"] == op) & (tasks["x"] == layer))
    assert len(hits), (op, layer)
    return int(hits[0] if first else hits[-1])


def _drain_index(t, o, sm, queue):
    return int(o[sm]) + _find(t[o[sm]:o[sm + 1]], Opcode.DRAIN, queue)


def _move_in_list(t, o, q, sm, op, layer, before_op, before_layer, after=False):
    """In SM sm's list, moves the first task of (op, layer) to just before (after=False) or
    just after the first entry of (before_op, before_layer)."""
    seg = t[o[sm]:o[sm + 1]].copy()
    moved = seg[_find(seg, op, layer)].copy()
    seg = np.delete(seg, _find(seg, op, layer))
    at = _find(seg, before_op, before_layer) + int(after)
    t[o[sm]:o[sm + 1]] = np.insert(seg, at, moved)
    return t, o, q


def _block_after_drain(t, o, q, block):
    """The SM holding layer 0's first NORM tile of column block `block` moves it after its DRAIN(0)."""
    x = block * BLOCK_COLS // 32
    i = int(np.flatnonzero((t["op"] == Opcode.NORM) & (t["x"] == x))[0])
    sm = int(np.searchsorted(o, i, side="right")) - 1
    seg = t[o[sm]:o[sm + 1]].copy()
    at = i - int(o[sm])
    moved, seg = seg[at].copy(), np.delete(seg, at)
    t[o[sm]:o[sm + 1]] = np.insert(seg, _find(seg, Opcode.DRAIN, 0) + 1, moved)
    return t, o, q


def _lm_head_before_drain(t, o, q, sm, queue):
    return _move_in_list(t, o, q, sm, Opcode.LM_HEAD, 0, Opcode.DRAIN, queue)


def _norm_after_drain(t, o, q, sm, layer):
    return _move_in_list(t, o, q, sm, Opcode.NORM, layer, Opcode.DRAIN, layer, after=True)


def _qkv_after_drain(t, o, q, sm, layer):
    return _move_in_list(t, o, q, sm, Opcode.QKV, layer, Opcode.DRAIN, layer, after=True)


def _qkv_before_norm(t, o, q, sm):
    return _move_in_list(t, o, q, sm, Opcode.QKV, 0, Opcode.NORM, 0)


def _oproj_first(t, o, q, layer):
    """Queue `layer` with its first OPROJ task moved to the front."""
    seg = t[q[layer]:q[layer + 1]].copy()
    i = _find(seg, Opcode.OPROJ, layer)
    t[q[layer]:q[layer + 1]] = np.concatenate([seg[i:i + 1], np.delete(seg, i)])
    return t, o, q


def _attention_to_next_queue(t, o, q, layer):
    """Queue `layer`'s ATTN tasks moved to the front of queue layer + 1."""
    this, following = t[q[layer]:q[layer + 1]].copy(), t[q[layer + 1]:q[layer + 2]].copy()
    attn = this["op"] == Opcode.ATTN
    t[q[layer]:q[layer + 2]] = np.concatenate([this[~attn], this[attn], following])
    q[layer + 1] = q[layer] + int((~attn).sum())
    return t, o, q


def test_attention_splits_follow_the_first_num_sms_minus_splits_expert_tiles():
    s = Schedule(north(num_layers=2), 132, [8192])
    q = s.queue(1)
    ops = q["op"].tolist()
    splits = ops.count(Opcode.ATTN)
    lead = 132 - splits
    assert ops[:lead] == [Opcode.GATE_UP] * lead
    assert ops[lead:lead + splits] == [Opcode.ATTN] * splits
    assert Opcode.ATTN not in ops[lead + splits:] and ops[lead + splits] == Opcode.GATE_UP
