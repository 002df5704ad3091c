"""KVPool: the native paged KV block pool (page groups, block tables, prefix cache)."""

from __future__ import annotations

import ctypes
import hashlib
import weakref
from ctypes import POINTER, byref, c_int32, c_size_t, c_uint32, c_uint64, c_void_p
from typing import NamedTuple, Sequence

import numpy as np

from ..config import PAGE_SIZE, SLIDING, ModelConfig
from ._lib import KV_MAX_GROUPS, KVPoolParams, KVUsage, NativeHandle, PageCopy, PrefixStats, check, load


class Usage(NamedTuple):
    total: int
    used: int  # referenced by a sequence
    cached: int  # unreferenced, holds a prefix-cache entry (evictable)
    free: int


class PrefixCacheStats(NamedTuple):
    lookups: int
    query_tokens: int
    hit_tokens: int
    evictions: int


class Copy(NamedTuple):
    """Copy page `src` to page `dst` of group `group` (a fork's partially filled last page)."""

    group: int
    src: int
    dst: int


def model_key_of(key: int | str) -> int:
    """A uint64 prefix-cache namespace from an int or a string (e.g. the checkpoint path + dtype)."""
    if isinstance(key, str):
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    if not 0 <= key < 2**64:
        raise ValueError(f"model_key must fit in 64 unsigned bits, got {key}")
    return key


def _tokens(tokens: Sequence[int]) -> tuple[np.ndarray, ctypes._Pointer]:
    arr = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64))
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must be in [0, 2**31)")
    arr = arr.astype(np.int32)
    return arr, arr.ctypes.data_as(POINTER(c_int32))


class KVPool(NativeHandle):
    """One page pool per attention group; sequences are named by integer ids (never 0).

    `windows[g]` is the sliding window of group g in keys (current token included), 0 or
    None for full attention. Thread-safe (the native pool serializes calls).
    """

    def __init__(
        self,
        num_pages: Sequence[int],
        windows: Sequence[int | None] | None = None,
        *,
        page_size: int = PAGE_SIZE,
        max_seq_len: int = 8192,
        max_rows: int = 8,
        model_key: int | str = 0,
        prefix_cache: bool = True,
    ):
        self._lib = load()
        windows = list(windows) if windows is not None else [None] * len(num_pages)
        if not 1 <= len(num_pages) <= KV_MAX_GROUPS or len(windows) != len(num_pages):
            raise ValueError(f"need 1..{KV_MAX_GROUPS} groups with one window each, got {num_pages}, {windows}")
        values = [*num_pages, *(w or 0 for w in windows), page_size, max_seq_len, max_rows]
        if any(not isinstance(v, int) or not 0 <= v < 2**31 for v in values):
            raise ValueError(f"page counts, windows and sizes must be non-negative ints, got {values}")
        p = self._lib.nmk_kv_pool_default_params()
        p.num_groups = len(num_pages)
        for g, (n, w) in enumerate(zip(num_pages, windows)):
            p.num_pages[g], p.window[g] = n, w or 0
        p.page_size, p.max_seq_len, p.max_rows = page_size, max_seq_len, max_rows
        p.model_key, p.enable_prefix_cache = model_key_of(model_key), int(prefix_cache)
        self.params = p
        self.loops: weakref.WeakSet = weakref.WeakSet()  # DecodeLoops on this pool
        self._handle = c_void_p()
        check(self._lib.nmk_kv_pool_create(byref(p), byref(self._handle)))
        self._tables = [self._dense_view(g) for g in range(p.num_groups)]

    @classmethod
    def for_model(cls, config: ModelConfig, num_pages: Sequence[int], **kwargs) -> "KVPool":
        """Groups and windows from `config.attention_groups` (full first, then sliding)."""
        windows = [config.sliding_window if g == SLIDING else None for g in config.attention_groups]
        return cls(num_pages, windows, **kwargs)

    # ---- lifetime --------------------------------------------------------------------------
    def _release(self) -> None:
        """Destroys the pool, closing its decode loops first; sequence ids become invalid."""
        for loop in list(self.loops):
            loop.close()
        self._lib.nmk_kv_pool_destroy(self._handle)

    @property
    def num_groups(self) -> int:
        return self.params.num_groups

    @property
    def page_size(self) -> int:
        return self.params.page_size

    # ---- sequences -------------------------------------------------------------------------
    def create_sequence(self, prompt: Sequence[int] | None = None) -> tuple[int, int]:
        """(seq id, cached tokens): the longest cached prefix of prompt (< len(prompt)) is attached.

        The remaining prompt tokens are not appended: call append(seq, prompt[cached:]).
        """
        seq, cached = c_uint64(), c_size_t(0)
        if prompt is None:
            check(self._lib.nmk_kv_seq_create(self.handle, None, 0, byref(seq), byref(cached)))
        else:
            arr, ptr = _tokens(prompt)
            check(self._lib.nmk_kv_seq_create(self.handle, ptr, arr.size, byref(seq), byref(cached)))
        return seq.value, cached.value

    def prefix_lookup(self, prompt: Sequence[int]) -> int:
        """Prompt tokens create_sequence(prompt) would take from the cache now."""
        arr, ptr = _tokens(prompt)
        out = c_size_t(0)
        check(self._lib.nmk_kv_prefix_lookup(self.handle, ptr, arr.size, byref(out)))
        return out.value

    def free(self, seq: int) -> None:
        check(self._lib.nmk_kv_seq_free(self.handle, seq))

    def append(self, seq: int, tokens: Sequence[int]) -> None:
        """Pages for positions [len, len + n) in every group; raises NoSpace, changing nothing."""
        arr, ptr = _tokens(tokens)
        check(self._lib.nmk_kv_seq_append(self.handle, seq, ptr, arr.size))

    def reserve(self, seq: int, n: int = 1) -> None:
        """Pages for positions [len, len + n) now, ahead of the append that records them (which
        then takes none); raises NoSpace, taking none."""
        check(self._lib.nmk_kv_seq_reserve(self.handle, seq, n))

    def fork(self, seq: int) -> tuple[int, list[Copy]]:
        """(child id, page copies the caller must perform before using either sequence)."""
        child, n = c_uint64(), c_size_t(0)
        copies = (PageCopy * KV_MAX_GROUPS)()
        check(self._lib.nmk_kv_seq_fork(self.handle, seq, byref(child), copies, KV_MAX_GROUPS, byref(n)))
        return child.value, [Copy(c.group, c.src, c.dst) for c in copies[: n.value]]

    def length(self, seq: int) -> int:
        out = c_size_t(0)
        check(self._lib.nmk_kv_seq_length(self.handle, seq, byref(out)))
        return out.value

    def seq_block_table(self, seq: int, group: int) -> list[int]:
        """Physical page of each logical page of `seq` in `group` (-1: released)."""
        n = c_size_t(0)
        check(self._lib.nmk_kv_seq_block_table(self.handle, seq, group, None, 0, byref(n)))
        out = (c_int32 * max(n.value, 1))()
        check(self._lib.nmk_kv_seq_block_table(self.handle, seq, group, out, n.value, byref(n)))
        return list(out[: n.value])

    # ---- dense tables ----------------------------------------------------------------------
    def bind_row(self, row: int, seq: int) -> None:
        check(self._lib.nmk_kv_pool_bind_row(self.handle, row, seq))

    def unbind_row(self, row: int) -> None:
        check(self._lib.nmk_kv_pool_unbind_row(self.handle, row))

    def _dense_view(self, group: int) -> np.ndarray:
        data, rows, cols = POINTER(c_int32)(), c_uint32(), c_uint32()
        check(self._lib.nmk_kv_pool_block_table(self.handle, group, byref(data), byref(rows), byref(cols)))
        return np.ctypeslib.as_array(data, shape=(rows.value, cols.value))

    def block_table(self, group: int) -> np.ndarray:
        """int32 [max_rows, pages per max_seq_len] view of the pool's memory (-1 absent); do not write.

        Valid while the pool is open; torch.from_numpy() gives a tensor on the same memory.
        """
        if not 0 <= group < self.num_groups:
            raise IndexError(f"group {group} out of range [0, {self.num_groups})")
        return self._tables[group]

    # ---- statistics ------------------------------------------------------------------------
    def usage(self, group: int) -> Usage:
        u = KVUsage()
        check(self._lib.nmk_kv_pool_usage(self.handle, group, byref(u)))
        return Usage(u.total, u.used, u.cached, u.free)

    def usage_fraction(self) -> float:
        """Fraction of pages referenced by sequences, the fullest group (kv_cache_usage_perc)."""
        return max(u.used / u.total for u in map(self.usage, range(self.num_groups)))

    def prefix_stats(self) -> PrefixCacheStats:
        s = PrefixStats()
        check(self._lib.nmk_kv_pool_prefix_stats(self.handle, byref(s)))
        return PrefixCacheStats(s.lookups, s.query_tokens, s.hit_tokens, s.evictions)
