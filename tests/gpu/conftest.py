"""GPU tests: need CUDA, an sm_90 device and a libnorthmk built with CUDA (NORTHMK_LIB)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device"
    elif torch.cuda.get_device_capability() != (9, 0):
        reason = "the megakernel needs an sm_90 (Hopper) GPU"
    else:
        from northmk.native._lib import load

        try:
            if not load().nmk_has_cuda():
                reason = "libnorthmk was built without CUDA"
        except ImportError as exc:
            reason = f"libnorthmk not available: {exc}"
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
