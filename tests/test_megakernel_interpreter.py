"""The megakernel's instruction stream, interpreted on the CPU: the host-built schedule
computes the reference's decode step, layer by layer."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from northmk.checkpoint import synthetic_weights
from northmk.config import PAGE_SIZE, ModelConfig
from northmk.megakernel import POST_SCALED_MAX_BATCH, Opcode, Schedule, check_schedule
from northmk.megakernel_interpreter import _Step, execution_order, rb, run_schedule
from northmk.megakernel_oracle import AGREE, AGREE_LAYER, cosine, first_divergence, layer_report, reference_step
from northmk.model.kv import BatchLayout, PagedKVCache
from northmk.model.reference import route as reference_route
from northmk.native import NativeError

from .test_bench_critical import hand_made


@pytest.fixture(scope="module")
def small():
    """The narrowest geometry the kernel takes (head_dim 128, hidden a multiple of 256), full
    and sliding layers, a dense first layer and routed experts (40: a short last router tile)."""
    config = ModelConfig.from_dict({
        "model_type": "cohere2_moe", "hidden_size": 256, "num_hidden_layers": 5, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 128, "vocab_size": 512, "num_experts": 40, "num_experts_per_tok": 2,
        "intermediate_size": 64, "prefix_dense_intermediate_size": 128, "first_k_dense_replace": 1,
        "sliding_window": 64, "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "expert_selection_fn": "sigmoid",
        "norm_topk_prob": False, "logit_scale": 1.0, "tie_word_embeddings": True,
    })
    return config, synthetic_weights(config, torch.bfloat16, "cpu", seed=11)


def cache(config, contexts, seed=3):
    per_row = -(-max(contexts) // PAGE_SIZE)
    kv = PagedKVCache(config, [len(contexts) * per_row] * len(config.attention_groups), torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for pages in kv.pages:
        pages.normal_(generator=gen)
    table = torch.arange(len(contexts) * per_row, dtype=torch.int32).flip(0).view(len(contexts), per_row)
    return kv, [table.clone() for _ in kv.pages]


def copy(config, kv):
    out = PagedKVCache(config, kv.num_pages, torch.bfloat16, "cpu")
    for a, b in zip(out.pages, kv.pages):
        a.copy_(b)
    return out


CONTEXTS = [1, 63, 64, 65, 200]
TOKENS = torch.tensor([5, 77, 300, 2, 511])


def interpret(config, weights, schedule_lens, num_sms=7, contexts=CONTEXTS):
    kv, tables = cache(config, contexts)
    before = copy(config, kv)
    schedule = Schedule(config, num_sms, schedule_lens)
    positions = [c - 1 for c in contexts]
    logits, trace = run_schedule(config, weights, schedule, TOKENS[-len(contexts):], positions, tables, kv)
    return logits, trace, kv, before, BatchLayout([1] * len(contexts), positions, tables)


# Five rows, and one and two (QKV and ROUTER scale their outputs by the rms: POST_SCALED_MAX_BATCH).
@pytest.mark.parametrize("contexts", [CONTEXTS, CONTEXTS[-2:], CONTEXTS[-1:]], ids=["5 rows", "2 rows", "1 row"])
def test_the_schedule_computes_the_reference_step_layer_by_layer(small, contexts):
    config, weights = small
    tokens = TOKENS[-len(contexts):]
    logits, trace, kv, before, layout = interpret(config, weights, contexts, contexts=contexts)
    oracle = reference_step(config, weights, tokens, layout, copy(config, before), trace=trace)
    assert not oracle.routing_errors, oracle.routing_errors[:3]
    assert first_divergence(layer_report(trace, oracle)) is None
    for r in range(len(contexts)):
        assert cosine(logits[r], oracle.logits[r]) >= AGREE
    local = reference_step(config, weights, tokens, layout, before, trace=trace, teacher=True)
    assert first_divergence(layer_report(trace, local), AGREE_LAYER) is None
    for layer in range(config.num_layers):  # k, v of the new tokens landed where the reference puts them
        a, b = kv.layer_view(layer).clone(), before.layer_view(layer).clone()
        for r, pos in enumerate(layout.start_positions):
            page, slot = layout.block_tables[config.layer_group[layer]][r, pos // PAGE_SIZE].item(), pos % PAGE_SIZE
            assert cosine(a[page, :, :, slot], b[page, :, :, slot]) >= AGREE_LAYER, (layer, r)
            a[page, :, :, slot] = b[page, :, :, slot] = 0
        assert torch.equal(a, b), layer


def test_a_schedule_sized_for_longer_contexts_gives_the_same_step(small):
    config, weights = small
    exact, *_ = interpret(config, weights, CONTEXTS)
    bucketed, *_ = interpret(config, weights, [256] * len(CONTEXTS), num_sms=13)
    assert torch.allclose(exact, bucketed, atol=1e-2, rtol=0)
    assert torch.equal(exact.argmax(-1), bucketed.argmax(-1))


def test_a_wait_nobody_can_satisfy_is_a_deadlock(small):
    config, weights = small
    kv, tables = cache(config, CONTEXTS)
    schedule = Schedule(config, 3, CONTEXTS)
    first_waiting = int((schedule.tasks["wait"] >= 0).argmax())
    schedule.tasks[first_waiting]["target"] += 1
    with pytest.raises(RuntimeError, match="deadlock"):
        run_schedule(config, weights, schedule, TOKENS, [c - 1 for c in CONTEXTS], tables, kv)


def test_the_sms_drain_each_queue_in_claim_order_and_run_every_task_once(small):
    config, _ = small
    s = Schedule(config, 7, CONTEXTS)
    order = execution_order(s)
    work = [i for i in range(len(s.tasks)) if s.tasks["op"][i] != Opcode.DRAIN]
    assert sorted(i for _, i in order) == work
    for sm in range(s.num_sms):  # each SM runs its own list in order, queue tasks in between
        listed = [i for who, i in order if who == sm and i < s.queue_offsets[0]]
        assert listed == [i for i in range(s.sm_offsets[sm], s.sm_offsets[sm + 1]) if i in set(work)]
    for q in range(s.num_queues):
        ran = [(sm, i) for sm, i in order if s.queue_offsets[q] <= i < s.queue_offsets[q + 1]]
        assert len({sm for sm, _ in ran}) > 1, "several SMs help drain the queue"
        for sm in range(s.num_sms):  # an SM claims in queue order, so its share runs in queue order
            mine = [i for who, i in ran if who == sm]
            assert mine == sorted(mine)


def test_an_sm_holding_a_claimed_task_that_waits_on_a_later_one_deadlocks(small):
    config, weights = small
    kv, tables = cache(config, CONTEXTS)
    schedule = Schedule(config, 1, CONTEXTS)
    lo, hi = schedule.queue_offsets[2], schedule.queue_offsets[3]
    queue = schedule.tasks[lo:hi].copy()
    first_oproj = int(np.flatnonzero(queue["op"] == Opcode.OPROJ)[0])
    schedule.tasks[lo:hi] = np.concatenate([queue[first_oproj:first_oproj + 1], np.delete(queue, first_oproj)])
    with pytest.raises(NativeError, match="not earlier in the queue"):
        check_schedule(config, schedule.plan, schedule.tasks, schedule.sm_offsets, schedule.queue_offsets)
    with pytest.raises(RuntimeError, match=r"deadlock: SMs \[0\] wait forever"):
        run_schedule(config, weights, schedule, TOKENS, [c - 1 for c in CONTEXTS], tables, kv)


def test_the_list_task_before_a_drain_claims_the_queues_first_task_as_it_is_reached():
    # SM 0 reaches its OPROJ tile (waiting on counter 0) and claims the queue's first task A;
    # SM 1's OPROJ tile signals counter 0, then SM 1 drains the queue: it gets B, not A, which
    # SM 0 runs after its OPROJ tile (as the kernel's run_list claims ahead).
    schedule = hand_made([[(Opcode.OPROJ, 0, 0, 0, 1, -1), (Opcode.DRAIN, 0, 0, -1, 0, -1)],
                          [(Opcode.OPROJ, 0, 1, -1, 0, 0), (Opcode.DRAIN, 0, 0, -1, 0, -1)]])
    queue = np.array([(Opcode.ATTN, 0, 0, 0, 0, -1, 0, -1), (Opcode.ATTN, 0, 1, 0, 0, -1, 0, -1)],
                     dtype=schedule.tasks.dtype)
    schedule.tasks = np.concatenate([schedule.tasks, queue])
    schedule.queue_offsets = np.array([4, 6], dtype=np.uint32)
    assert execution_order(schedule) == [(1, 2), (1, 5), (0, 0), (0, 4)]


def test_a_drain_of_a_queue_the_schedule_lacks_is_refused():
    schedule = hand_made([[(Opcode.OPROJ, 0, 0, -1, 0, -1), (Opcode.DRAIN, 0, 3, -1, 0, -1)]])
    with pytest.raises(ValueError, match="SM 0 drains queue 3, the schedule has 0"):
        execution_order(schedule)


def test_a_reader_of_a_layers_input_runs_once_every_block_of_it_is_complete():
    # SM 0 completes the first of layer 1's two input blocks, then reaches its QKV tile, which
    # waits on both; SM 1 completes the second. The QKV tile runs last.
    schedule = hand_made([[(Opcode.OPROJ, 0, 0, -1, 0, 0), (Opcode.QKV, 1, 0, 0, 1, 2)],
                          [(Opcode.OPROJ, 0, 1, -1, 0, 1)]])
    assert schedule.wait_spans().tolist() == [0, 2, 0]
    assert execution_order(schedule) == [(0, 0), (1, 2), (0, 1)]
    schedule.tasks["signal"][2] = -1  # the second block is never complete
    with pytest.raises(RuntimeError, match=r"deadlock: SMs \[0\] wait forever"):
        execution_order(schedule)


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_qkv_and_router_scale_by_the_rms_after_the_gemv_up_to_two_rows(small, batch):
    """Up to POST_SCALED_MAX_BATCH rows: bf16(rms_b * (g_b . w)), g = bf16(x * norm); past
    that the normed input's bf16(h_b . w), h = bf16(bf16(x * rms_b) * norm). The two differ."""
    config, weights = small
    layer, contexts = 4, CONTEXTS[-batch:]  # a full-attention layer: no RoPE on its q
    assert not config.rope_layers[layer] and config.mlp_types[layer] != "dense"
    s = Schedule(config, 7, contexts)
    kv, tables = cache(config, contexts)
    step = _Step(config, weights, s.plan, TOKENS[-batch:], [c - 1 for c in contexts], tables, kv)
    gen = torch.Generator().manual_seed(5)
    step.resid[layer % 3] = 3 * torch.randn(batch, config.hidden_size, generator=gen) + 1  # rms far from 1
    for t in s.tasks[((s.tasks["op"] == Opcode.QKV) | (s.tasks["op"] == Opcode.ROUTER)) & (s.tasks["layer"] == layer)]:
        step.run(t)

    lw = weights.layers[layer]
    x = rb(step.resid[layer % 3])
    rms = torch.rsqrt(x.pow(2).mean(-1) + config.norm_eps)[:, None]
    g, h = rb(x * lw.norm.float()), rb(rb(x * rms) * lw.norm.float())

    def tiled(w: torch.Tensor, rows: int, formula) -> torch.Tensor:  # as the tasks cut it
        return torch.cat([formula(w[r0:r0 + rows].float()) for r0 in range(0, len(w), rows)], dim=1)

    post = lambda w: rb(rms * (g @ w.T))  # noqa: E731
    pre = lambda w: rb(h @ w.T)  # noqa: E731
    q = {f: tiled(lw.qkv, s.plan["qkv_rows"], f)[:, :config.q_size] for f in (post, pre)}
    logits = {f: tiled(lw.router, s.plan["router_rows"], f) for f in (post, pre)}
    assert not torch.equal(q[post], q[pre]) and not torch.equal(logits[post], logits[pre])
    expected = post if batch <= POST_SCALED_MAX_BATCH else pre
    assert torch.equal(step.q, q[expected])
    assert torch.equal(step.router_logits, logits[expected])
    assert torch.equal(step.normed_image, h), "the routing tile writes the exact normed image either way"


def test_norm_and_router_tasks_are_the_planned_tiles(small):
    config, _ = small
    s = Schedule(config, 7, CONTEXTS)
    p = s.plan
    assert p["norm_tiles"] == 256 // 32 and p["router_rows"] == 16 and p["router_tiles"] == 3  # 16 + 16 + 8
    for layer in range(config.num_layers):  # NORM tiles write layer 0's input only
        of_layer = s.tasks[s.tasks["layer"] == layer]
        norms = sorted(of_layer["x"][of_layer["op"] == Opcode.NORM])
        assert norms == (list(range(p["norm_tiles"])) if layer == 0 else [])
        assert sorted(of_layer["x"][of_layer["op"] == Opcode.ROUTER]) == ([] if layer == 0 else [0, 1, 2])
    assert Opcode.FINAL_NORM not in s.tasks["op"], "retired in v0.5: the LM head normalizes the last layer's sums"


@pytest.mark.parametrize("retired, replaced", [(Opcode.COMBINE, Opcode.ATTN), (Opcode.FINAL_NORM, Opcode.NORM)])
def test_a_retired_opcode_is_rejected(small, retired, replaced):
    config, weights = small
    s = Schedule(config, 7, CONTEXTS)
    tasks = s.tasks.copy()
    tasks["op"][np.flatnonzero(tasks["op"] == replaced)[0]] = retired
    with pytest.raises(NativeError, match=f"retired opcode {retired.name}"):
        check_schedule(config, s.plan, tasks, s.sm_offsets, s.queue_offsets)
    s.tasks = tasks
    kv, tables = cache(config, CONTEXTS)
    with pytest.raises(ValueError, match=f"{retired.name} is retired"):
        run_schedule(config, weights, s, TOKENS, [c - 1 for c in CONTEXTS], tables, kv)


def test_the_routing_tile_runs_after_its_layers_other_router_tiles(small):
    config, _ = small
    s = Schedule(config, 7, CONTEXTS)
    seen: dict[int, int] = {}
    routed = 0
    for _, i in execution_order(s):
        t = s.tasks[i]
        if t["op"] != Opcode.ROUTER:
            continue
        layer = int(t["layer"])
        if t["x"] == s.plan["router_tiles"] - 1:
            assert seen.get(layer, 0) == s.plan["router_tiles"] - 1, f"layer {layer}'s routing tile ran early"
            routed += 1
        seen[layer] = seen.get(layer, 0) + 1
    assert routed == sum(1 for layer in range(config.num_layers) if layer in seen)


def swap_routing_tile_first(s: Schedule, layer: int) -> np.ndarray:
    """The schedule's tasks with `layer`'s routing tile and its first ROUTER tile swapped: the
    routing tile comes first in the queue, ahead of a tile whose logits it polls."""
    tasks = s.tasks.copy()
    routers = np.flatnonzero((tasks["op"] == Opcode.ROUTER) & (tasks["layer"] == layer))
    first, last = routers[0], routers[-1]
    assert tasks["x"][first] == 0 and tasks["x"][last] == s.plan["router_tiles"] - 1
    tasks["x"][first], tasks["x"][last] = tasks["x"][last], tasks["x"][first]
    return tasks


def test_a_routing_tile_ahead_of_a_tile_it_polls_is_a_possible_deadlock(small):
    config, _ = small
    s = Schedule(config, 7, CONTEXTS)
    tasks = swap_routing_tile_first(s, 2)
    with pytest.raises(NativeError, match="deadlock possible under some claim order"):
        check_schedule(config, s.plan, tasks, s.sm_offsets, s.queue_offsets)
    one = Schedule(config, 1, CONTEXTS)  # one SM holds the routing tile it claimed: stuck for good
    one.tasks = swap_routing_tile_first(one, 2)
    with pytest.raises(RuntimeError, match="deadlock"):
        execution_order(one)


def tie_rule_top_k(logits: torch.Tensor, k: int) -> list[list[int]]:
    """Each row's k largest logits, ties to the lower id, listed in ascending id."""
    return [sorted(sorted(range(len(row)), key=lambda e: (-row[e], e))[:k]) for row in logits.tolist()]


def test_the_routing_tile_routes_as_the_reference_top_k_including_ties(small):
    config, weights = small
    layer, B, E, K = 2, len(CONTEXTS), config.num_experts, config.top_k
    s = Schedule(config, 40, CONTEXTS)
    assert s.plan["moe_cols"] < config.moe_intermediate_size, "several GATE_UP tiles per slot"
    kv, tables = cache(config, CONTEXTS)
    step = _Step(config, weights, s.plan, TOKENS, [c - 1 for c in CONTEXTS], tables, kv)
    gen = torch.Generator().manual_seed(4)
    step.resid[layer % 3] = torch.randn(B, config.hidden_size, generator=gen)  # the layer's input sums
    routers = [t for t in s.tasks if t["op"] == Opcode.ROUTER and t["layer"] == layer]
    assert len(routers) > 1, "several ROUTER tiles"
    for t in routers[:-1]:
        step.run(t)
    assert not step.normed_image.any(), "only the routing tile writes h"
    assert step.trace.experts[layer].eq(-1).all(), "only the routing tile routes"
    step.run(routers[-1])
    assert step.trace.experts[layer].ge(0).all(), "the routing tile routed the layer"
    assert torch.equal(step.normed_image, step.normed(weights.layers[layer].norm, layer)), "the routing tile wrote h"
    logits = rb(torch.randn(B, E, generator=gen))
    logits[0, [9, 4, 30]] = 3.0  # a three-way tie for two places: 4 and 9
    logits[1] = 0.5  # all tied: 0 and 1
    logits[2, [33, 7]] = 4.0  # a tie inside the top-k: both
    step.router_logits = logits.clone()
    step.route(layer)  # what the last tile does, on these logits
    for t in reversed([t for t in s.tasks if t["op"] == Opcode.GATE_UP and t["layer"] == layer]):
        step.run(t)

    expected = tie_rule_top_k(logits, K)
    assert step.trace.experts[layer].tolist() == expected
    assert expected[:3] == [[4, 9], [0, 1], [7, 33]]
    _, reference = reference_route(logits, K, "sigmoid", False)
    for b in range(B):  # the reference's top-k: the same logits picked, the same experts where no tie decides
        assert sorted(logits[b, expected[b]].tolist()) == sorted(logits[b, reference[b]].tolist())
        if b >= 2:
            assert sorted(reference[b].tolist()) == expected[b]
    assert torch.equal(step.topk_weight, rb(torch.sigmoid(logits.gather(1, torch.tensor(expected)))))
    used = sorted({e for row in expected for e in row})
    assert step.slot_expert == used + [-1] * (s.plan["expert_slots"] - len(used))
    h = step.normed(weights.layers[layer].norm, layer)
    inter = config.moe_intermediate_size
    for y, e in enumerate(used):
        assert step.slot_k[y] == [row.index(e) if e in row else -1 for row in expected]
        gate_up = weights.layers[layer].experts_gate_up[e].float()
        act = rb(rb(torch.nn.functional.silu(rb(h @ gate_up[:inter].T))) * rb(h @ gate_up[inter:].T))
        assert torch.equal(step.act[y, :, :inter], act), (y, e)


def test_a_layer_whose_router_logits_all_tie_routes_every_row_to_the_lowest_ids(small):
    config, weights = small
    layers = list(weights.layers)
    router = layers[3].router
    layers[3] = replace(layers[3], router=router[:1].expand_as(router).contiguous())
    tied = replace(weights, layers=layers)
    kv, tables = cache(config, CONTEXTS)
    before = copy(config, kv)
    positions = [c - 1 for c in CONTEXTS]
    logits, trace = run_schedule(config, tied, Schedule(config, 7, CONTEXTS), TOKENS, positions, tables, kv)
    assert trace.experts[3].tolist() == [[0, 1]] * len(CONTEXTS)
    layout = BatchLayout([1] * len(CONTEXTS), positions, tables)
    oracle = reference_step(config, tied, TOKENS, layout, before, trace=trace)
    assert not oracle.routing_errors, oracle.routing_errors[:3]
    assert first_divergence(layer_report(trace, oracle)) is None
