"""Backend selection ("auto", "torch", "megakernel") and the scheduler's choice, per decode
step, between drawing every row on the device sampler and sampling on the host.

The device path runs here with gpu_sampling's CPU reference of the GPU sampler behind the
GpuSampler API (the megakernel itself needs an sm_90 GPU: tests/gpu/test_serve_megakernel.py)."""

import asyncio
import json
import logging
import math
import re

import pytest
import structlog
import torch

from northmk.checkpoint_writer import config_dict
from northmk.config import ModelConfig
from northmk.engine import AsyncEngine, EngineConfig, GenerationRequest, SamplingParams
from northmk.engine.gpu_sampling import DrawParams, reference_draw
from northmk.engine.mk_runner import megakernel_unavailable
from northmk.serve import build_parser, configs, main
from tests.server.helpers import ahead_workload

PROMPTS = [[2, 17, 99, 301, 5], [2] + list(range(40, 110)), [2, 900, 901]]
MK_GPU = EngineConfig(device="cuda", dtype="bfloat16")


class ReferenceSampler:
    """GpuSampler's contract computed on the CPU (gpu_sampling.reference_draw); keeps each draw's params."""

    def __init__(self):
        self.draws: list[list[DrawParams]] = []

    def draw(self, logits: torch.Tensor, params: list[DrawParams]) -> tuple[torch.Tensor, torch.Tensor]:
        self.draws.append(list(params))
        tokens, logprobs = reference_draw(logits, params)
        return tokens.to(torch.int32), logprobs


def config_only(tmp_path, preset="mk-small", **overrides):
    """A checkpoint directory with only config.json: enough for the checks made before loading."""
    (tmp_path / "config.json").write_text(json.dumps(config_dict(preset, **overrides)))
    return tmp_path


@pytest.fixture
def restore_logging():
    """serve.main configures logging onto the captured stderr; put the test session's back."""
    root = logging.getLogger()
    handlers, level, config = root.handlers[:], root.level, structlog.get_config()
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    structlog.configure(**config)


async def run(engine, prompt, request_id, **params):
    """(token ids, logprobs) of choice 0 of one request."""
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    ids, logprobs = [], []
    async for out in engine.generate(GenerationRequest(request_id, list(prompt), SamplingParams(**params))):
        ids += out.outputs[0].token_ids
        logprobs += out.outputs[0].logprobs or []
    return ids, logprobs


# ---- choosing the backend ---------------------------------------------------------------------
def test_the_kv_budget_leaves_what_the_backend_allocates_beside_the_kv():
    """kv_page_counts sizes the full group from the memory budget less the backend's reserved
    bytes (the megakernel's tiled weight copies: MegakernelRunner.reserved_bytes)."""
    from northmk.engine.runner import CPU_KV_BUDGET_BYTES, kv_page_counts
    from northmk.model.kv import PagedKVCache

    model = ModelConfig.from_dict(config_dict("tiny"))
    engine, long = EngineConfig(max_batch=8), 10_000 * 64  # the budget binds: 8 rows of it take ~80K pages
    page = sum(PagedKVCache.bytes_per_page(model, torch.float32))
    assert kv_page_counts(engine, model, long, torch.float32)[0] == CPU_KV_BUDGET_BYTES // page
    assert kv_page_counts(engine, model, long, torch.float32, 1 << 30)[0] == (CPU_KV_BUDGET_BYTES - (1 << 30)) // page
    # never fewer than one row of max_model_len
    assert kv_page_counts(engine, model, 4096, torch.float32, 4 << 30)[0] == 4096 // 64


def test_tiled_experts_whose_triton_gemms_cannot_run_are_untiled_per_prefill(monkeypatch):
    """Where model.tiled_moe fails when the megakernel runner compiles it (here its import), the
    runner says why and the reference's MoE untiles the routed experts from then on."""
    import sys

    from northmk.checkpoint import synthetic_weights
    from northmk.engine import mk_runner
    from northmk.model import reference
    from northmk.model.weights import tile_experts_

    config = ModelConfig.from_dict(config_dict("tiny"))
    weights = synthetic_weights(config, torch.float32, "cpu", seed=0)
    tile_experts_(weights)
    monkeypatch.setattr(reference, "_tiled_gemm_unusable", None)
    monkeypatch.setattr(mk_runner, "tiled_gemm_available", lambda device: True)
    monkeypatch.setitem(sys.modules, "northmk.model.tiled_moe", None)  # its import raises ImportError
    with structlog.testing.capture_logs() as logs:
        mk_runner.MegakernelRunner._warm_up_tiled_experts(weights)
    [line] = [e for e in logs if "Triton" in e["event"]]
    assert line["log_level"] == "warning" and "import of northmk.model.tiled_moe halted" in line["error"]
    assert not reference.tiled_gemm_available(torch.device("cuda"))


def test_auto_is_the_default_and_picks_torch_on_cpu_saying_why(tiny_checkpoint):
    assert EngineConfig().backend == "auto"
    with structlog.testing.capture_logs() as logs:
        engine = AsyncEngine.from_config(EngineConfig(model=tiny_checkpoint))
    assert engine.backend == "torch" and engine.device_sampler is None
    [line] = [e for e in logs if e["event"] == "engine backend"]
    assert line["backend"] == "torch" and line["requested"] == "auto"
    assert line["reason"] == "the megakernel needs a CUDA device, not 'cpu'"
    engine.pool.close()


def test_an_explicit_torch_backend_logs_no_reason(tiny_checkpoint):
    with structlog.testing.capture_logs() as logs:
        engine = AsyncEngine.from_config(EngineConfig(model=tiny_checkpoint, backend="torch"))
    [line] = [e for e in logs if e["event"] == "engine backend"]
    assert engine.backend == "torch" and line["requested"] == "torch" and "reason" not in line
    engine.pool.close()


@pytest.mark.parametrize("preset,overrides,engine,reason", [
    ("tiny", {}, MK_GPU, "head_dim 128"),
    ("default", {}, MK_GPU, "head_dim 128"),
    ("mk-small", {"hidden_size": 384}, MK_GPU, r"hidden_size.* multiple of 256"),
    ("mk-small", {"num_experts": 160}, MK_GPU, r"128 experts|num_experts <= 128"),
    ("mk-small", {"tie_word_embeddings": False}, MK_GPU, "tied embeddings"),
    ("mk-small", {"expert_selection_fn": "softmax"}, MK_GPU, "sigmoid routing"),
    ("mk-small", {}, EngineConfig(device="cuda", dtype="float16"), "bfloat16 weights, not float16"),
    ("mk-small", {}, EngineConfig(device="cuda", dtype="bfloat16", max_batch=16), "at most 8 rows"),
    ("mk-small", {}, EngineConfig(device="cpu", dtype="bfloat16"), "needs a CUDA device, not 'cpu'"),
])
def test_why_the_megakernel_cannot_serve(preset, overrides, engine, reason):
    why = megakernel_unavailable(engine, ModelConfig.from_dict(config_dict(preset, **overrides)))
    assert why is not None and re.search(reason, why), why


def test_mk_small_is_a_geometry_the_megakernel_runs():
    config = ModelConfig.from_dict(config_dict("mk-small"))
    assert config.vocab_size == ModelConfig.from_dict(config_dict("default")).vocab_size
    assert {"dense", "sparse"} <= set(config.mlp_types) and len(set(config.layer_types)) == 2
    reason = megakernel_unavailable(MK_GPU, config)
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the reason, if any, is about this machine")
    assert reason == "CUDA is not available (torch sees no GPU)"  # every model and setting check passed


def test_an_explicit_megakernel_that_cannot_run_fails_with_the_reason(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="backend 'megakernel' needs device 'cuda'"):
        EngineConfig(model=tiny_checkpoint, backend="megakernel", device="cpu")
    with pytest.raises(ValueError, match=r"^backend 'megakernel' cannot serve tiny\d* here: .*head_dim 128"):
        AsyncEngine.from_config(EngineConfig(model=tiny_checkpoint, backend="megakernel", device="cuda",
                                             dtype="bfloat16"))
    untied = config_only(tmp_path, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="tied embeddings"):
        AsyncEngine.from_config(EngineConfig(model=untied, backend="megakernel", device="cuda", dtype="bfloat16"))


# ---- the CLI ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,device,dtype,backend", [
    ([], "cpu", "float32", "auto"),
    (["--device", "cuda"], "cuda", "bfloat16", "auto"),
    (["--backend", "megakernel"], "cuda", "bfloat16", "megakernel"),
    (["--backend", "torch", "--device", "cuda:1", "--dtype", "float32"], "cuda:1", "float32", "torch"),
])
def test_cli_flags_map_onto_the_engine_config(tiny_checkpoint, argv, device, dtype, backend):
    engine, _ = configs(build_parser().parse_args(["--model", str(tiny_checkpoint), *argv]))
    assert (engine.device, engine.dtype, engine.backend) == (device, dtype, backend)


@pytest.mark.parametrize("overrides,argv,message", [
    ({}, ["--device", "cpu"], "backend 'megakernel' needs device 'cuda'"),
    ({}, ["--dtype", "float32"], "bfloat16 weights, not float32"),
    ({}, ["--max-batch", "16"], "at most 8 rows per step"),
    ({"hidden_size": 384}, [], r"hidden_size.* multiple of 256"),
    ({"head_dim": 64}, [], "head_dim 128"),
])
def test_cli_megakernel_that_cannot_run_is_one_line_and_exit_2(tmp_path, overrides, argv, message, capsys,
                                                                restore_logging):
    model = config_only(tmp_path, **overrides)
    assert main(["--model", str(model), "--backend", "megakernel", *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("python -m northmk.serve: error: backend 'megakernel' ")
    assert re.search(message, err[0]), err[0]


# ---- sampling on the device or on the host, per step -------------------------------------------
async def test_greedy_rows_draw_on_the_device_with_the_host_paths_tokens_and_logprobs(make_engine):
    sampler = ReferenceSampler()
    device = await make_engine(device_sampler=sampler, max_batch=4)
    host = await make_engine(max_batch=4)
    asks = [dict(logprobs=0, max_tokens=20), dict(max_tokens=20), dict(logprobs=0, max_tokens=9)]
    for engine in (device, host):
        engine.results = await asyncio.gather(*[
            run(engine, p, f"r{i}", **ask) for i, (p, ask) in enumerate(zip(PROMPTS, asks))])
    assert sampler.draws and all(p.temperature == 0.0 for draw in sampler.draws for p in draw)
    assert max(len(draw) for draw in sampler.draws) > 1  # rows shared device steps
    for (ids, lps), (host_ids, host_lps), ask in zip(device.results, host.results, asks):
        assert ids == host_ids
        assert len(lps) == (len(ids) if "logprobs" in ask else 0)
        for lp, host_lp in zip(lps, host_lps):
            assert lp.top == [] == host_lp.top and lp.token_id == host_lp.token_id
            assert math.isclose(lp.logprob, host_lp.logprob, rel_tol=1e-5, abs_tol=1e-5)


async def test_greedy_steps_take_the_tokens_the_step_computed_and_run_no_sampler(make_engine):
    """A backend whose step reduces its logits to greedy tokens (the megakernel's ARGMAX tasks)
    serves a step of greedy rows that want no logprobs with them: no draw runs for it. A step
    with a row that wants its logprob, or samples, still draws. Here the PyTorch step is given
    that reduction (the first of equal maxima, as the kernel and nmk_sample's greedy take)."""
    sampler = ReferenceSampler()
    device = await make_engine(device_sampler=sampler, max_batch=4)
    host = await make_engine(max_batch=4)
    decode, reduced = device.runner.decode_on_device, []

    def decode_greedy(tokens, positions, tables):
        logits = decode(tokens, positions, tables)
        reduced.append(len(positions))
        return logits, torch.argmax(logits, dim=-1).to(torch.int32)

    device.runner.decode_greedy_on_device = decode_greedy
    for engine in (device, host):
        engine.results = await asyncio.gather(*[run(engine, p, f"g{i}", max_tokens=24)
                                                for i, p in enumerate(PROMPTS)])
    assert [ids for ids, _ in device.results] == [ids for ids, _ in host.results]
    assert max(reduced) > 1 and sampler.draws == []  # steps of several greedy rows took the step's tokens
    s = device.scheduler
    assert s.greedy_rows_undrawn - s.ahead_rows_dropped == sum(len(ids) - 1 for ids, _ in device.results)

    reduced.clear()
    ids, lps = await run(device, PROMPTS[0], "lp", max_tokens=12, logprobs=0)
    host_ids, host_lps = await run(host, PROMPTS[0], "lp", max_tokens=12, logprobs=0)
    assert ids == host_ids and len(lps) == 12
    assert all(math.isclose(a.logprob, b.logprob, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(lps, host_lps))
    assert reduced == [] and len(sampler.draws) == 11  # each decode step's logprob came from its draw
    await run(device, PROMPTS[0], "t", max_tokens=8, temperature=1.0, seed=3)
    assert reduced == [] and [d[0].temperature for d in sampler.draws[11:]] == [1.0] * 7


async def test_seeded_device_draws_repeat_and_differ_from_the_hosts(make_engine):
    sampler = ReferenceSampler()
    device = await make_engine(device_sampler=sampler)
    host = await make_engine()
    params = dict(max_tokens=16, temperature=1.0, seed=11)
    first, again = [(await run(device, PROMPTS[0], f"d{i}", **params))[0] for i in range(2)]
    other = (await run(device, PROMPTS[0], "d-other", **{**params, "seed": 12}))[0]
    on_host = (await run(host, PROMPTS[0], "h", **params))[0]
    assert first == again and first != other
    assert first[0] == on_host[0]  # the first token is sampled after prefill, on the host
    assert first != on_host  # so the draws below did come from the device sampler
    # One device draw per decode step: 15 per request after the first token, each of one row.
    assert len(sampler.draws) == 3 * 15 and all(len(d) == 1 and d[0].temperature == 1.0 for d in sampler.draws)


async def test_a_row_that_needs_the_host_takes_the_whole_step_there(make_engine):
    # A row asking for top-logprob alternatives is sampled on the host, and so is every row
    # that shares a step with it: the seeded row below draws the host path's tokens.
    sampler = ReferenceSampler()
    device = await make_engine(device_sampler=sampler, max_batch=2)
    host = await make_engine(max_batch=2)
    seeded = dict(max_tokens=12, temperature=1.0, seed=5)
    expected = (await run(host, PROMPTS[0], "alone", **seeded))[0]
    alone_on_device = (await run(device, PROMPTS[0], "alone", **seeded))[0]
    assert alone_on_device != expected

    sampler.draws.clear()
    request = GenerationRequest("long", PROMPTS[1], SamplingParams(max_tokens=200, temperature=0.0, logprobs=2,
                                                                   ignore_eos=True))
    outputs = device.generate(request)
    first = await anext(outputs)  # "long" is a decode row from here on
    ids, _ = await run(device, PROMPTS[0], "seeded", **seeded)
    assert ids == expected
    rest = [out async for out in outputs]
    lps = first.outputs[0].logprobs + [lp for out in rest for lp in out.outputs[0].logprobs]
    assert len(lps) == 200 and all(len(lp.top) == 2 for lp in lps)
    assert sampler.draws == []  # every step had the row that needs the host


# ---- steps enqueued ahead ----------------------------------------------------------------------
async def test_steps_enqueued_ahead_give_the_same_tokens_and_logprobs(make_engine):
    """The scheduler enqueues step t + 1 before it waits for step t's tokens and uses it when the
    next batch is among its rows at its positions: the tokens, logprobs and draws per row are
    those of an engine that waits for each step."""
    ahead_sampler, plain_sampler = ReferenceSampler(), ReferenceSampler()
    ahead = await make_engine(device_sampler=ahead_sampler)
    plain = await make_engine(device_sampler=plain_sampler, decode_ahead=False)
    prompts, stops = [PROMPTS[1], PROMPTS[0], PROMPTS[2]], list(range(300, 360))
    got, want = await ahead_workload(ahead, run, prompts, stops), await ahead_workload(plain, run, prompts, stops)
    assert len(got[0][0]) == 100 and len(got[0][1]) == 100
    assert sorted(len(got[i][0]) for i in (1, 2))[0] < 90, "no choice stopped early: pick another seed"
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want):
        assert ids == ref_ids
        assert [(lp.token_id, lp.logprob) for lp in lps] == [(lp.token_id, lp.logprob) for lp in ref_lps]
    s = ahead.scheduler
    assert plain.scheduler.ahead_steps_taken == 0 == plain.scheduler.ahead_rows_dropped
    assert s.ahead_steps_taken > 150 and s.ahead_rows_dropped > 0  # of ~250 decode steps
    # Steps whose row starts a page were enqueued ahead too, on pages the pool gave a step early:
    # request "a"'s row at position 128, "c"'s at 64 (the choices of "b" stop before 64 here).
    assert s.ahead_pages_reserved >= 2 and plain.scheduler.ahead_pages_reserved == 0
    drawn = sum(len(ids) - 1 for ids, _ in got)  # each row's first token comes from prefill
    assert sum(map(len, ahead_sampler.draws)) - s.ahead_rows_dropped == drawn == sum(map(len, plain_sampler.draws))
    # The seeded draws used are the plain engine's, row for row: a step enqueued ahead drew with
    # the next token's counter. (The greedy request's seed is random per engine.)
    used = {(p.seed, p.counter) for d in plain_sampler.draws for p in d if p.temperature > 0}
    assert used and used <= {(p.seed, p.counter) for d in ahead_sampler.draws for p in d}


async def test_rows_joining_and_leaving_beside_steps_enqueued_ahead(make_engine):
    """Concurrent requests (joins park the loop, stops and lengths end rows at any step): every
    request gets all its tokens, and the draws used are one per token drawn."""
    sampler = ReferenceSampler()
    engine = await make_engine(device_sampler=sampler, max_batch=4)
    asks = [dict(max_tokens=80, temperature=1.0, seed=i, stop_token_ids=[300 + i]) for i in range(6)]
    results = await asyncio.gather(*[run(engine, PROMPTS[i % 3], f"r{i}", **ask) for i, ask in enumerate(asks)])
    for (ids, _), ask in zip(results, asks):
        assert len(ids) == 80 or ids[-1] in ask["stop_token_ids"]
    s = engine.scheduler
    assert s.ahead_steps_taken > 0
    assert sum(map(len, sampler.draws)) - s.ahead_rows_dropped == sum(len(ids) - 1 for ids, _ in results)

    # A row that needs the host joins a row that draws ahead on the device: the step enqueued
    # ahead before the park is dropped (and counted), and the steps they share sample on the
    # host: of the device row's 149 decode steps, the 19 shared with the host row's draw there.
    used = lambda: sum(map(len, sampler.draws)) - s.ahead_rows_dropped  # device draws whose tokens were used
    before = used()
    outputs = engine.generate(GenerationRequest("device", PROMPTS[1], SamplingParams(max_tokens=150, ignore_eos=True)))
    first = await anext(outputs)
    host_ids, host_lps = await run(engine, PROMPTS[0], "host", max_tokens=20, logprobs=2)
    rest = [out async for out in outputs]
    assert len(host_ids) == 20 and all(len(lp.top) == 2 for lp in host_lps)
    assert len(first.outputs[0].token_ids) + sum(len(o.outputs[0].token_ids) for o in rest) == 150
    assert used() - before == 149 - 19
