"""One decode step of the megakernel against the PyTorch reference, at full North geometry.

Routing is checked on the kernel's own input at every layer (its experts must be the
reference's top-k up to bf16 noise) and then shared with the reference, so the logits
compare everything else end to end (northmk.megakernel_oracle). Every layer fed the
kernel's own input must agree to AGREE_LAYER. End to end, bf16 rounding differences
compound through 49 random-weight layers: two references (fp32 sums, torch's bf16 GEMMs)
agree only to logits cosine ~0.997-0.999 there, so at full depth the kernel must agree with
the reference at least as well as the two references agree with each other (and its
argmax is checked where they agree on a clear one), and to AGREE at reduced depth."""

from __future__ import annotations

import math

import pytest
import torch

from northmk.checkpoint import synthetic_weights
from northmk.config import PAGE_SIZE, SLIDING, ModelConfig
from northmk.megakernel import Megakernel, Opcode, Schedule
from northmk.megakernel_oracle import (AGREE, AGREE_LAYER, clear_argmax, cosine, first_divergence, layer_report,
                                      reference_step, tie_band)
from northmk.model.kv import BatchLayout, PagedKVCache

pytestmark = pytest.mark.gpu


def north(num_layers: int = 49, **overrides) -> ModelConfig:
    """North Mini Code's geometry (config.json fields in overrides replace its own)."""
    return ModelConfig.from_dict({
        "model_type": "cohere2_moe", "hidden_size": 2048, "num_hidden_layers": num_layers,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 262144,
        "num_experts": 128, "num_experts_per_tok": 8, "intermediate_size": 768,
        "prefix_dense_intermediate_size": 3072, "first_k_dense_replace": 1, "sliding_window": 4096,
        "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "expert_selection_fn": "sigmoid", "norm_topk_prob": False,
        "logit_scale": 1.0, "tie_word_embeddings": True, "max_position_embeddings": 16384, **overrides,
    })


@pytest.fixture(scope="module")
def full():
    config = north()
    return config, synthetic_weights(config, torch.bfloat16, "cuda", seed=0)


def noisy_cache(config: ModelConfig, rows: int, max_len: int, seed: int):
    """A KV cache of noise with rows consecutive blocks of pages, and its block tables."""
    per_row = -(-max_len // PAGE_SIZE)
    kv = PagedKVCache(config, [rows * per_row] * len(config.attention_groups), torch.bfloat16, "cuda")
    gen = torch.Generator("cuda").manual_seed(seed)
    for pages in kv.pages:
        pages.normal_(generator=gen)
    table = torch.arange(rows * per_row, dtype=torch.int32, device="cuda").view(rows, per_row)
    return kv, [table.clone() for _ in kv.pages]


def copy_cache(config: ModelConfig, kv: PagedKVCache) -> PagedKVCache:
    out = PagedKVCache(config, kv.num_pages, torch.bfloat16, "cuda")
    for a, b in zip(out.pages, kv.pages):
        a.copy_(b)
    return out


def step_both(config, weights, contexts: list[int], seed: int = 1):
    rows, max_len = len(contexts), max(contexts)
    kv_mk, tables = noisy_cache(config, rows, max_len, seed)
    kv_ref = copy_cache(config, kv_mk)
    tokens = torch.randint(0, config.vocab_size, (rows,), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    positions = [c - 1 for c in contexts]
    kv_floor = copy_cache(config, kv_mk) if config.num_layers > 4 else None
    mk = Megakernel(config, weights, kv_mk)
    mk.enable_debug()
    logits, next_tokens = mk.step(tokens, positions, tables)
    torch.cuda.synchronize()
    trace = mk.trace(rows)
    layout = BatchLayout([1] * rows, positions, tables)
    oracle = reference_step(config, weights, tokens, layout, kv_ref, trace=trace)
    other = None  # at full depth, the reference again with torch's bf16 GEMMs: its own spread
    if kv_floor is not None:
        other = reference_step(config, weights, tokens, layout, kv_floor, trace=trace, fp32_sums=False).logits
    return logits, next_tokens, trace, oracle, other, kv_mk, kv_ref, layout


def assert_matches(logits, next_tokens, trace, oracle, other):
    """other: a second reference's logits (or None): where the two references differ, the
    kernel must be as close as they are, and an argmax they disagree on is not checked."""
    assert not oracle.routing_errors, oracle.routing_errors[:3]
    where = first_divergence(layer_report(trace, oracle))
    for r in range(oracle.logits.shape[0]):
        ref = oracle.logits[r]
        floor = AGREE if other is None else cosine(other[r], ref)
        cos, need = cosine(logits[r], ref), min(AGREE, floor - 1e-3)
        assert cos >= need, f"row {r}: logits cosine {cos:.5f} < {need:.5f}; first divergence: {where}"
        # At full depth bf16 drift sets the noise: sigma, the larger std of a logit's difference
        # from the reference (the second reference's, or the kernel's, which the cosine bound
        # above holds to the same scale). A gap between two logits carries the noise of both,
        # sigma * sqrt(2); a gap within 4 of those is a tie, and the kernel's token must then
        # be within it of the top.
        sigma = 0.0 if other is None else max((other[r] - ref).std().item(), (logits[r] - ref).std().item())
        spread = 4 * math.sqrt(2) * sigma
        top2 = ref.topk(2).values
        if clear_argmax(ref) and top2[0] - top2[1] > spread:
            mine, best = next_tokens[r].long(), ref.argmax()
            assert mine.item() == best.item(), (
                f"row {r}: argmax differs: kernel token {mine.item()} (its logits' argmax {logits[r].argmax().item()}), "
                f"reference {best.item()}; reference gap {(top2[0] - top2[1]).item():.4f} > spread {spread:.4f}; "
                f"kernel logits there {logits[r, mine].item():.4f} / {logits[r, best].item():.4f}, "
                f"reference {ref[mine].item():.4f} / {ref[best].item():.4f}")
        else:
            assert ref[next_tokens[r].long()].item() >= top2[0].item() - max(spread, tie_band(ref))
        assert next_tokens[r].item() == logits[r].argmax().item()


def assert_same_new_kv(config, kv_mk, kv_ref, layout):
    """The new tokens' k, v went to the same place with the same values, in every layer,
    and nothing else in the cache changed. Values agree to AGREE in the first layers; deeper
    ones are computed from hidden states that drift apart by bf16 noise (see the module
    docstring), so there a wrong slot, head or rotation (cosine near 0) is what fails."""
    for layer in range(config.num_layers):
        a, b = kv_mk.layer_view(layer).clone(), kv_ref.layer_view(layer).clone()
        table = layout.block_tables[config.layer_group[layer]]
        need = AGREE if layer < 4 else 0.99
        for r, pos in enumerate(layout.start_positions):
            page, slot = table[r, pos // PAGE_SIZE].item(), pos % PAGE_SIZE
            cos = cosine(a[page, :, :, slot], b[page, :, :, slot])
            assert cos >= need, f"layer {layer} row {r}: new k, v differ (cosine {cos:.5f} < {need})"
            a[page, :, :, slot] = b[page, :, :, slot] = 0
        assert torch.equal(a, b), f"layer {layer}: the kernel wrote outside the new tokens' slots"


def test_ragged_contexts_match_the_reference_at_full_geometry(full):
    config, weights = full
    contexts = [1, 100, 4095, 4096, 4097, 8192]
    logits, next_tokens, trace, oracle, other, kv_mk, kv_ref, layout = step_both(config, weights, contexts)
    assert_matches(logits, next_tokens, trace, oracle, other)
    assert_same_new_kv(config, kv_mk, kv_ref, layout)


@pytest.mark.parametrize("contexts", [[8192], [8192, 3, 700, 4097, 8000, 64, 65, 2]])
def test_batch_one_and_eight_match_the_reference(full, contexts):
    config, weights = full
    logits, next_tokens, trace, oracle, other, *_ = step_both(config, weights, contexts, seed=len(contexts))
    assert_matches(logits, next_tokens, trace, oracle, other)


def test_a_long_row_matches_the_reference(full):
    # 65536 keys: a full layer's attention outweighs its experts, and its splits take more
    # than half the SMs (84 splits, 21 a pair: the schedule's share by bytes).
    config, weights = full
    logits, next_tokens, trace, oracle, other, *_ = step_both(config, weights, [65536], seed=5)
    assert_matches(logits, next_tokens, trace, oracle, other)


def test_every_layer_alone_matches_the_reference_fed_the_kernels_input(full):
    config, weights = full
    contexts = [4097, 33]
    _, _, trace, _, _, _, _, layout = step_both(config, weights, contexts, seed=9)
    kv_ref, _ = noisy_cache(config, len(contexts), max(contexts), seed=9)
    local = reference_step(config, weights, torch.zeros(2, dtype=torch.int32), layout, kv_ref, trace=trace, teacher=True)
    assert not local.routing_errors, local.routing_errors[:3]
    assert first_divergence(layer_report(trace, local), AGREE_LAYER) is None


def test_one_kernel_launch_per_step(full):
    config, weights = full
    kv, tables = noisy_cache(config, 2, 256, seed=3)
    mk = Megakernel(config, weights, kv)
    tokens = torch.tensor([5, 7], dtype=torch.int32, device="cuda")
    mk.step(tokens, [100, 200], tables)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        mk.step(tokens, [100, 200], tables)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "emcpy" not in e.name
               and "emset" not in e.name]
    assert len(kernels) == 1 and "megakernel" in kernels[0].name, [e.name for e in kernels]


def test_greedy_steps_of_a_reduced_model_equal_the_reference():
    config = north(num_layers=4)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=7)
    contexts = [37, 300]
    kv_mk, tables = noisy_cache(config, 2, 300 + 64, seed=5)
    kv_ref = copy_cache(config, kv_mk)
    mk = Megakernel(config, weights, kv_mk)
    mk.enable_debug()
    tokens = torch.tensor([11, 13], dtype=torch.int32, device="cuda")
    positions = [c - 1 for c in contexts]
    for step in range(64):
        _, next_mk = mk.step(tokens, positions, tables)
        torch.cuda.synchronize()
        layout = BatchLayout([1, 1], positions, tables)
        oracle = reference_step(config, weights, tokens, layout, kv_ref, trace=mk.trace(2))
        assert not oracle.routing_errors, f"step {step}: {oracle.routing_errors[:2]}"
        for r in range(2):
            ref = oracle.logits[r]
            if clear_argmax(ref):
                assert next_mk[r].item() == ref.argmax().item(), f"step {step} row {r}"
            else:  # a tie within noise: either token is the greedy one
                assert ref[next_mk[r]].item() >= ref.max().item() - tie_band(ref)
        tokens = next_mk.clone()
        positions = [p + 1 for p in positions]


def test_steps_that_change_batch_match_the_reference():
    """Launches take two sets of counters (per schedule) and two slot tables (per launch) in turn,
    each zeroing the one before it used: steps of batch 2 and 1 in an irregular order (a schedule
    skipping a launch, then twice in a row) must each match the reference. A model with a single
    sparse layer is the one where a slot table left from an earlier step would carry that layer's
    tag."""
    config = north(num_layers=2)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=17)
    kv_mk, tables = noisy_cache(config, 2, 200 + 16, seed=9)
    kv_ref = copy_cache(config, kv_mk)
    mk = Megakernel(config, weights, kv_mk)
    mk.enable_debug()
    tokens = torch.tensor([5, 7], dtype=torch.int32, device="cuda")
    positions = [99, 199]
    for step, rows in enumerate([2, 1, 2, 2, 1, 1, 2, 1, 2]):
        mine = [t[:rows] for t in tables]
        logits, next_mk = mk.step(tokens[:rows].contiguous(), positions[:rows], mine)
        torch.cuda.synchronize()
        oracle = reference_step(config, weights, tokens[:rows], BatchLayout([1] * rows, positions[:rows], mine), kv_ref,
                                trace=mk.trace(rows))
        assert not oracle.routing_errors, f"step {step}: {oracle.routing_errors[:2]}"
        for r in range(rows):
            cos = cosine(logits[r], oracle.logits[r])
            assert cos >= AGREE, f"step {step} (batch {rows}) row {r}: logits cosine {cos:.5f}"
        tokens[:rows] = next_mk
        positions[:rows] = [p + 1 for p in positions[:rows]]


@pytest.mark.parametrize("num_layers", [1, 2, 4])
def test_reduced_layer_steps_match_the_reference(num_layers):
    config = north(num_layers=num_layers)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=num_layers)
    logits, next_tokens, trace, oracle, other, *_ = step_both(config, weights, [1, 100, 4097])
    assert_matches(logits, next_tokens, trace, oracle, other)


@pytest.mark.parametrize("router", ["zero", "equal rows"])
def test_router_ties_pick_the_lowest_expert_ids(router):
    """Equal router logits (every row of the router zero, or every row the same) tie all 128
    experts: the kernel must pick experts 0..top_k-1 for every row and layer, as its routing
    promises (equal keys go to the lower id, -0 counts as +0), and the step must still match
    the reference given those picks."""
    config = north(num_layers=3)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=31)
    for layer in weights.layers:
        if layer.router is not None:
            if router == "zero":
                layer.router.zero_()
            else:
                layer.router.copy_(layer.router[:1].expand_as(layer.router))
    logits, next_tokens, trace, oracle, other, *_ = step_both(config, weights, [1, 100, 4097, 300])
    sparse = [l for l, t in enumerate(config.mlp_types) if t != "dense"]
    assert sparse
    want = torch.arange(config.top_k, device=trace.experts.device)
    for l in sparse:
        for r in range(trace.experts.shape[1]):
            assert torch.equal(trace.experts[l, r].sort().values, want), (l, r, trace.experts[l, r].tolist())
    assert torch.isfinite(logits).all()
    for r in range(logits.shape[0]):
        assert cosine(logits[r], oracle.logits[r]) >= AGREE, r


def test_a_schedule_prepared_on_another_thread_serves_the_step_that_needs_it(full):
    """nmk_mk_prepare builds a (batch, context bucket)'s schedule while steps of another run; the
    step that then needs it starts without building it (a first step at full geometry builds
    and checks one for ~100-200 ms) and computes what a Megakernel without it computes."""
    import threading
    import time

    from northmk.native import NativeError

    config, weights = full
    kv, tables = noisy_cache(config, 2, 3000, seed=41)
    mk = Megakernel(config, weights, kv)
    tokens = torch.tensor([5, 6], dtype=torch.int32, device="cuda")
    preparing = threading.Thread(target=mk.prepare, args=(2, 2999))  # bucket 4096
    preparing.start()
    while preparing.is_alive():  # bucket 64 meanwhile (its own schedule built by the first)
        mk.step(tokens, [10, 20], tables)
        torch.cuda.synchronize()
    preparing.join()

    def first_step(megakernel):
        torch.cuda.synchronize()
        began = time.perf_counter()
        logits, _ = megakernel.step(tokens, [10, 2999], tables)
        torch.cuda.synchronize()
        return logits, time.perf_counter() - began

    fresh = Megakernel(config, weights, copy_cache(config, kv))
    want, unprepared_s = first_step(fresh)
    got, prepared_s = first_step(mk)
    assert torch.equal(got, want)
    assert prepared_s < 0.03 < unprepared_s, (prepared_s, unprepared_s)
    with pytest.raises(NativeError, match="batch must be in"):
        mk.prepare(9, 100)
    with pytest.raises(NativeError, match="max_len must be >= 1"):
        mk.prepare(1, 0)


def test_task_timing_covers_every_task_of_the_step():
    config = north(num_layers=2)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=2)
    kv, tables = noisy_cache(config, 2, 300, seed=4)
    mk = Megakernel(config, weights, kv)
    mk.enable_timing()
    mk.step(torch.tensor([1, 2], dtype=torch.int32, device="cuda"), [10, 299], tables)
    torch.cuda.synchronize()
    t = mk.task_times()
    schedule = Schedule(config, mk.num_sms, [512, 512])  # the kernel's schedule: lengths bucketed up
    ran = schedule.tasks[schedule.tasks["op"] != Opcode.DRAIN]  # a DRAIN entry runs queue tasks, not itself
    assert len(t) == len(ran)
    assert sorted((t[:, 3] & 0xFF).tolist()) == sorted(ran["op"].tolist())
    sms = (t[:, 3] >> 16).unique()
    assert sms.min() >= 0 and sms.max() < mk.num_sms and len(sms) > mk.num_sms // 2  # queues drained by many SMs
    assert ((t[:, 0] <= t[:, 1]) & (t[:, 1] <= t[:, 2])).all() and t[:, 0].min() == 0


def test_unwritten_cache_slots_never_reach_the_output():
    """Attention reads whole pages: slots outside a row's live range (past its position,
    before a sliding window's start) share those pages and may hold anything, NaN included;
    they must not change a single logit."""
    config = north(num_layers=2)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=12)
    contexts = [4107, 37, 8193]  # a sliding window starting mid-page, a short row, a full layer past 8K
    positions = [c - 1 for c in contexts]
    kv_clean, tables = noisy_cache(config, len(contexts), max(contexts), seed=13)
    kv_nan = copy_cache(config, kv_clean)
    for layer in range(config.num_layers):
        pages, table = kv_nan.layer_view(layer), tables[config.layer_group[layer]]
        window = config.sliding_window if config.layer_types[layer] == SLIDING else None
        for r, pos in enumerate(positions):
            for key in range(pos, (pos // PAGE_SIZE + 1) * PAGE_SIZE):  # this step's slot and the rest of its page
                pages[table[r, key // PAGE_SIZE], :, :, key % PAGE_SIZE] = float("nan")
            if window is not None and pos - window + 1 > 0:
                lo = pos - window + 1
                for key in range(lo // PAGE_SIZE * PAGE_SIZE, lo):  # the page's keys before the window
                    pages[table[r, key // PAGE_SIZE], :, :, key % PAGE_SIZE] = float("nan")
    tokens = torch.tensor([3, 4, 5], dtype=torch.int32, device="cuda")
    clean, _ = Megakernel(config, weights, kv_clean).step(tokens, positions, tables)
    poisoned, _ = Megakernel(config, weights, kv_nan).step(tokens, positions, tables)
    torch.cuda.synchronize()
    assert torch.isfinite(poisoned).all()
    assert torch.equal(clean, poisoned)


def test_step_writes_the_buffers_it_is_given_and_refuses_wrong_ones():
    config = north(num_layers=1)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=21)
    kv, tables = noisy_cache(config, 2, 200, seed=22)
    mk = Megakernel(config, weights, kv)
    tokens = torch.tensor([7, 9], dtype=torch.int32, device="cuda")
    positions = [150, 199]
    fresh_logits, fresh_next = mk.step(tokens, positions, tables)
    logits = torch.full((2, config.vocab_size), float("nan"), device="cuda")
    next_tokens = torch.full((2,), -1, dtype=torch.int32, device="cuda")
    got_logits, got_next = mk.step(tokens, positions, tables, logits, next_tokens)
    torch.cuda.synchronize()
    assert got_logits.data_ptr() == logits.data_ptr() and got_next.data_ptr() == next_tokens.data_ptr()
    assert torch.equal(logits, fresh_logits) and torch.equal(next_tokens, fresh_next)
    with pytest.raises(ValueError, match="logits must be"):
        mk.step(tokens, positions, tables, logits[:1])
    with pytest.raises(ValueError, match="logits must be"):
        mk.step(tokens, positions, tables, logits.double())
    with pytest.raises(ValueError, match="next_tokens must be"):
        mk.step(tokens, positions, tables, logits, next_tokens.long())
    with pytest.raises(ValueError, match="input tokens' buffer"):
        mk.step(tokens, positions, tables, logits, tokens)


def test_create_refuses_kv_groups_without_a_page_count():
    """Attention reads the pages through a tensor map sized by kv_num_pages: a group a layer
    uses must have one, and nothing is created without it."""
    from types import SimpleNamespace

    from northmk.native import NativeError

    config = north(num_layers=2)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=23)
    kv, _ = noisy_cache(config, 1, 100, seed=24)
    no_count = SimpleNamespace(pages=kv.pages, num_pages=[0] * len(kv.pages))
    with pytest.raises(NativeError, match="kv_num_pages 0 is not in"):
        Megakernel(config, weights, no_count)
    Megakernel(config, weights, kv).close()  # the same pages with their counts


def test_create_refuses_more_layers_than_its_table_holds(monkeypatch):
    """The layer table travels in the kernel's parameters (128 entries): a deeper model is
    refused with a message that says so, by the bindings and by the C ABI behind them, and one
    at the limit is built."""
    import northmk.megakernel
    from northmk.native import NativeError

    small = dict(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, vocab_size=1024, num_experts=4,
                 num_experts_per_tok=2, intermediate_size=64, prefix_dense_intermediate_size=128, sliding_window=128)
    for layers, ok in ((129, False), (128, True)):
        config = north(num_layers=layers, **small)
        weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=25)
        kv, _ = noisy_cache(config, 1, 100, seed=26)
        if ok:
            Megakernel(config, weights, kv).close()
            continue
        with pytest.raises(ValueError, match="at most 128 layers, got 129"):
            Megakernel(config, weights, kv)
        with monkeypatch.context() as m:  # past the bindings' check, nmk_mk_create's own
            m.setattr(northmk.megakernel, "unsupported_reason", lambda config: None)
            with pytest.raises(NativeError, match="at most 128 layers"):
                Megakernel(config, weights, kv)


def test_the_bench_loop_run_ahead_reads_the_tokens_of_the_waiting_loop():
    """northmk.bench's timed loop enqueues step t + 1 before it reads step t's tokens (as the
    engine's decode_ahead does): the host must read every step's tokens, the same ones a loop
    that waits for each step reads."""
    from northmk.bench import DecodeState, timed_steps

    config = north(num_layers=2)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=5)
    reads = []
    for ahead in (False, True):
        torch.manual_seed(9)  # the same first tokens and KV noise for both
        s = DecodeState(config, weights, 3, 700)
        _, read = timed_steps(s, 12, ahead)
        s.mk.close()
        reads.append(read)
    assert len(reads[1]) == 12 and all(len(r) == 3 for r in reads[1])
    assert reads[1] == reads[0]
    assert len({tuple(r) for r in reads[0]}) > 1  # the steps fed each other new tokens


def test_the_steps_greedy_tokens_are_the_samplers_greedy_draws_of_its_logits():
    """The engine serves a step of greedy rows that want no logprobs with the kernel's own
    ARGMAX tokens, where it would otherwise run nmk_sample's greedy draw on the logits: the two
    must agree (the largest logit, the lowest id among equal ones)."""
    from northmk.engine.gpu_sampling import DrawParams, GpuSampler

    config = north(num_layers=2)
    weights = synthetic_weights(config, torch.bfloat16, "cuda", seed=6)
    kv, tables = noisy_cache(config, 5, 900, seed=8)
    mk = Megakernel(config, weights, kv)
    sampler, greedy = GpuSampler("cuda"), [DrawParams(0.0, 0, 1.0, 0.0, 0, 0)] * 5
    tokens = torch.tensor([3, 14, 159, 2653, 58979], dtype=torch.int32, device="cuda")
    for step in range(4):
        logits, tokens = mk.step(tokens, [100 + step, 899, 20 + step, 64 + step, 500], tables)
        drawn, _ = sampler.draw(logits, greedy)
        assert torch.equal(tokens, drawn), step
    mk.close()
