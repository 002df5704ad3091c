"""Finding and checking libnorthmk: a missing or ABI-mismatched library fails with how to build it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import northmk.native as native

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import northmk.native as n\ntry:\n    n.load()\nexcept n.LibraryNotFound as e:\n    print(e)\n"


def load_with(lib: str) -> str:
    env = {**os.environ, "NORTHMK_LIB": lib, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_loaded_library_matches_the_bindings_abi():
    lib = native.load()
    assert lib.nmk_abi_version() == native.ABI_VERSION
    assert lib.nmk_version().decode() == __import__("northmk").__version__
    assert native.library_path().name == "libnorthmk.so"


def test_missing_library_says_how_to_build():
    out = load_with("/nonexistent/libnorthmk.so")
    assert "not found" in out and "cmake -S . -B build/release" in out and "pip install ." in out


def test_abi_mismatch_is_refused(tmp_path):
    src = tmp_path / "fake.c"
    src.write_text("unsigned nmk_abi_version(void) { return 999; }\n")
    lib = tmp_path / "libnorthmk.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    out = load_with(str(lib))
    assert "ABI version 999" in out and f"expects {native.ABI_VERSION}" in out


def test_native_error_carries_status_and_message():
    err = native.NativeError(native.Status.ERR_BAD_STATE, "the loop is running")
    assert err.status is native.Status.ERR_BAD_STATE and str(err) == "ERR_BAD_STATE: the loop is running"
    assert issubclass(native.NoSpace, native.NativeError)
    lib = native.load()
    assert [lib.nmk_status_string(s).decode() for s in native.Status] == [f"NMK_{s.name}" for s in native.Status]
