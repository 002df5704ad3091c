"""Merging engine iterators: every item once, errors propagate, closing closes all."""

import asyncio

import pytest

from northmk.server.streaming import merge, sse_event


def test_sse_event_framing():
    assert sse_event(b'{"a":1}') == b'data: {"a":1}\n\n'


async def counting(name: str, n: int, closed: list[str], delay: float = 0.0, fail_at: int | None = None):
    try:
        for i in range(n):
            await asyncio.sleep(delay)
            if i == fail_at:
                raise RuntimeError(f"{name} failed")
            yield f"{name}{i}"
    finally:
        closed.append(name)


async def test_merge_yields_every_item_tagged_with_its_source():
    closed: list[str] = []
    items = [x async for x in merge([counting("a", 3, closed), counting("b", 2, closed, 0.001)])]
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert [v for i, v in items if i == 0] == ["a0", "a1", "a2"]  # order kept per source
    assert sorted(closed) == ["a", "b"]


async def test_an_error_in_one_source_closes_the_others():
    closed: list[str] = []
    with pytest.raises(RuntimeError, match="b failed"):
        async for _ in merge([counting("a", 1000, closed, 0.001), counting("b", 5, closed, 0.001, fail_at=2)]):
            pass
    assert sorted(closed) == ["a", "b"]


async def test_abandoning_the_merged_iterator_closes_every_source():
    closed: list[str] = []
    merged = merge([counting("a", 1000, closed, 0.001), counting("b", 1000, closed, 0.001)])
    async for _ in merged:
        break
    await merged.aclose()
    assert sorted(closed) == ["a", "b"]
    single: list[str] = []
    merged = merge([counting("s", 1000, single)])
    await anext(merged)
    await merged.aclose()
    assert single == ["s"]
