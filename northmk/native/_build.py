"""Build libnorthmk in a source checkout (for tests and development; users `pip install .`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ._lib import LIB_NAME, PACKAGE_DIR, SOURCE_ROOT


def build_in_tree(build_dir: Path | None = None, cuda: str = "off") -> Path:
    """Configures (once) and builds build/<name>/libnorthmk.so incrementally; returns its path."""
    if not (SOURCE_ROOT / "CMakeLists.txt").is_file():
        raise FileNotFoundError(f"no CMakeLists.txt in {SOURCE_ROOT}: not a source checkout")
    if shutil.which("cmake") is None:
        raise FileNotFoundError("cmake is needed to build libnorthmk (pip install cmake)")
    build_dir = build_dir or SOURCE_ROOT / "build" / f"dev-cuda-{cuda}"
    if not (build_dir / "CMakeCache.txt").is_file():
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run(["cmake", "-S", str(SOURCE_ROOT), "-B", str(build_dir), *generator, f"-DNORTHMK_CUDA={cuda}"])
    _run(["cmake", "--build", str(build_dir)])
    return build_dir / LIB_NAME


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")


def ensure_library() -> Path:
    """The library the tests should use: $NORTHMK_LIB if set, else the installed package's
    (what `pip install .` built), else an in-tree build (a source checkout run with
    PYTHONPATH); $NORTHMK_LIB is pointed at the result."""
    if os.environ.get("NORTHMK_LIB"):
        return Path(os.environ["NORTHMK_LIB"])
    installed = PACKAGE_DIR / LIB_NAME
    path = installed if installed.is_file() else build_in_tree()
    os.environ["NORTHMK_LIB"] = str(path)
    return path
