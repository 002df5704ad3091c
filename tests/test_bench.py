"""The decode benchmark: its transformers peer runs our model, its speed-of-light arithmetic,
its result file, results-log line and plot, and its command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from northmk import bench  # noqa: E402
from northmk.bench_peer import bench_peer, build_peer, hf_config, random_context  # noqa: E402
from northmk.bench_plot import plotting_available  # noqa: E402
from northmk.checkpoint import synthetic_weights  # noqa: E402
from northmk.config import FULL, PAGE_SIZE, SLIDING, ModelConfig  # noqa: E402
from northmk.generate import generate  # noqa: E402
from northmk.model.kv import BatchLayout, PagedKVCache  # noqa: E402
from northmk.model.reference import ReferenceModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    config = bench.geometry("tiny")
    weights = synthetic_weights(config, torch.float32, "cpu", seed=3)
    return config, weights, build_peer(config, weights)


# ---- the peer is our model -----------------------------------------------------------------

def test_peer_gives_the_reference_models_logits_on_our_weights(tiny):
    config, weights, peer = tiny
    n = 2 * config.sliding_window - 7  # past the sliding window: both kinds of layer matter
    prompt = random_context(config.vocab_size, 1, n, torch.device("cpu"), seed=5)
    with torch.inference_mode():
        theirs = peer(prompt).logits[0].float()
    pages = -(-n // PAGE_SIZE)
    groups = len(config.attention_groups)
    kv = PagedKVCache(config, [pages] * groups, torch.float32, "cpu")
    layout = BatchLayout([n], [0], [torch.arange(pages, dtype=torch.int32).view(1, pages)] * groups)
    ref = ReferenceModel(config, weights)
    ours = ref.logits(ref.forward(prompt[0], layout, kv))
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_peer_at_full_north_geometry_has_norths_parameters_and_layer_pattern():
    from transformers import Cohere2MoeForCausalLM

    c = bench.north_geometry()
    hc = hf_config(c)
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = Cohere2MoeForCausalLM(hc)
    assert sum(p.numel() for p in model.parameters()) == c.num_params()  # tied head counted once
    assert hc.layer_types == list(c.layer_types) and hc.mlp_layer_types == list(c.mlp_types)
    assert (hc.sliding_window, hc.rope_parameters["rope_theta"], hc.rms_norm_eps) == (4096, 50000.0, 1e-6)
    assert (hc.expert_selection_fn, hc.norm_topk_prob, hc.logit_scale) == ("sigmoid", False, 1.0)


def test_peer_shares_our_weight_tensors_instead_of_copying_them(tiny):
    config, weights, peer = tiny
    layer = peer.model.layers[1]
    assert layer.self_attn.k_proj.weight.data_ptr() == weights.layers[1].qkv[config.q_size:].data_ptr()
    assert layer.mlp.experts.gate_up_proj.data_ptr() == weights.layers[1].experts_gate_up.data_ptr()
    assert peer.model.layers[0].mlp.up_proj.weight.data_ptr() == weights.layers[0].gate_up[config.dense_intermediate_size:].data_ptr()
    assert peer.lm_head.weight is peer.model.embed_tokens.weight
    assert peer.model.embed_tokens.weight.data_ptr() == weights.embed.data_ptr()
    assert not any(p.requires_grad for p in peer.parameters())
    assert not weights.embed.requires_grad


def test_peer_benchmark_decodes_the_reference_models_greedy_tokens(tiny):
    """The timed generate call (static cache) produces exactly our reference's greedy tokens."""
    config, weights, peer = tiny
    batch, context, steps, warmup = 2, config.sliding_window - 3, 4, 2  # decoding crosses the window
    row = bench_peer(peer, batch, context, steps, warmup)
    prompts = random_context(config.vocab_size, batch, context, torch.device("cpu")).tolist()
    want = generate(ReferenceModel(config, weights), prompts, 1 + warmup + steps)
    assert row["tokens"] == [g.token_ids for g in want]
    assert row["backend"] == "hf-transformers" and (row["batch"], row["context"]) == (batch, context)
    assert row["tok_s"] == pytest.approx(batch * 1e3 / row["ms_per_step"])
    assert config.top_k <= row["distinct_experts"] <= min(config.num_experts, batch * config.top_k)
    assert row["distinct_experts_source"] == "routed"
    assert row["compiled"] is False  # transformers compiles the step on accelerators only


def test_peer_benchmark_runs_in_bf16_as_on_the_gpu():
    config = bench.geometry("tiny")
    peer = build_peer(config, synthetic_weights(config, torch.bfloat16, "cpu", seed=0))
    row = bench_peer(peer, 3, 20, steps=2, warmup=1)
    assert peer.dtype == torch.bfloat16 and len(row["tokens"]) == 3 and len(row["tokens"][0]) == 4


def test_build_peer_and_bench_peer_reject_bad_input(tiny):
    config, weights, peer = tiny
    with pytest.raises(ValueError, match="layers"):
        build_peer(ModelConfig.from_dict({**config.raw, "num_hidden_layers": 4, "layer_types": None,
                                          "mlp_layer_types": None}), weights)
    with pytest.raises(ValueError, match="steps"):
        bench_peer(peer, 1, 10, steps=0)


def test_the_peer_refuses_experts_in_the_megakernels_layout_until_untiled():
    from northmk.model.weights import tile_experts_, untile_experts_

    config = bench.geometry("tiny")
    weights = synthetic_weights(config, torch.float32, "cpu", seed=3)
    tile_experts_(weights)  # as Megakernel leaves them
    with pytest.raises(ValueError, match="tiled layout"):
        build_peer(config, weights)
    untile_experts_(weights)  # what bench.peer_rows does first
    build_peer(config, weights)


def test_kv_layout_gives_a_sliding_row_its_windows_pages_as_a_ring():
    c = bench.north_geometry()
    pages, tables = bench.kv_layout(c, 2, 131072, "cpu")
    assert c.attention_groups == (FULL, SLIDING) and pages == [2 * 2048, 2 * 65]
    full, sliding = tables
    assert full.shape == sliding.shape == (2, 2048) and full.dtype == sliding.dtype == torch.int32
    assert torch.equal(full.flatten(), torch.arange(4096, dtype=torch.int32))
    for pos in (4095, 4096, 100000, 131071):  # every key a sliding layer reads at pos: distinct pages of its row
        cols = torch.arange(max(0, pos - c.sliding_window + 1), pos + 1) // PAGE_SIZE
        for r in range(2):
            seen = sliding[r, cols.unique()]
            assert len(set(seen.tolist())) == len(seen) and seen.min() >= 65 * r and seen.max() < 65 * (r + 1)
    # Shorter than the window: every group's row is its context's pages, as before.
    pages, tables = bench.kv_layout(c, 3, 700, "cpu")
    assert pages == [33, 33] and all(torch.equal(t, tables[0]) for t in tables)


# ---- speed of light --------------------------------------------------------------------------

def test_step_bytes_at_batch_1_8k_context_are_the_design_briefs_7_13_gb():
    c = bench.north_geometry()
    assert bench.step_bytes(c, 1, 8192, 8) == pytest.approx(7.13e9, rel=0.01)
    # weights alone (no KV): 3.305B active params in bf16
    assert bench.step_bytes(c, 1, 0, 8) == pytest.approx(6.61e9, rel=0.01)


def test_sol_curve_at_the_h200_datasheet_bandwidth_matches_the_notes_table():
    c = bench.north_geometry()
    curve = {p["batch"]: p["tok_s"] for p in bench.sol_curve(c, 8192, bench.DATASHEET_BW["H200"], 8)}
    assert curve[1] == pytest.approx(673, rel=0.01) and curve[8] == pytest.approx(1258, rel=0.01)
    assert bench.uniform_distinct(c, 8) == pytest.approx(51.6, abs=0.1)


def test_sol_fraction_counts_the_experts_the_step_routed_to():
    c, bw = bench.north_geometry(), bench.DATASHEET_BW["H200"]
    row = {"batch": 8, "context": 8192, "ms_per_step": 50.0, "distinct_experts": 40.0}
    wider = {**row, "distinct_experts": 60.0}
    assert bench.sol_fraction(c, row, bw) == pytest.approx(bench.step_bytes(c, 8, 8192, 40.0) / bw / 0.05)
    assert bench.sol_fraction(c, wider, bw) > bench.sol_fraction(c, row, bw)
    assert bench.sol_fraction(c, row, None) is None
    assert bench.datasheet_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert bench.datasheet_bandwidth("cpu") is None


# ---- results: the file, the log line, the plot -------------------------------------------------

def result_of(rows, device="NVIDIA H200"):
    return {"device": device, "commit": "abc1234", "date": "2026-11-30", "command": "python -m northmk.bench decode",
            "geometry": "north", "copy_bandwidth_bytes_s": 4.25e12, "rows": rows}


def row_of(backend, batch, tok_s, sol=None):
    return {"backend": backend, "batch": batch, "context": 8192, "tok_s": tok_s,
            "ms_per_step": batch * 1e3 / tok_s, "sol_fraction": sol}


def test_notes_line_lists_every_row_and_the_speedup_over_the_peer():
    rows = [row_of("megakernel", 1, 500.0, 0.743), row_of("megakernel", 8, 900.0, 0.715),
            row_of("hf-transformers", 1, 80.0, 0.119), row_of("hf-transformers", 8, 160.0, 0.127)]
    line = bench.notes_line(result_of(rows), Path("benchmarks/decode-x.json"))
    assert line.startswith("- 2026-11-30, abc1234, `python -m northmk.bench decode`, NVIDIA H200, context 8192: ")
    assert "megakernel batch 1 500.0 tok/s (2.000 ms/step, 74.3% of SoL), batch 8 900.0 tok/s" in line
    assert "hf-transformers batch 1 80.0 tok/s (12.500 ms/step, 11.9% of SoL)" in line
    assert "megakernel / hf-transformers batch 1 6.25x, batch 8 5.62x" in line
    assert "copy bandwidth 4.25 TB/s" in line and line.endswith("`benchmarks/decode-x.json`.")


def test_record_appends_to_the_results_log_section_only(tmp_path):
    notes = tmp_path / "NOTES.md"
    notes.write_text("# Notes\n\n## Results log\n\n- earlier run\n\n## Afterwards\n\nkept\n")
    result = result_of([row_of("megakernel", 1, 130.0)])
    bench.record(result, Path("r.json"), notes)
    text = notes.read_text()
    before, after = text.split("## Afterwards")
    assert before.rstrip().endswith(bench.notes_line(result, Path("r.json")))
    assert "- earlier run\n- 2026-11-30" in before and after == "\n\nkept\n"
    notes.write_text("# Notes without a log\n")
    with pytest.raises(ValueError, match="Results log"):
        bench.record(result, Path("r.json"), notes)


def test_old_result_files_get_the_speed_of_light_curve_of_their_device():
    curve = bench.with_sol_curve(result_of([row_of("megakernel", 1, 130.0)]))["sol_curve"]
    assert [p["batch"] for p in curve] == list(range(1, 9)) and curve[0]["tok_s"] == pytest.approx(673, rel=0.01)
    assert "sol_curve" not in bench.with_sol_curve(result_of([row_of("megakernel", 1, 130.0)], device="cpu"))


def test_plot_is_a_png_of_every_backend_with_the_speed_of_light_curve(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from northmk.bench_plot import plot_decode, series

    rows = [row_of(b, n, t * n) for b, t in (("megakernel", 130.0), ("hf-transformers", 60.0)) for n in (1, 2, 4, 8)]
    result = bench.with_sol_curve(result_of(rows))
    path = plot_decode(result, tmp_path / "plots" / "decode.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = imread(path).shape[:2]
    assert width > height > 400
    assert set(series(rows)) == {"megakernel", "hf-transformers"}
    twice = [{**row_of("megakernel", 1, 100.0), "commit": commit} for commit in ("a", "b")]
    assert set(series(twice)) == {"megakernel (a)", "megakernel (b)"}
    engine = [{**row_of("megakernel", 1, 100.0), "path": "engine", "decode_ahead": ahead} for ahead in (True, False)]
    assert set(series(rows[:1] + engine)) == {"megakernel", "megakernel through the engine",
                                              "megakernel through the engine, each step waited for"}
    with pytest.raises(ValueError, match="rows"):
        plot_decode(result_of([]), tmp_path / "empty.png")


# ---- the command line ---------------------------------------------------------------------------

def test_decode_on_cpu_writes_the_result_the_log_line_and_the_plot(tmp_path, capsys):
    notes = tmp_path / "NOTES.md"
    notes.write_text("## Results log\n")
    plot = ["--plot", str(tmp_path / "decode.png")] if plotting_available() else []
    argv = ["decode", "--peer-only", "--device", "cpu", "--geometry", "tiny", "--batch", "1", "2",
            "--context", "24", "--steps", "2", "--warmup", "1", "--out", str(tmp_path), "--record", str(notes), *plot]
    assert bench.main(argv) == 0
    [path] = tmp_path.glob("decode-*.json")
    result = json.loads(path.read_text())
    assert {"device", "commit", "date", "command", "rows"} <= set(result)
    assert result["command"] == "python -m northmk.bench " + " ".join(argv)
    assert [(r["backend"], r["batch"], r["context"]) for r in result["rows"]] == [("hf-transformers", 1, 24),
                                                                                 ("hf-transformers", 2, 24)]
    assert all(r["tok_s"] > 0 and r["ms_per_step"] > 0 and r["sol_fraction"] is None for r in result["rows"])
    assert notes.read_text().splitlines()[-1] == bench.notes_line(result, path)
    assert not plot or (tmp_path / "decode.png").is_file()
    assert "batch 2 (hf-transformers):" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["decode", "--batch", "0"],
    ["decode", "--batch", "two"],
    ["decode", "--batch", "9"],
    ["decode", "--context", "0", "--peer-only"],
    ["decode", "--steps", "0", "--peer-only"],
    ["decode", "--warmup", "-1", "--peer-only"],
    ["decode", "--no-peer", "--peer-only"],
    ["decode", "--device", "cpu"],
    ["decode", "--geometry", "huge"],
    ["decode", "--peer-only", "--record", "/nonexistent/NOTES.md"],
    ["profile"],
    [],
])
def test_bad_arguments_get_one_line_and_status_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0], err


def test_plot_command_joins_the_rows_of_several_result_files(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    megakernel, peer = tmp_path / "mk.json", tmp_path / "peer.json"
    megakernel.write_text(json.dumps(result_of([row_of("megakernel", b, 130.0 * b) for b in (1, 8)])))
    peer.write_text(json.dumps(result_of([row_of("hf-transformers", b, 80.0 * b) for b in (1, 8)])))
    assert bench.main(["plot", str(megakernel), str(peer), "--out", str(tmp_path / "both.png")]) == 0
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    assert "plotted" in capsys.readouterr().out


def test_record_and_plot_commands_reject_a_file_that_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    assert bench.main(["record", str(bad), "--notes", str(tmp_path / "NOTES.md")]) == 2
    assert bench.main(["plot", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "non-empty 'rows'" in err[0] and "missing.json" in err[1]


def test_module_entry_point_reports_bad_arguments_in_one_line():
    run = subprocess.run([sys.executable, "-m", "northmk.bench", "decode", "--batch", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0 and "--batch" in run.stderr


def test_a_failing_backend_keeps_the_rows_measured_before_it(tmp_path, monkeypatch, capsys):
    import northmk.bench_peer as peer

    real = peer.bench_peer

    def out_of_memory_at_batch_2(model, batch, *args):
        if batch == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return real(model, batch, *args)

    monkeypatch.setattr(peer, "bench_peer", out_of_memory_at_batch_2)
    notes = tmp_path / "NOTES.md"
    notes.write_text("## Results log\n")
    argv = ["decode", "--peer-only", "--device", "cpu", "--geometry", "tiny", "--batch", "1", "2", "4",
            "--context", "16", "--steps", "2", "--out", str(tmp_path), "--record", str(notes)]
    assert bench.main(argv) == 1
    [path] = tmp_path.glob("decode-*.json")
    result = json.loads(path.read_text())
    assert [r["batch"] for r in result["rows"]] == [1]
    assert result["error"] == "OutOfMemoryError: CUDA out of memory (injected)"
    assert "FAILED: OutOfMemoryError" in notes.read_text()
    assert "out of memory (injected)" in capsys.readouterr().err


def test_task_time_summary_follows_the_schedules_tasks():
    """summarize_tasks on a step timed as the kernel would time it: the SMs run their lists and
    drain the queues in the interpreter's order, every task 1 us, starting once its SM is free
    and each counter of its wait span is complete; each record says which SM ran it (op |
    layer << 8 | sm << 16)."""
    import numpy as np

    from northmk.checkpoint_writer import config_dict
    from northmk.megakernel import Opcode, Schedule
    from northmk.megakernel_interpreter import execution_order

    schedule = Schedule(ModelConfig.from_dict(config_dict("mk-small")), 4, [100, 37])
    tasks, spans = schedule.tasks, schedule.wait_spans()
    rows = np.zeros((len(tasks), 4), dtype=np.int64)
    clock, ready = [0] * schedule.num_sms, {}
    for sm, i in execution_order(schedule):
        wait, signal = int(tasks["wait"][i]), int(tasks["signal"][i])
        start = max([clock[sm]] + [ready.get(c, 0) for c in range(wait, wait + int(spans[i]))])
        rows[i] = [clock[sm], start, start + 1000, int(tasks["op"][i]) | int(tasks["layer"][i]) << 8 | sm << 16]
        clock[sm] = start + 1000
        if signal >= 0:
            ready[signal] = max(ready.get(signal, 0), start + 1000)
    timed = rows[rows[:, 2] > 0]  # DRAIN entries are not timed
    summary = bench.summarize_tasks(torch.from_numpy(timed))
    ops = tasks["op"][tasks["op"] != Opcode.DRAIN].tolist()
    for op in Opcode:
        if op in ops:
            assert summary["ops"][op.name]["tasks"] == ops.count(op)
            assert summary["ops"][op.name]["run_us"] == pytest.approx(ops.count(op))
        else:
            assert op.name not in summary["ops"]
    assert summary["span_us"] == pytest.approx(max(clock) / 1e3)
    per_sm = np.bincount(timed[:, 3] >> 16, minlength=schedule.num_sms)
    assert (per_sm > 0).all()
    assert summary["sm_busy_us"] == pytest.approx({"mean": per_sm.mean(), "min": per_sm.min(), "max": per_sm.max()})
    assert set(summary["chain_us"]) >= {"NORM", "QKV", "ATTN", "OPROJ", "GATE_UP", "DOWN"}
    assert summary["chain_us"]["NORM"] < summary["chain_us"]["ATTN"] < summary["chain_us"]["OPROJ"]
    assert summary["layer_us"] > 0
    assert set(summary["timeline_us"]) == set(summary["chain_us"])
    for name, (first, mid_start, mid_end, last) in summary["timeline_us"].items():
        assert first <= mid_start <= mid_end <= last, name
        assert mid_end == pytest.approx(mid_start + 1.0), name  # every task runs 1 us
        assert last == pytest.approx(summary["chain_us"][name]), name
    # the clock starts at the layer's first list task (layer 0: a NORM tile; later ones: QKV or ROUTER)
    assert summary["timeline_us"]["NORM"][0] == 0.0
    assert min(summary["timeline_us"][name][0] for name in ("QKV", "ROUTER")) == 0.0
    assert summary["timeline_us"]["ATTN"][0] >= summary["timeline_us"]["QKV"][0] + 1.0  # after a QKV task ran

    # DRAIN records, were a kernel to write them, count as DRAIN only: not as an SM's work, not in a chain.
    drains = [[0, 0, int(max(clock)), int(Opcode.DRAIN) | l << 8 | sm << 16]
              for sm in range(schedule.num_sms) for l in range(schedule.num_queues)]
    with_drains = bench.summarize_tasks(torch.from_numpy(np.concatenate([timed, np.array(drains, dtype=np.int64)])))
    assert with_drains["ops"]["DRAIN"]["tasks"] == schedule.num_sms * schedule.num_queues
    assert with_drains["sm_busy_us"] == summary["sm_busy_us"] and with_drains["chain_us"] == summary["chain_us"]

    # Bits above the SM field (a diagnostic build's extra data) change nothing.
    tagged = timed.copy()
    tagged[:, 3] |= (np.arange(len(tagged), dtype=np.int64) % 3) << 32
    assert bench.summarize_tasks(torch.from_numpy(tagged)) == summary


def test_the_commit_given_by_the_caller_wins_over_the_checkouts(monkeypatch):
    monkeypatch.setenv("NORTHMK_COMMIT", "abc1234-dirty")
    assert bench.git_commit() == "abc1234-dirty"
    monkeypatch.delenv("NORTHMK_COMMIT")
    assert bench.git_commit() not in ("", "abc1234-dirty")  # this checkout's HEAD, or "uncommitted" without git
