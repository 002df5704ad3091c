"""The C ABI as a C program sees it: strict C99 against include/northmk.h only, nmk_* exports only."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
C_DIR = Path(__file__).parent / "c"
CFLAGS = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-pthread", f"-I{ROOT / 'include'}"]


def compile_c(source: Path, library: Path, out_dir: Path) -> Path:
    exe = out_dir / source.stem
    cmd = [shutil.which("cc") or "cc", *CFLAGS, str(source), f"-L{library.parent}", "-lnorthmk",
           f"-Wl,-rpath,{library.parent}", "-o", str(exe)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, f"compile failed:\n{done.stderr}"
    return exe


def run(exe: Path, *args: str) -> str:
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{exe.name} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize("program", ["test_abi", "test_pool", "test_loop"])
def test_c_program_passes(program, native_library, tmp_path):
    exe = compile_c(C_DIR / f"{program}.c", native_library, tmp_path)
    assert f"{program}: ok" in run(exe)


def test_park_resume_stress_in_c(native_library, tmp_path):
    exe = compile_c(C_DIR / "stress.c", native_library, tmp_path)
    assert "stress: ok" in run(exe, "800", "3")


def test_header_is_strict_c99_and_cxx(tmp_path):
    src = tmp_path / "h.c"
    src.write_text('#include "northmk.h"\nint main(void) { return NMK_OK; }\n')
    for compiler, std in (("cc", "-std=c99"), ("c++", "-std=c++17")):
        cmd = [compiler, std, "-Wall", "-Wextra", "-Werror", "-pedantic", "-x", "c" if compiler == "cc" else "c++",
               f"-I{ROOT / 'include'}", "-c", str(src), "-o", str(tmp_path / "h.o")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


def test_library_exports_only_nmk_symbols(native_library):
    done = subprocess.run(["nm", "-D", "--defined-only", str(native_library)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    names = [line.split()[-1] for line in done.stdout.splitlines() if line.strip()]
    assert "nmk_abi_version" in names and "nmk_loop_create" in names
    assert [n for n in names if not n.startswith("nmk_")] == []


def test_every_declared_function_is_exported(native_library):
    header = (ROOT / "include" / "northmk.h").read_text()
    declared = set(re.findall(r"NMK_API[^;(]*?\b(nmk_\w+)\s*\(", header))
    done = subprocess.run(["nm", "-D", "--defined-only", str(native_library)], capture_output=True, text=True)
    exported = {line.split()[-1] for line in done.stdout.splitlines() if line.strip()}
    assert declared and declared <= exported, sorted(declared - exported)
