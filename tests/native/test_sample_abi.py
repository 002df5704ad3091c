"""nmk_sample at the C ABI: every bad argument is refused before anything touches CUDA (so
in every build, with addresses that are never dereferenced), and a library built without
CUDA says so. tests/gpu/test_sampling.py runs the kernel."""

from __future__ import annotations

import pytest

from northmk.native._lib import NativeError, Status, load
from northmk.native.sample import MAX_ROWS, MAX_VOCAB, SampleRow, rows_array, sample

NAN, INF = float("nan"), float("inf")
FAKE = 0x1000  # a device address nmk_sample must not use when it refuses the call


def good_row(**kw) -> SampleRow:
    fields = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1, counter=0) | kw
    return SampleRow(**fields)


def call(rows=None, num_rows=None, vocab=32, logits=FAKE, tokens=FAKE, logprobs=FAKE, params=True):
    rows = rows if rows is not None else [good_row()]
    array = rows_array(rows) if params else None
    sample(logits, len(rows) if num_rows is None else num_rows, vocab, array, tokens, logprobs, None)


def refused(match: str, **kw) -> None:
    with pytest.raises(NativeError) as info:
        call(**kw)
    assert info.value.status == Status.ERR_INVALID_ARGUMENT
    assert match in info.value.message and info.value.message.startswith("nmk_sample:")


@pytest.mark.parametrize("missing", ["logits", "tokens", "params"])
def test_null_pointers_are_refused(missing):
    refused("NULL argument", **{missing: None if missing != "params" else False})


def test_row_count_and_vocabulary_must_be_in_range():
    refused("rows must be in [1, 64], got 0", num_rows=0)
    refused(f"rows must be in [1, {MAX_ROWS}], got {MAX_ROWS + 1}", rows=[good_row()] * (MAX_ROWS + 1))
    refused("vocab must be in [1, 16777216], got 0", vocab=0)
    refused(f"got {MAX_VOCAB + 1}", vocab=MAX_VOCAB + 1)


@pytest.mark.parametrize("field, value, match", [
    ("temperature", NAN, "temperature must be <= 0 (greedy) or in [1.17549e-38, inf), got nan"),
    ("temperature", INF, "temperature must be"), ("temperature", -INF, "temperature must be"),
    ("temperature", 1e-39, "temperature must be <= 0 (greedy) or in [1.17549e-38, inf), got 1e-39"),
    ("top_p", 0.0, "top_p must be in (0, 1]"), ("top_p", -0.5, "top_p must be in (0, 1]"),
    ("top_p", 1.01, "top_p must be in (0, 1]"), ("top_p", NAN, "top_p must be in (0, 1]"),
    ("min_p", -0.01, "min_p must be in [0, 1]"), ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("min_p", NAN, "min_p must be in [0, 1]"),
])
def test_row_parameters_out_of_range_name_the_row(field, value, match):
    rows = [good_row(), good_row(), good_row(**{field: value})]
    refused(f"row 2: {match}", rows=rows)


def test_greedy_rows_are_checked_too():
    refused("row 0: top_p", rows=[good_row(temperature=0.0, top_p=2.0)])


def test_without_cuda_valid_arguments_are_unsupported():
    if load().nmk_has_cuda():
        pytest.skip("libnorthmk was built with CUDA")
    rows = [good_row(temperature=0.0), good_row(top_k=5, top_p=0.9, min_p=0.1, seed=(1 << 64) - 1, counter=7)]
    for logprobs in (FAKE, None):
        with pytest.raises(NativeError) as info:
            call(rows=rows, vocab=MAX_VOCAB, logprobs=logprobs)
        assert info.value.status == Status.ERR_UNSUPPORTED
        assert info.value.message == "nmk_sample: libnorthmk was built without CUDA"
