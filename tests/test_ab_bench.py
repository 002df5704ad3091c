"""tools/ab_bench.sh's host side: the variant trees it prepares and its errors."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "ab_bench.sh"

pytestmark = pytest.mark.skipif(not (ROOT / ".git").exists() or not shutil.which("git"),
                                reason="needs the git checkout")


def ab(cwd, *args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, env=env)


@pytest.fixture
def clone(tmp_path):
    subprocess.run(["git", "clone", "-q", str(ROOT), str(tmp_path / "repo")], check=True)
    return tmp_path / "repo"


def test_prepare_exports_the_library_sources_and_the_revision(clone):
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD~1"], cwd=clone, capture_output=True, text=True,
                         check=True).stdout.strip()
    out = ab(clone, "prepare", "base", "HEAD~1")
    assert out.returncode == 0, out.stderr
    tree = clone / "ab" / "base"
    assert (tree / "COMMIT").read_text().strip() == rev
    for path in ("CMakeLists.txt", "pyproject.toml", "include/northmk.h", "cuda/mk/vm.cuh", "tools/ab_bench.sh",
                 "northmk/bench.py", "northmk/native/_lib.py"):  # the variant's library and its own package
        assert (tree / path).is_file(), path
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert status == "", "ab/ must stay out of git"


@pytest.mark.parametrize("args, message", [
    (["prepare", "x"], "usage:"),
    (["prepare", "x", "no-such-revision"], "is not a revision"),
    (["frobnicate"], "usage:"),
])
def test_bad_calls_say_what_is_wrong(clone, args, message):
    out = ab(clone, *args)
    assert out.returncode == 2 and message in out.stderr
    assert not (clone / "ab").exists()


def test_run_without_variants_stops_with_a_message(clone, tmp_path):
    out = ab(clone, "run", env={**os.environ, "OUT": str(tmp_path / "out")})
    assert out.returncode == 1 and "no variant built" in out.stderr


@pytest.mark.skipif(not (shutil.which("cmake") and shutil.which("ninja")), reason="needs cmake and ninja")
def test_run_benches_each_variant_per_round_and_packs_the_results(clone, tmp_path):
    # A variant tree with an empty project and a bench of its own: the run path without a GPU.
    tree = clone / "ab" / "fake"
    (tree / "northmk").mkdir(parents=True)
    (tree / "COMMIT").write_text("abc1234\n")
    (tree / "CMakeLists.txt").write_text("cmake_minimum_required(VERSION 3.18)\nproject(fake NONE)\n")
    (tree / "northmk" / "__init__.py").write_text("")
    (tree / "northmk" / "bench.py").write_text(
        "import os, pathlib, sys\n"
        "out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
        "out.mkdir(parents=True)\n"
        "(out / 'decode.json').write_text(os.environ['NORTHMK_COMMIT'] + ' ' + ' '.join(sys.argv[1:]))\n"
        "print('batch 1: 123.4 tok/s')\n")
    # python3 without site-packages, as on the device: an editable install of this checkout would
    # shadow the variant's package (the run says so and skips the variant).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "AB_ROUNDS": "2", "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    run = ab(clone, "run", "--batch", "1", env=env)
    assert run.returncode == 0, run.stderr
    # a fresh clone carries no wheels: the run says the CUDA build will miss nvidia-cutlass
    assert "WARNING: no wheels in .whl/" in run.stdout
    assert "round 1: fake rc=0" in run.stdout and "round 2: fake rc=0" in run.stdout
    assert run.stdout.rstrip().splitlines()[-2:] == ["fake r1  batch 1: 123.4 tok/s", "fake r2  batch 1: 123.4 tok/s"]
    assert (out / "ab-fake-r2" / "decode.json").read_text().startswith("abc1234 decode --out ")
    packed = subprocess.run(["tar", "-tzf", str(out / "0ab.tgz")], capture_output=True, text=True, check=True).stdout
    for name in ("ab-fake-r1/decode.json", "ab-fake-r2/decode.json", "ab-fake-r1.log", "ab-fake.build.log"):
        assert name in packed.split(), name
