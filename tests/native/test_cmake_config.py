"""CMake's choice of backends (CMakeLists.txt, "CUDA detection"), configured without building:
with nvcc but without the CUTLASS headers, NORTHMK_CUDA=auto falls back to the host library and
says why, NORTHMK_CUDA=on refuses to configure, and NORTHMK_CUDA=off never asks for CUDA.

The CUTLASS headers are found through the Python interpreter CMake uses (the nvidia-cutlass
package); pointing Python_EXECUTABLE at /bin/false takes them away."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
needs_nvcc = pytest.mark.skipif(nvcc() is None, reason="needs nvcc (the CUDA toolkit) to reach the CUTLASS check")


def configure(build: Path, mode: str) -> subprocess.CompletedProcess:
    args = ["cmake", "-S", str(ROOT), "-B", str(build), f"-DNORTHMK_CUDA={mode}", "-DPython_EXECUTABLE=/bin/false"]
    if mode != "off" and nvcc():
        args.append(f"-DCMAKE_CUDA_COMPILER={nvcc()}")
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


@needs_cmake
@needs_nvcc
def test_auto_without_cutlass_builds_the_host_library_and_says_why(tmp_path):
    run = configure(tmp_path / "build", "auto")
    assert run.returncode == 0, run.stderr
    assert "nvcc found but not the CUTLASS headers" in run.stderr
    assert "pip install nvidia-cutlass" in run.stderr
    assert "CUDA=OFF CUTLASS=OFF" in run.stdout


@needs_cmake
@needs_nvcc
def test_on_without_cutlass_refuses_to_configure(tmp_path):
    run = configure(tmp_path / "build", "on")
    assert run.returncode != 0
    assert "NORTHMK_CUDA=on needs the CUTLASS headers" in run.stderr


@needs_cmake
def test_off_builds_the_host_library_without_looking_for_cuda(tmp_path):
    run = configure(tmp_path / "build", "off")
    assert run.returncode == 0, run.stderr
    assert "CUDA=OFF CUTLASS=OFF" in run.stdout
    assert "CUTLASS headers" not in run.stderr
    assert "CMAKE_CUDA_COMPILER" not in (tmp_path / "build" / "CMakeCache.txt").read_text()
