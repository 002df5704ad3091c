"""The decode step's task schedule: per-SM lists the megakernel runs, proven safe on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from northmk.config import ModelConfig
from northmk.megakernel import MAX_SPLITS, Opcode, Schedule, check_schedule, unsupported_reason
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


def test_full_geometry_schedule_passes_the_checker_at_every_batch():
    for batch in (1, 2, 5, 8):
        s = Schedule(north(), 132, [8192] * batch)
        check_schedule(north(), s.plan, s.tasks, s.sm_offsets)
        assert s.num_sms == 132
        assert s.plan["batch"] == batch
        assert s.plan["expert_slots"] == min(8 * batch, 128)


def test_every_stage_has_the_tiles_the_geometry_needs():
    c = north()
    s = Schedule(c, 132, [100, 5000])
    n = counts(s)
    p = s.plan
    assert p["norm_cols"] == 128 and p["norm_tiles"] == 2048 // 128
    assert p["router_rows"] == 16 and p["router_tiles"] == 128 // 16
    assert n[Opcode.NORM] == 49 * p["norm_tiles"] and n[Opcode.FINAL_NORM] == p["norm_tiles"]
    assert n[Opcode.ROUTER] == 48 * p["router_tiles"]  # layer 0 is dense
    assert n[Opcode.QKV] == 49 * -(-(4096 + 2 * 512) // p["qkv_rows"])
    assert n[Opcode.OPROJ] == 49 * -(-2048 // p["oproj_rows"])
    assert Opcode.COMBINE not in n, "retired in v0.3: the last attention split merges"
    assert n[Opcode.ARGMAX] == 2
    assert n[Opcode.LM_HEAD] == p["lm_tiles"] == -(-262144 // p["lm_rows"])
    moe_gate_up = 48 * p["expert_slots"] * -(-768 // p["moe_cols"])
    assert n[Opcode.GATE_UP] == moe_gate_up + -(-3072 // p["dense_cols"])
    for layer in (0, 7):  # each NORM / ROUTER tile once per layer
        of_layer = s.tasks[s.tasks["layer"] == layer]
        assert sorted(of_layer["x"][of_layer["op"] == Opcode.NORM]) == list(range(p["norm_tiles"]))
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
    assert p["lm_rows"] == 512 and p["lm_tiles"] == 512  # 262144 rows: capped tiles, many per SM


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
    assert set(dense["wait"]) == set(norm0["signal"]) and (dense["target"] == s.plan["norm_tiles"]).all()
    assert (norm0["wait"] == -1).all()


def test_wait_targets_count_all_signallers():
    s = Schedule(SMALL, 16, [300, 70, 1])
    signals = np.bincount(s.tasks["signal"][s.tasks["signal"] >= 0], minlength=s.plan["num_counters"])
    waits = s.tasks[s.tasks["wait"] >= 0]
    assert (waits["target"] == signals[waits["wait"]]).all()
    assert (s.tasks["wait"] < 0).sum() == s.plan["norm_tiles"], "only layer 0's norm tiles start without waiting"


def _mutated(s: Schedule, mutate) -> tuple[np.ndarray, np.ndarray]:
    tasks, offsets = s.tasks.copy(), s.sm_offsets.copy()
    return mutate(tasks, offsets)


@pytest.mark.parametrize(
    "name, mutate, message",
    [
        ("unknown opcode", lambda t, o: (_set(t, 0, "op", 99), o), "unknown opcode"),
        ("target too high", lambda t, o: (_bump(t, "target", 1), o), "target differs"),
        ("missing task", lambda t, o: (np.delete(t, -1), np.minimum(o, len(t) - 1)), "missing task"),
        ("duplicate task", lambda t, o: (np.insert(t, 0, t[-1]), np.r_[0, o[1:] + 1]), "duplicate"),
        ("reversed list", lambda t, o: (_reverse_sm(t, o, 0), o), "deadlock"),
        ("retired COMBINE", lambda t, o: (_set(t, int(np.flatnonzero(t["op"] == Opcode.ATTN)[0]), "op",
                                               Opcode.COMBINE), o), "retired opcode COMBINE"),
        ("a router tile missing", lambda t, o: _drop(t, o, Opcode.ROUTER), "missing task op=3"),
        ("a norm tile missing", lambda t, o: _drop(t, o, Opcode.NORM), "missing task op=1"),
    ],
)
def test_checker_rejects_broken_schedules(name, mutate, message):
    s = Schedule(SMALL, 8, [200, 3])
    check_schedule(SMALL, s.plan, s.tasks, s.sm_offsets)
    tasks, offsets = _mutated(s, mutate)
    with pytest.raises(NativeError, match=message):
        check_schedule(SMALL, s.plan, tasks, offsets)


def _rewire(s: Schedule, op: Opcode, layer: int, to: Opcode) -> np.ndarray:
    """The tasks with each (op, layer) task waiting on the counter `to` of that layer signals, fully."""
    tasks = s.tasks.copy()
    source = tasks[(tasks["op"] == to) & (tasks["layer"] == layer)]
    counter = int(source["signal"][0])
    target = int((tasks["signal"] == counter).sum())
    which = (tasks["op"] == op) & (tasks["layer"] == layer)
    tasks["wait"][which], tasks["target"][which] = counter, target
    return tasks


@pytest.mark.parametrize("op, layer, to", [
    (Opcode.ATTN, 1, Opcode.NORM),      # attention before q exists
    (Opcode.OPROJ, 1, Opcode.QKV),      # o-proj before the merged attention output
    (Opcode.GATE_UP, 2, Opcode.NORM),   # experts before the router logits
    (Opcode.LM_HEAD, 0, Opcode.OPROJ),    # logits before the final norm
])
def test_checker_rejects_a_wait_on_the_wrong_stage(op, layer, to):
    s = Schedule(SMALL, 8, [64, 300])
    tasks = _rewire(s, op, layer, to)
    with pytest.raises(NativeError, match="does not wait for all of a stage it reads"):
        check_schedule(SMALL, s.plan, tasks, s.sm_offsets)


def test_checker_rejects_a_wait_on_part_of_the_norm_tiles():
    s = Schedule(SMALL, 8, [64])
    tasks = s.tasks.copy()
    norm = np.flatnonzero((tasks["op"] == Opcode.NORM) & (tasks["layer"] == 1))[0]
    normed = tasks["signal"][norm]
    tasks["signal"][norm] = -1  # one NORM tile's sum of squares goes unwaited for
    tasks["target"][tasks["wait"] == normed] -= 1
    with pytest.raises(NativeError, match="does not wait for all of a stage it reads"):
        check_schedule(SMALL, s.plan, tasks, s.sm_offsets)


@pytest.mark.parametrize("field, value, message", [
    ("qkv_rows", 24, "qkv_rows must be a positive multiple of 16 up to 128"),
    ("oproj_rows", 144, "oproj_rows must be a positive multiple of 16 up to 128"),
    ("moe_down_rows", 272, "moe_down_rows must be a positive multiple of 16 up to 256"),
    ("lm_rows", 0, "lm_rows must be"),
    ("norm_cols", 256, "norm_cols must be 128"),
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
        check_schedule(SMALL, plan, s.tasks, s.sm_offsets)


def test_bad_requests_get_clear_errors():
    with pytest.raises(NativeError, match="batch"):
        Schedule(SMALL, 8, [10] * 9)
    with pytest.raises(NativeError, match="context length"):
        Schedule(SMALL, 8, [0])
    with pytest.raises(NativeError, match="num_sms"):
        Schedule(SMALL, 0, [10])
    with pytest.raises(NativeError, match="head_dim must be 128"):
        Schedule(north(num_layers=2, head_dim=64), 8, [10])


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


def _drop(t, o, op):
    """Removes the first task of `op`, shrinking the lists' offsets to match."""
    i = int(np.flatnonzero(t["op"] == op)[0])
    return np.delete(t, i), np.where(o > i, o - 1, o)
