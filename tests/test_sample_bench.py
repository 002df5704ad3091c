"""tools/sample_bench.py's command line off the GPU: bad arguments and a machine without CUDA
each get a one-line error and exit status 2 (the draws themselves run in tools/gpu_run.sh's calls)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/sample_bench.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args", [["--rows", "0"], ["--rows", "1", "65"], ["--repeats", "0"]])
def test_bad_arguments_get_one_line_and_status_2(args):
    done = run(*args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["tools/sample_bench.py: error: want --rows in [1, 64] and --repeats >= 1"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA: the tool would draw")
def test_without_cuda_it_says_so():
    done = run("--rows", "1")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["tools/sample_bench.py: error: nmk_sample needs a CUDA device (torch sees none)"]
