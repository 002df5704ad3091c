"""ctypes binding of GPU sampling (the nmk_sample section of include/northmk.h); the C
prototype beside its argtypes. Device memory is passed as raw addresses (ints); the
engine's face is northmk.engine.gpu_sampling.GpuSampler."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_float, c_int32, c_uint32, c_uint64, c_void_p

from ._lib import check, load

MAX_ROWS = 64  # NMK_SAMPLE_MAX_ROWS
MAX_VOCAB = 1 << 24  # NMK_SAMPLE_MAX_VOCAB


class SampleRow(ctypes.Structure):
    """nmk_sample_row."""

    _fields_ = [("temperature", c_float), ("top_k", c_int32), ("top_p", c_float), ("min_p", c_float),
                ("seed", c_uint64), ("counter", c_uint64)]


assert ctypes.sizeof(SampleRow) == 32

_PROTOTYPES = {
    # nmk_status nmk_sample(const float *logits, uint32_t rows, uint32_t vocab, const nmk_sample_row *params,
    #                       int32_t *tokens, float *logprobs, void *stream)
    "nmk_sample": (c_int32, [c_void_p, c_uint32, c_uint32, POINTER(SampleRow), c_void_p, c_void_p, c_void_p]),
}


def _lib() -> ctypes.CDLL:
    lib = load()
    if not getattr(lib, "_sample_bound", False):
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        lib._sample_bound = True
    return lib


def rows_array(rows: list[SampleRow]) -> ctypes.Array:
    """The params array nmk_sample reads."""
    return (SampleRow * len(rows))(*rows)


def sample(logits: int | None, num_rows: int, vocab: int, params: ctypes.Array | None, tokens: int | None,
           logprobs: int | None = None, stream: int | None = None) -> None:
    """nmk_sample on device addresses; raises NativeError (INVALID_ARGUMENT, UNSUPPORTED without
    CUDA, CUDA on a failed launch). Returns once the kernel is enqueued."""
    check(_lib().nmk_sample(logits, num_rows, vocab, params, tokens, logprobs, stream))
