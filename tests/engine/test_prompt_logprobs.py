"""Prompt logprobs (`SamplingParams.prompt_logprobs`) through the engine on a tiny checkpoint,
against one whole-prompt forward of the reference model."""

import asyncio

import pytest
import torch

from northmk.checkpoint import load_checkpoint
from northmk.config import PAGE_SIZE
from northmk.engine import FinishReason, GenerationRequest, SamplingParams
from northmk.engine.prompt_logprobs import PromptScorer
from northmk.engine.types import RequestRejected
from northmk.model.kv import BatchLayout, PagedKVCache
from northmk.model.reference import ReferenceModel

PROMPT = [2] + list(range(200, 330))  # 131 tokens: three pages, several small prefill chunks


@pytest.fixture(scope="module")
def expected(tiny_checkpoint) -> torch.Tensor:
    """[len(PROMPT) - 1, V]: log-softmax at every prompt position but the last, one forward pass."""
    config, weights = load_checkpoint(tiny_checkpoint)
    model = ReferenceModel(config, weights)
    pages = -(-len(PROMPT) // PAGE_SIZE)
    kv = PagedKVCache(config, [pages] * len(config.attention_groups), model.dtype, model.device)
    table = torch.arange(pages, dtype=torch.int32).view(1, -1)
    layout = BatchLayout([len(PROMPT)], [0], [table] * len(config.attention_groups))
    hidden = model.forward(torch.tensor(PROMPT), layout, kv)
    return torch.log_softmax(model.logits(hidden), dim=-1)[:-1]


async def run(engine, request_id, prompt=PROMPT, **params):
    """(outputs, token ids per choice) of one request."""
    params.setdefault("temperature", 0.0)
    request = GenerationRequest(request_id, list(prompt), SamplingParams(**params))
    outputs = [out async for out in engine.generate(request)]
    tokens: dict[int, list[int]] = {}
    for out in outputs:
        for choice in out.outputs:
            tokens.setdefault(choice.index, []).extend(choice.token_ids)
    return outputs, tokens


TOL = 1e-4  # chunked prefill against one whole forward: the same logprobs up to float noise


def assert_matches(items, expected: torch.Tensor, k: int) -> None:
    assert len(items) == len(PROMPT) and items[0] is None
    for pos, item in enumerate(items[1:]):
        row = expected[pos]
        assert item.token_id == PROMPT[pos + 1]
        assert item.logprob == pytest.approx(float(row[item.token_id]), abs=TOL)
        # The rank counts the tokens above the prompt's. Those within the noise of both values of
        # it may fall either way (the whole forward ties one with position 114's token exactly;
        # chunked prefill puts it above on some CPUs).
        gap = row - row[item.token_id]
        others = torch.arange(len(row)) != item.token_id
        assert int((gap > 2 * TOL).sum()) + 1 <= item.rank <= int((others & (gap > -2 * TOL)).sum()) + 1
        assert [t for t, _ in item.top] == torch.topk(row, k).indices.tolist()
        assert [lp for _, lp in item.top] == pytest.approx(torch.topk(row, k).values.tolist(), abs=TOL)
        values = [lp for _, lp in item.top]
        assert values == sorted(values, reverse=True)


async def test_prompt_logprobs_match_one_whole_prompt_forward_across_chunks(make_engine, expected):
    engine = await make_engine(prefill_chunk=24)  # 131 tokens -> 6 chunks, boundaries mid-page
    outputs, tokens = await run(engine, "p", max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    assert_matches(outputs[0].prompt_logprobs, expected, 3)
    assert all(out.prompt_logprobs is None for out in outputs[1:])  # delivered once
    _, plain = await run(engine, "plain", max_tokens=3, ignore_eos=True)
    assert tokens == plain  # scoring the prompt does not change what is generated


async def test_a_cached_prompt_is_recomputed_and_not_counted_as_a_cache_query(make_engine, expected):
    engine = await make_engine(prefill_chunk=64)
    await run(engine, "warm", max_tokens=1)
    before = engine.stats()
    queries = engine.metrics.prefix_cache_queries._value.get()
    outputs, _ = await run(engine, "scored", max_tokens=1, prompt_logprobs=0)
    assert outputs[0].num_cached_tokens == 0
    assert_matches(outputs[0].prompt_logprobs, expected, 0)
    after = engine.stats()
    assert after["prefix_cache_query_tokens"] == before["prefix_cache_query_tokens"]
    assert engine.metrics.prefix_cache_queries._value.get() == queries
    outputs, _ = await run(engine, "hit", max_tokens=1)
    assert outputs[0].num_cached_tokens == 2 * PAGE_SIZE  # the cache still serves plain requests


async def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(make_engine, expected):
    engine = await make_engine()
    outputs, tokens = await run(engine, "score", max_tokens=0, n=2, prompt_logprobs=1)
    (out,) = outputs
    assert [c.finish_reason for c in out.outputs] == [FinishReason.LENGTH] * 2
    assert all(c.num_generated == 0 and c.token_ids == [] and c.text == "" for c in out.outputs)
    assert out.first_token_time is None
    assert_matches(out.prompt_logprobs, expected, 1)
    for _ in range(100):
        if engine.stats()["kv_pages_used"] == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.stats()["kv_pages_used"] == 0 and engine.stats()["num_rows"] == 0


async def test_preempted_requests_deliver_prompt_logprobs_once_and_unchanged(make_engine):
    # Three 41-token prompts on 4 pages of 64 tokens: each grows to 3 pages (191 tokens), so any
    # two rows that decode together run out of pages and one is preempted and recomputed. The
    # first request's 150 steps give the others' prefills (on the executor, beside the decode
    # loop) room to start within them however loaded the machine is: with 30 tokens a request,
    # a late second prefill left nothing to preempt.
    prompts = [[2] + list(range(100 * i + 10, 100 * i + 50)) for i in range(3)]
    params = dict(max_tokens=150, ignore_eos=True, prompt_logprobs=2)
    roomy = await make_engine(max_batch=3)
    alone = [await run(roomy, f"r{i}", p, **params) for i, p in enumerate(prompts)]
    tight = await make_engine(max_batch=3, num_kv_pages=4)
    together = await asyncio.gather(*[run(tight, f"t{i}", p, **params) for i, p in enumerate(prompts)])
    assert tight.metrics.num_preemptions._value.get() > 0
    # Only the recomputes looked the prompt up in the cache: they were not scored again.
    assert tight.stats()["prefix_cache_query_tokens"] > 0
    for (outs, tokens), (ref_outs, ref_tokens) in zip(together, alone):
        sent = [out.prompt_logprobs for out in outs if out.prompt_logprobs is not None]
        assert len(sent) == 1 and sent[0] == ref_outs[0].prompt_logprobs
        assert tokens == ref_tokens


@pytest.mark.parametrize("value", [-1, 21, 1.5])
async def test_prompt_logprobs_out_of_range_are_rejected(make_engine, value):
    engine = await make_engine()
    with pytest.raises(RequestRejected) as err:
        await anext(engine.generate(GenerationRequest("bad", PROMPT, SamplingParams(prompt_logprobs=value))))
    assert err.value.param == "prompt_logprobs"


def test_the_scorer_takes_chunks_in_order_and_names_the_token_after_a_chunk():
    prompt = [5, 1, 3, 0]
    logits = torch.eye(6)[[1, 3, 0, 2]] * 10  # position i puts its mass on prompt[i + 1] (last: anything)
    scorer = PromptScorer(prompt, num_top=1)
    scorer.score(logits[:2], 0)  # the second row predicts prompt[2], which opens the next chunk
    assert not scorer.complete
    with pytest.raises(AssertionError):
        scorer.score(logits[3:], 3)  # position 2 was skipped
    scorer.score(logits[2:], 2)
    assert scorer.complete and [item.token_id for item in scorer.items[1:]] == [1, 3, 0]
    assert all(item.rank == 1 and item.top[0][0] == item.token_id for item in scorer.items[1:])
