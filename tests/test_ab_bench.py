"""tools/ab_bench.sh's host side: the variant trees it prepares and its errors."""
import os
import shutil
import subprocess
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
