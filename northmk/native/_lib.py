"""Loading libnorthmk and its raw ctypes prototypes (each C prototype beside its binding).

Search order: $NORTHMK_LIB, the installed package (northmk/libnorthmk.so), then
build/*/libnorthmk.so of a source checkout (newest first, sanitizer builds skipped).
"""

from __future__ import annotations

import abc
import ctypes
import enum
import os
from ctypes import POINTER, c_char_p, c_float, c_int, c_int32, c_size_t, c_uint32, c_uint64, c_void_p
from pathlib import Path

ABI_VERSION = 10  # NMK_ABI_VERSION of include/northmk.h this module is written against
KV_MAX_GROUPS = 4  # NMK_KV_MAX_GROUPS
NO_PAGE = -1  # NMK_KV_NO_PAGE
LIB_NAME = "libnorthmk.so"
PACKAGE_DIR = Path(__file__).resolve().parent.parent
SOURCE_ROOT = PACKAGE_DIR.parent
BUILD_HINT = (
    "build it with `pip install .` in the source checkout, or "
    "`cmake -S . -B build/release -DNORTHMK_CUDA=auto && cmake --build build/release`, "
    "or point NORTHMK_LIB at a libnorthmk.so"
)


class Status(enum.IntEnum):
    """nmk_status. Recoverable: NO_SPACE, NOT_FOUND, INVALID_ARGUMENT, BAD_STATE, UNSUPPORTED."""

    OK = 0
    ERR_INVALID_ARGUMENT = 1
    ERR_NO_SPACE = 2
    ERR_NOT_FOUND = 3
    ERR_BAD_STATE = 4
    ERR_UNSUPPORTED = 5
    ERR_CUDA = 6
    ERR_STEP_FAILED = 7
    ERR_OUT_OF_MEMORY = 8
    ERR_INTERNAL = 9


class LoopState(enum.IntEnum):
    """nmk_loop_state."""

    PARKED = 0
    RUNNING = 1


class TokenFlag(enum.IntFlag):
    """NMK_TOKEN_* flags of a ring entry."""

    FINISHED = 1
    STOP = 2
    LENGTH = 4


class LibraryNotFound(ImportError):
    """No usable libnorthmk.so (missing, or built for another ABI version)."""


class NativeError(RuntimeError):
    """A libnorthmk call failed: `status` is the Status, the message the library's last error."""

    def __init__(self, status: int, message: str):
        self.status = Status(status) if status in Status._value2member_map_ else status
        name = self.status.name if isinstance(self.status, Status) else str(status)
        super().__init__(f"{name}: {message}")
        self.message = message


class NoSpace(NativeError):
    """NMK_ERR_NO_SPACE: not enough free KV pages; free or preempt a sequence and retry."""


class NativeHandle(abc.ABC):
    """Owns one native object: `close()` (or leaving a `with` block, or garbage collection)
    destroys it once through `_release`; `handle` refuses use after that."""

    _handle: c_void_p | None = None

    @abc.abstractmethod
    def _release(self) -> None:
        """Destroys the native object; called once, by close()."""

    def close(self) -> None:
        if self._handle:
            self._release()
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return not self._handle

    @property
    def handle(self) -> c_void_p:
        if not self._handle:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._handle


# ---- structs (field order and types exactly as in northmk.h) --------------------------------
class KVPoolParams(ctypes.Structure):
    _fields_ = [
        ("num_groups", c_uint32),
        ("num_pages", c_uint32 * KV_MAX_GROUPS),
        ("window", c_uint32 * KV_MAX_GROUPS),
        ("page_size", c_uint32),
        ("max_seq_len", c_uint32),
        ("max_rows", c_uint32),
        ("model_key", c_uint64),
        ("enable_prefix_cache", c_int),
    ]


class PageCopy(ctypes.Structure):
    _fields_ = [("group", c_uint32), ("src", c_int32), ("dst", c_int32)]


class KVUsage(ctypes.Structure):
    _fields_ = [("total", c_uint32), ("used", c_uint32), ("cached", c_uint32), ("free", c_uint32)]


class PrefixStats(ctypes.Structure):
    _fields_ = [
        ("lookups", c_uint64),
        ("query_tokens", c_uint64),
        ("hit_tokens", c_uint64),
        ("evictions", c_uint64),
    ]


class StepBatch(ctypes.Structure):
    _fields_ = [
        ("step", c_uint64),
        ("num_rows", c_uint32),
        ("slots", POINTER(c_uint32)),
        ("seqs", POINTER(c_uint64)),
        ("tokens", POINTER(c_int32)),
        ("positions", POINTER(c_uint32)),
        ("num_groups", c_uint32),
        ("max_pages_per_seq", c_uint32),
        ("block_tables", POINTER(c_int32) * KV_MAX_GROUPS),
    ]


class StepResult(ctypes.Structure):
    _fields_ = [("tokens", POINTER(c_int32)), ("logprobs", POINTER(c_float))]


# int (*nmk_step_fn)(void *user, const nmk_step_batch *batch, nmk_step_result *result)
STEP_FN = ctypes.CFUNCTYPE(c_int, c_void_p, POINTER(StepBatch), POINTER(StepResult))


class LoopParams(ctypes.Structure):
    _fields_ = [
        ("max_rows", c_uint32),
        ("ring_capacity", c_uint32),
        ("step", STEP_FN),
        ("step_user", c_void_p),
    ]


class TokenEvent(ctypes.Structure):
    _fields_ = [
        ("seq", c_uint64),
        ("slot", c_uint32),
        ("token", c_int32),
        ("logprob", c_float),
        ("flags", c_uint32),
    ]


class RowParams(ctypes.Structure):
    _fields_ = [
        ("slot", c_uint32),
        ("seq", c_uint64),
        ("last_token", c_int32),
        ("max_new_tokens", c_uint32),
        ("min_new_tokens", c_uint32),
        ("stop_token_ids", POINTER(c_int32)),
        ("num_stop_token_ids", c_uint32),
    ]


class RowInfo(ctypes.Structure):
    _fields_ = [
        ("seq", c_uint64),
        ("last_token", c_int32),
        ("position", c_uint32),
        ("generated", c_uint32),
        ("remaining", c_uint32),
        ("flags", c_uint32),
    ]


P = POINTER
_PROTOTYPES = {
    # const char *nmk_status_string(int status)
    "nmk_status_string": (c_char_p, [c_int]),
    # size_t nmk_last_error(char *buf, size_t size)
    "nmk_last_error": (c_size_t, [c_char_p, c_size_t]),
    # const char *nmk_version(void)
    "nmk_version": (c_char_p, []),
    # uint32_t nmk_abi_version(void)
    "nmk_abi_version": (c_uint32, []),
    # int nmk_has_cuda(void)
    "nmk_has_cuda": (c_int, []),
    # nmk_kv_pool_params nmk_kv_pool_default_params(void)
    "nmk_kv_pool_default_params": (KVPoolParams, []),
    # nmk_status nmk_kv_pool_create(const nmk_kv_pool_params *params, nmk_kv_pool **out)
    "nmk_kv_pool_create": (c_int, [P(KVPoolParams), P(c_void_p)]),
    # void nmk_kv_pool_destroy(nmk_kv_pool *pool)
    "nmk_kv_pool_destroy": (None, [c_void_p]),
    # nmk_status nmk_kv_seq_create(nmk_kv_pool *pool, const int32_t *tokens, size_t n, nmk_seq_id *out, size_t *n_cached)
    "nmk_kv_seq_create": (c_int, [c_void_p, P(c_int32), c_size_t, P(c_uint64), P(c_size_t)]),
    # nmk_status nmk_kv_prefix_lookup(nmk_kv_pool *pool, const int32_t *tokens, size_t n, size_t *n_cached)
    "nmk_kv_prefix_lookup": (c_int, [c_void_p, P(c_int32), c_size_t, P(c_size_t)]),
    # nmk_status nmk_kv_seq_free(nmk_kv_pool *pool, nmk_seq_id seq)
    "nmk_kv_seq_free": (c_int, [c_void_p, c_uint64]),
    # nmk_status nmk_kv_seq_append(nmk_kv_pool *pool, nmk_seq_id seq, const int32_t *tokens, size_t n)
    "nmk_kv_seq_append": (c_int, [c_void_p, c_uint64, P(c_int32), c_size_t]),
    # nmk_status nmk_kv_seq_reserve(nmk_kv_pool *pool, nmk_seq_id seq, size_t n)
    "nmk_kv_seq_reserve": (c_int, [c_void_p, c_uint64, c_size_t]),
    # nmk_status nmk_kv_seq_fork(nmk_kv_pool *pool, nmk_seq_id src, nmk_seq_id *child,
    #                            nmk_kv_page_copy *copies, size_t cap, size_t *n_copies)
    "nmk_kv_seq_fork": (c_int, [c_void_p, c_uint64, P(c_uint64), P(PageCopy), c_size_t, P(c_size_t)]),
    # nmk_status nmk_kv_seq_length(nmk_kv_pool *pool, nmk_seq_id seq, size_t *out)
    "nmk_kv_seq_length": (c_int, [c_void_p, c_uint64, P(c_size_t)]),
    # nmk_status nmk_kv_seq_block_table(nmk_kv_pool *pool, nmk_seq_id seq, uint32_t group,
    #                                   int32_t *out, size_t cap, size_t *n_pages)
    "nmk_kv_seq_block_table": (c_int, [c_void_p, c_uint64, c_uint32, P(c_int32), c_size_t, P(c_size_t)]),
    # nmk_status nmk_kv_pool_bind_row(nmk_kv_pool *pool, uint32_t row, nmk_seq_id seq)
    "nmk_kv_pool_bind_row": (c_int, [c_void_p, c_uint32, c_uint64]),
    # nmk_status nmk_kv_pool_unbind_row(nmk_kv_pool *pool, uint32_t row)
    "nmk_kv_pool_unbind_row": (c_int, [c_void_p, c_uint32]),
    # nmk_status nmk_kv_pool_block_table(nmk_kv_pool *pool, uint32_t group, const int32_t **data,
    #                                    uint32_t *rows, uint32_t *cols)
    "nmk_kv_pool_block_table": (c_int, [c_void_p, c_uint32, P(P(c_int32)), P(c_uint32), P(c_uint32)]),
    # nmk_status nmk_kv_pool_usage(nmk_kv_pool *pool, uint32_t group, nmk_kv_usage *out)
    "nmk_kv_pool_usage": (c_int, [c_void_p, c_uint32, P(KVUsage)]),
    # nmk_status nmk_kv_pool_prefix_stats(nmk_kv_pool *pool, nmk_kv_prefix_stats *out)
    "nmk_kv_pool_prefix_stats": (c_int, [c_void_p, P(PrefixStats)]),
    # nmk_loop_params nmk_loop_default_params(void)
    "nmk_loop_default_params": (LoopParams, []),
    # nmk_status nmk_loop_create(nmk_kv_pool *pool, const nmk_loop_params *params, nmk_loop **out)
    "nmk_loop_create": (c_int, [c_void_p, P(LoopParams), P(c_void_p)]),
    # void nmk_loop_destroy(nmk_loop *loop)
    "nmk_loop_destroy": (None, [c_void_p]),
    # int nmk_loop_fd(const nmk_loop *loop)
    "nmk_loop_fd": (c_int, [c_void_p]),
    # nmk_status nmk_loop_get_state(nmk_loop *loop, nmk_loop_state *state, nmk_status *park_status)
    "nmk_loop_get_state": (c_int, [c_void_p, P(c_int), P(c_int)]),
    # size_t nmk_loop_park_message(nmk_loop *loop, char *buf, size_t size)
    "nmk_loop_park_message": (c_size_t, [c_void_p, c_char_p, c_size_t]),
    # nmk_status nmk_loop_request_park(nmk_loop *loop)
    "nmk_loop_request_park": (c_int, [c_void_p]),
    # nmk_status nmk_loop_park(nmk_loop *loop)
    "nmk_loop_park": (c_int, [c_void_p]),
    # nmk_status nmk_loop_resume(nmk_loop *loop)
    "nmk_loop_resume": (c_int, [c_void_p]),
    # nmk_status nmk_loop_drain(nmk_loop *loop, nmk_token_event *out, size_t cap, size_t *n)
    "nmk_loop_drain": (c_int, [c_void_p, P(TokenEvent), c_size_t, P(c_size_t)]),
    # nmk_status nmk_loop_add_row(nmk_loop *loop, const nmk_loop_row_params *row)
    "nmk_loop_add_row": (c_int, [c_void_p, P(RowParams)]),
    # nmk_status nmk_loop_remove_row(nmk_loop *loop, uint32_t slot)
    "nmk_loop_remove_row": (c_int, [c_void_p, c_uint32]),
    # nmk_status nmk_loop_row(nmk_loop *loop, uint32_t slot, nmk_loop_row_info *out)
    "nmk_loop_row": (c_int, [c_void_p, c_uint32, P(RowInfo)]),
    # nmk_status nmk_loop_num_rows(nmk_loop *loop, uint32_t *out)
    "nmk_loop_num_rows": (c_int, [c_void_p, P(c_uint32)]),
}


def candidate_paths() -> list[Path]:
    env = os.environ.get("NORTHMK_LIB")
    if env:
        return [Path(env)]
    found = [PACKAGE_DIR / LIB_NAME]
    builds = [p for p in (SOURCE_ROOT / "build").glob(f"*/{LIB_NAME}") if "sanitize" not in p.parent.name]
    found += sorted(builds, key=lambda p: p.stat().st_mtime, reverse=True)
    return found


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if not hasattr(lib, "nmk_abi_version"):
        raise LibraryNotFound(f"{path} is not libnorthmk (no nmk_abi_version); {BUILD_HINT}")
    lib.nmk_abi_version.restype = c_uint32
    found = lib.nmk_abi_version()
    if found != ABI_VERSION:
        raise LibraryNotFound(
            f"{path} has ABI version {found}, northmk.native expects {ABI_VERSION}; rebuild it: {BUILD_HINT}"
        )
    return _bind(lib)


_lib: ctypes.CDLL | None = None
_path: Path | None = None


def load() -> ctypes.CDLL:
    """The bound library, loaded once. Raises LibraryNotFound saying how to build it."""
    global _lib, _path
    if _lib is not None:
        return _lib
    errors = []
    for path in candidate_paths():
        if not path.is_file():
            errors.append(f"{path}: not found")
            continue
        try:
            _lib, _path = _open(path), path
            return _lib
        except (OSError, LibraryNotFound) as exc:
            errors.append(str(exc))
    raise LibraryNotFound("libnorthmk.so not usable; " + BUILD_HINT + "\n  " + "\n  ".join(errors))


def library_path() -> Path:
    load()
    assert _path is not None
    return _path


def last_error() -> str:
    lib = load()
    size = lib.nmk_last_error(None, 0)
    buf = ctypes.create_string_buffer(size + 1)
    lib.nmk_last_error(buf, size + 1)
    return buf.value.decode("utf-8", "replace")


def check(status: int) -> None:
    """Raises NativeError (NoSpace for NMK_ERR_NO_SPACE) when status is not NMK_OK."""
    if status == Status.OK:
        return
    cls = NoSpace if status == Status.ERR_NO_SPACE else NativeError
    raise cls(status, last_error())
