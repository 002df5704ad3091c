"""tools/gpu_run.sh's choice of stages (DRY_RUN=1 prints them and stops before the wheels and the
build): the tests and the bench when no stage is named, only the named ones otherwise."""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The script's own list of stages (its `stages=(...)` line), so that a stage it adds is cleared too.
STAGES = re.search(r"^stages=\(([^)]*)\)", (ROOT / "tools/gpu_run.sh").read_text(), re.M).group(1).split()


def stages(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in STAGES}
    done = subprocess.run(["bash", "tools/gpu_run.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**clean, **env, "DRY_RUN": "1", "OUT": "/nonexistent/out"})
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize(("env", "want"), [
    ({}, ["TESTS", "BENCH"]),
    ({"ENGINE": "1"}, ["ENGINE"]),
    ({"TESTS": "1"}, ["TESTS"]),
    ({"TESTS": "0"}, ["BENCH"]),
    ({"SANITIZE": "1", "TESTS": "1", "BENCH": "1"}, ["SANITIZE", "TESTS", "BENCH"]),
    ({"SERVER": "1", "BENCH": "1", "PEER": "0"}, ["SERVER", "BENCH"]),
])
def test_naming_a_stage_runs_only_the_named_ones(env, want):
    assert stages(**env) == want
