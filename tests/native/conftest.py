"""Builds libnorthmk from this checkout (unless NORTHMK_LIB names one) before native tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from northmk.native._build import ensure_library


@pytest.fixture(scope="session", autouse=True)
def native_library() -> Path:
    return ensure_library()
