"""Property tests of the block pool: no leak, no double use of a page, sound sharing, cache hits."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from northmk.native import NO_PAGE, KVPool, NativeError, NoSpace

PS, WINDOW, MAX_LEN, ROWS = 4, 8, 48, 3
tokens = st.lists(st.integers(0, 2), max_size=14)  # a small alphabet: prompts share prefixes


def dead_pages(next_pos: int) -> int:
    return max(0, (next_pos + 1 - WINDOW) // PS)


class PoolMachine(RuleBasedStateMachine):
    """Random creates (with prefix hits), appends, reserves, forks, frees and row bindings against a
    model."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.pool = KVPool([20, 12], [None, WINDOW], page_size=PS, max_seq_len=MAX_LEN, max_rows=ROWS)
        self.model: dict[int, list[int]] = {}
        self.pages: dict[int, int] = {}  # seq -> its logical pages: its tokens', and any reserved past them
        self.rows: dict[int, int] = {}  # row -> seq

    def _append(self, seq: int, new: list[int]) -> None:
        before = self.pool.length(seq)
        if len(self.model[seq]) + len(new) > MAX_LEN:
            return
        try:
            self.pool.append(seq, new)
        except NoSpace:
            assert self.pool.length(seq) == before
            return
        self.model[seq] += new
        self.pages[seq] = max(self.pages[seq], -(-len(self.model[seq]) // PS))

    @rule(target=seqs, prompt=tokens, rest=tokens)
    def create(self, prompt, rest):
        expected = self.pool.prefix_lookup(prompt) if prompt else 0
        seq, cached = self.pool.create_sequence(prompt or None)
        assert cached == expected and cached % PS == 0 and (cached < len(prompt) or cached == 0)
        self.model[seq], self.pages[seq] = prompt[:cached], cached // PS
        self._append(seq, prompt[cached:] + rest)
        return seq

    @rule(seq=seqs, new=tokens)
    def append(self, seq, new):
        if seq in self.model:
            self._append(seq, new)

    @rule(seq=seqs, n=st.integers(0, 6))
    def reserve(self, seq, n):
        if seq not in self.model:
            return
        try:
            self.pool.reserve(seq, n)
        except NoSpace:
            return
        except NativeError:
            assert len(self.model[seq]) + n > MAX_LEN
            return
        self.pages[seq] = max(self.pages[seq], -(-(len(self.model[seq]) + n) // PS))

    @rule(target=seqs, seq=seqs)
    def fork(self, seq):
        if seq not in self.model:
            return 0
        try:
            child, copies = self.pool.fork(seq)
        except NoSpace:
            return 0
        assert len(copies) == (2 if len(self.model[seq]) % PS else 0)
        self.model[child] = list(self.model[seq])
        self.pages[child] = -(-len(self.model[seq]) // PS)  # none of the reserved pages
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq not in self.model:
            return
        if seq in self.rows.values():
            try:
                self.pool.free(seq)
                raise AssertionError("freeing a bound sequence must fail")
            except NativeError:
                return
        self.pool.free(seq)
        del self.model[seq], self.pages[seq]

    @rule(row=st.integers(0, ROWS - 1), seq=seqs)
    def bind(self, row, seq):
        if seq in self.model and row not in self.rows and seq not in self.rows.values():
            self.pool.bind_row(row, seq)
            self.rows[row] = seq

    @rule(row=st.integers(0, ROWS - 1))
    def unbind(self, row):
        if row in self.rows:
            self.pool.unbind_row(row)
            del self.rows[row]

    @invariant()
    def pages_are_accounted_and_shared_soundly(self):
        for g in range(2):
            usage = self.pool.usage(g)
            assert usage.used + usage.cached + usage.free == usage.total
            owners: dict[int, list[tuple[int, int]]] = {}
            for seq, toks in self.model.items():
                table = self.pool.seq_block_table(seq, g)
                assert self.pool.length(seq) == len(toks)
                assert len(table) == self.pages[seq]
                live_from = 0 if g == 0 else dead_pages(len(toks))
                assert all(p != NO_PAGE for p in table[live_from:])
                for j, page in enumerate(table):
                    if page != NO_PAGE:
                        owners.setdefault(page, []).append((seq, j))
            assert usage.used == len(owners)
            for page, users in owners.items():
                if len(users) > 1:  # shared: same logical page, full, same token prefix
                    (s0, j0), *others = users
                    prefix = self.model[s0][: (j0 + 1) * PS]
                    assert len(prefix) == (j0 + 1) * PS
                    for s, j in others:
                        assert j == j0 and self.model[s][: (j + 1) * PS] == prefix

    @invariant()
    def dense_rows_mirror_bound_sequences(self):
        for g in range(2):
            dense = self.pool.block_table(g)
            for row in range(ROWS):
                expected = self.pool.seq_block_table(self.rows[row], g) if row in self.rows else []
                assert list(dense[row, : len(expected)]) == expected
                assert (dense[row, len(expected):] == NO_PAGE).all()

    def teardown(self):
        for row in list(self.rows):
            self.pool.unbind_row(row)
        for seq in list(self.model):
            self.pool.free(seq)
        for g in range(2):
            usage = self.pool.usage(g)
            assert usage.used == 0 and usage.cached + usage.free == usage.total
        self.pool.close()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=24), min_size=1, max_size=6),
       extra=st.integers(0, 1))
def test_live_full_pages_are_always_prefix_hits(prompts, extra):
    """Pages referenced by a live sequence are never evicted, so their prefix always hits."""
    with KVPool([64], page_size=PS, max_seq_len=MAX_LEN) as pool:
        for prompt in prompts:
            seq, cached = pool.create_sequence(prompt)
            pool.append(seq, prompt[cached:])
        for prompt in prompts:
            full = len(prompt) // PS * PS
            assert pool.prefix_lookup(prompt + [extra]) >= full
