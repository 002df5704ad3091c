"""KVPool through ctypes: block tables, sliding windows, forks, the prefix cache, errors."""

from __future__ import annotations

import numpy as np
import pytest

from northmk.config import ModelConfig
from northmk.native import NO_PAGE, Copy, KVPool, NativeError, NoSpace, Status, Usage

PS = 4


def pool(pages=(16,), windows=None, **kw) -> KVPool:
    kw.setdefault("page_size", PS)
    kw.setdefault("max_seq_len", 64)
    kw.setdefault("max_rows", 4)
    return KVPool(list(pages), windows, **kw)


def test_append_allocates_one_page_per_page_size_tokens():
    with pool() as p:
        seq, cached = p.create_sequence()
        assert cached == 0 and p.length(seq) == 0
        p.append(seq, range(9))
        table = p.seq_block_table(seq, 0)
        assert len(table) == 3 and len(set(table)) == 3 and NO_PAGE not in table
        assert p.usage(0) == Usage(total=16, used=3, cached=0, free=13)
        p.free(seq)
        assert p.usage(0).used == 0


def test_no_space_is_recoverable_and_changes_nothing():
    with pool(pages=(2,)) as p:
        seq, _ = p.create_sequence()
        p.append(seq, range(5))
        with pytest.raises(NoSpace) as err:
            p.append(seq, range(4))
        assert err.value.status is Status.ERR_NO_SPACE and "needs 1 pages" in str(err.value)
        assert p.length(seq) == 5 and p.usage(0).used == 2
        p.append(seq, range(3))  # still fits in the second page
        assert p.length(seq) == 8


def test_bad_input_is_rejected_with_a_message():
    with pool() as p:
        seq, _ = p.create_sequence()
        with pytest.raises(NativeError, match="max_seq_len"):
            p.append(seq, range(65))
        with pytest.raises(ValueError, match="token ids"):
            p.append(seq, [-1])
        with pytest.raises(NativeError) as err:
            p.free(12345)
        assert err.value.status is Status.ERR_NOT_FOUND
        with pytest.raises(NativeError, match="group 3 out of range"):
            p.usage(3)
    with pytest.raises(ValueError, match="groups"):
        KVPool([1, 1, 1, 1, 1])
    with pytest.raises(NativeError, match="page_size must be >= 1"):
        KVPool([1], page_size=0)
    with pytest.raises(ValueError):
        KVPool([-4])
    with pytest.raises(ValueError, match="closed"):
        p.create_sequence()


def test_sliding_group_releases_pages_behind_the_window():
    # Window 8 keys: the next position 16 sees [9, 16]; pages 0 and 1 (positions 0..7) are dead.
    with pool(pages=(8, 8), windows=(None, 8)) as p:
        seq, _ = p.create_sequence()
        p.append(seq, range(16))
        p.append(seq, [0])
        assert p.seq_block_table(seq, 1)[:3] == [NO_PAGE, NO_PAGE, p.seq_block_table(seq, 1)[2]]
        assert NO_PAGE not in p.seq_block_table(seq, 0)
        assert p.usage(1) == Usage(total=8, used=3, cached=2, free=3)


def test_dense_block_table_follows_bound_sequences():
    with pool(pages=(16, 16), windows=(None, 8)) as p:
        table = p.block_table(1)
        assert table.shape == (4, 16) and table.dtype == np.int32 and (table == NO_PAGE).all()
        seq, _ = p.create_sequence()
        p.append(seq, range(5))
        p.bind_row(2, seq)
        assert list(table[2, :2]) == p.seq_block_table(seq, 1)
        p.append(seq, range(12))
        p.append(seq, [0])  # position 17 sees [10, 17]: sliding pages 0 and 1 go
        assert list(table[2, :5]) == p.seq_block_table(seq, 1) and list(table[2, :2]) == [NO_PAGE] * 2
        with pytest.raises(NativeError, match="remove the row first"):
            p.free(seq)
        p.unbind_row(2)
        assert (table == NO_PAGE).all()


def test_fork_shares_full_pages_and_copies_the_partial_last_page():
    with pool(pages=(8, 8), windows=(None, 64)) as p:
        seq, _ = p.create_sequence()
        p.append(seq, range(6))
        child, copies = p.fork(seq)
        parent_pages, child_pages = p.seq_block_table(seq, 0), p.seq_block_table(child, 0)
        assert child_pages[0] == parent_pages[0] and child_pages[1] != parent_pages[1]
        assert copies == [Copy(0, parent_pages[1], child_pages[1]), Copy(1, *copies[1][1:])]
        assert p.length(child) == 6
        p.append(child, [7, 8])  # the child's own page; the parent's is untouched
        assert p.seq_block_table(seq, 0) == parent_pages
        full_child, none = p.fork(p.create_sequence()[0])
        assert none == []


def test_reserve_takes_the_next_page_ahead_and_the_append_takes_no_other():
    with pool(pages=(8, 8), windows=(None, 64)) as p:
        seq, _ = p.create_sequence()
        p.append(seq, range(PS))  # page 0 full: position PS starts page 1
        p.bind_row(0, seq)
        p.reserve(seq)
        table = p.seq_block_table(seq, 0)
        assert len(table) == 2 and p.length(seq) == PS and p.usage(0).used == p.usage(1).used == 2
        assert list(p.block_table(0)[0, :2]) == table  # the dense row shows it
        p.reserve(seq)  # position PS has its page: nothing more
        p.append(seq, [7])
        assert p.seq_block_table(seq, 0) == table and p.usage(0).used == 2
        p.reserve(seq, PS + 3)  # positions PS + 1 .. 2 PS + 3: page 2
        assert len(p.seq_block_table(seq, 0)) == 3 and p.length(seq) == PS + 1
        child, copies = p.fork(seq)  # the child takes the tokens' pages, not the reserved one
        assert len(p.seq_block_table(child, 0)) == 2 and [c.src for c in copies] == [table[1], copies[1].src]
        p.unbind_row(0)
        p.free(seq)
        p.free(child)
        assert p.usage(0).used == p.usage(1).used == 0


def test_reserve_without_room_takes_nothing():
    with pool(pages=(2,)) as p:
        seq, _ = p.create_sequence()
        p.append(seq, range(2 * PS))
        with pytest.raises(NoSpace, match="needs 1 pages"):
            p.reserve(seq)
        assert len(p.seq_block_table(seq, 0)) == 2 and p.usage(0).used == 2
        with pytest.raises(NativeError, match="max_seq_len"):
            p.reserve(seq, 64)
        with pytest.raises(NativeError) as err:
            p.reserve(12345)
        assert err.value.status is Status.ERR_NOT_FOUND


def test_prefix_cache_serves_full_pages_and_leaves_a_token_to_compute():
    with pool() as p:
        prompt = list(range(100, 113))  # 13 tokens: 3 full pages
        a, cached = p.create_sequence(prompt)
        assert cached == 0
        p.append(a, prompt)
        assert p.prefix_lookup(prompt) == 12
        assert p.prefix_lookup(prompt[:12]) == 8  # at most n - 1 tokens, rounded to pages
        assert p.prefix_lookup([100, 101, 102, 103, 9, 9, 9, 9, 9]) == 4
        assert p.prefix_lookup([1] + prompt) == 0
        b, cached = p.create_sequence(prompt + [5])
        assert cached == 12 and p.length(b) == 12
        assert p.seq_block_table(b, 0) == p.seq_block_table(a, 0)[:3]
        stats = p.prefix_stats()
        assert (stats.lookups, stats.query_tokens, stats.hit_tokens) == (2, 27, 12)


def test_prefix_cache_keeps_pages_after_free_until_evicted_lru():
    with pool(pages=(4,)) as p:
        a, _ = p.create_sequence()
        p.append(a, range(8))
        b, _ = p.create_sequence()
        p.append(b, range(50, 58))
        p.free(a)
        p.free(b)  # b was released last: a's pages are older and go first
        assert p.usage(0) == Usage(4, 0, 4, 0)
        c, _ = p.create_sequence()
        p.append(c, range(90, 94))  # one eviction: a's last page
        assert p.prefix_lookup(list(range(9))) == 4
        assert p.prefix_lookup(list(range(50, 59))) == 8
        p.append(c, range(4))  # a's first page goes next
        assert p.prefix_lookup(list(range(9))) == 0
        assert p.prefix_stats().evictions == 2


def test_sliding_group_needs_only_the_pages_inside_the_window():
    # Window 8: a 16-token prefix needs full pages 0..3 but sliding pages only 2..3.
    with pool(pages=(16, 4), windows=(None, 8)) as p:
        prompt = list(range(17))
        a, _ = p.create_sequence()
        p.append(a, prompt[:16])
        p.append(a, [16])  # releases sliding pages 0, 1 (cached); position 16 evicts page 0
        p.free(a)
        hog, _ = p.create_sequence()
        p.append(hog, [1] * 8)  # takes the free page and evicts sliding page 1
        b, cached = p.create_sequence(prompt + [0])
        assert cached == 16
        sliding = p.seq_block_table(b, 1)
        assert sliding[:2] == [NO_PAGE, NO_PAGE] and NO_PAGE not in sliding[2:] and len(sliding) == 4
        assert NO_PAGE not in p.seq_block_table(b, 0)
        assert p.prefix_lookup(prompt[:9]) == 0  # sliding page 1 is gone: no shorter prefix either


def test_disabled_prefix_cache_never_hits():
    with pool(prefix_cache=False) as p:
        a, _ = p.create_sequence()
        p.append(a, range(12))
        assert p.prefix_lookup(list(range(13))) == 0
        p.free(a)
        assert p.usage(0).cached == 0


def test_prefix_cache_is_namespaced_by_model_key():
    assert KVPool([1], model_key="a").params.model_key != KVPool([1], model_key="b").params.model_key
    assert KVPool([1], model_key=7).params.model_key == 7


def test_for_model_derives_groups_and_windows():
    cfg = ModelConfig.from_dict({
        "model_type": "cohere2_moe", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_experts": 4,
        "num_experts_per_tok": 2, "intermediate_size": 8, "sliding_window": 128, "rms_norm_eps": 1e-6,
    })
    with KVPool.for_model(cfg, [8, 8], max_seq_len=256) as p:
        assert p.num_groups == 2 and list(p.params.window[:2]) == [0, 128] and p.page_size == 64
