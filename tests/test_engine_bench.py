"""tools/engine_bench.py on the CPU (the torch backend, the tiny geometry): its window opens and
closes, and it writes one row per batch with the loop thread's timings and the scheduler's counts."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_engine_bench_writes_a_row_per_batch(tmp_path):
    command = [sys.executable, "tools/engine_bench.py", "--geometry", "tiny", "--device", "cpu", "--backend", "torch",
               "--batch", "1", "2", "--context", "100", "--steps", "12", "--ragged", "--temperature", "0.7",
               "--top-p", "0.9", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [path] = tmp_path.glob("engine-*.json")
    result = json.loads(path.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    # --ragged: row i's prompt is i * 64 / B tokens shorter; the row reports their mean
    assert [r["context"] for r in result["rows"]] == [100, (100 + 68) / 2]
    for row in result["rows"]:
        assert row["backend"] == "torch" and row["ragged"] and (row["temperature"], row["top_p"]) == (0.7, 0.9)
        # the host samples here (no GPU sampler), so no step is enqueued ahead
        assert row["scheduler"] == {"ahead_steps_taken": 0, "ahead_rows_dropped": 0, "ahead_pages_reserved": 0,
                                    "greedy_rows_undrawn": 0}
        assert row["window_tokens"] >= 12 * row["batch"] and row["tok_s"] > 0
        # the steps whose whole call falls inside the window: all but those at its edges
        assert row["loop_thread"]["calls"] >= 12 - 3 and row["first_window_period_us"]["p50"] > 0
