"""The decode step's task schedule: per-SM lists the megakernel runs, proven safe on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from northmk.config import ModelConfig
from northmk.megakernel import MAX_SPLITS, Opcode, Schedule, check_schedule
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
    assert n[Opcode.NORM] == 49 and n[Opcode.FINAL_NORM] == 1
    assert n[Opcode.ROUTER] == 48  # layer 0 is dense
    assert n[Opcode.QKV] == 49 * -(-(4096 + 2 * 512) // p["qkv_rows"])
    assert n[Opcode.OPROJ] == 49 * -(-2048 // p["oproj_rows"])
    assert n[Opcode.COMBINE] == 49 * 2 * 4
    assert n[Opcode.ARGMAX] == 2
    assert n[Opcode.LM_HEAD] == p["lm_tiles"] == -(-262144 // p["lm_rows"])
    moe_gate_up = 48 * p["expert_slots"] * -(-768 // p["moe_cols"])
    assert n[Opcode.GATE_UP] == moe_gate_up + -(-3072 // p["dense_cols"])
    assert p["qkv_rows"] % 2 == 0, "RoPE pairs must stay in one tile"


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
    combine = s.tasks[(s.tasks["op"] == Opcode.COMBINE) & (s.tasks["layer"] == 4)]
    assert {int(r): int(z) for r, z in zip(combine["x"], combine["z"])} == splits, "combine merges every split"


def test_wait_targets_count_all_signallers():
    s = Schedule(SMALL, 16, [300, 70, 1])
    signals = np.bincount(s.tasks["signal"][s.tasks["signal"] >= 0], minlength=s.plan["num_counters"])
    waits = s.tasks[s.tasks["wait"] >= 0]
    assert (waits["target"] == signals[waits["wait"]]).all()
    assert (s.tasks["wait"] < 0).sum() == 1, "only layer 0's norm starts without waiting"


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
    ],
)
def test_checker_rejects_broken_schedules(name, mutate, message):
    s = Schedule(SMALL, 8, [200, 3])
    check_schedule(SMALL, s.plan, s.tasks, s.sm_offsets)
    tasks, offsets = _mutated(s, mutate)
    with pytest.raises(NativeError, match=message):
        check_schedule(SMALL, s.plan, tasks, offsets)


def test_checker_rejects_a_wait_on_the_wrong_stage():
    s = Schedule(SMALL, 8, [64])
    tasks = s.tasks.copy()
    attn = np.flatnonzero(tasks["op"] == Opcode.ATTN)[0]
    norm = np.flatnonzero((tasks["op"] == Opcode.NORM) & (tasks["layer"] == tasks["layer"][attn]))[0]
    tasks["wait"][attn], tasks["target"][attn] = tasks["signal"][norm], 1  # attention before q exists
    with pytest.raises(NativeError, match="does not wait for all of a stage it reads"):
        check_schedule(SMALL, s.plan, tasks, s.sm_offsets)


def test_bad_requests_get_clear_errors():
    with pytest.raises(NativeError, match="batch"):
        Schedule(SMALL, 8, [10] * 9)
    with pytest.raises(NativeError, match="context length"):
        Schedule(SMALL, 8, [0])
    with pytest.raises(NativeError, match="num_sms"):
        Schedule(SMALL, 0, [10])
    with pytest.raises(NativeError, match="head_dim"):
        Schedule(north(num_layers=2, head_dim=64), 8, [10])


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
