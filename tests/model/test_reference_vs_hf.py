"""The reference model equals transformers' Cohere2MoeForCausalLM, paged and batched."""

from __future__ import annotations

import random

import pytest
import torch

from northmk.checkpoint import load_checkpoint
from northmk.config import PAGE_SIZE
from northmk.generate import generate
from northmk.model.kv import BatchLayout, PagedKVCache
from northmk.model.reference import ReferenceModel

from .hf_oracle import VARIANTS, hf_greedy, hf_prefill_logits, write_hf_checkpoint


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = write_hf_checkpoint(directory, request.param)
    config, weights = load_checkpoint(directory, dtype=torch.float32)
    return hf, ReferenceModel(config, weights)


def prompts_for(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def scattered_tables(rows: int, pages_per_row: int, groups: int, seed: int = 2) -> list[torch.Tensor]:
    """Block tables whose pages are shuffled across rows, so paging bugs cannot hide."""
    rng = random.Random(seed)
    tables = []
    for _ in range(groups):
        ids = list(range(rows * pages_per_row))
        rng.shuffle(ids)
        tables.append(torch.tensor(ids, dtype=torch.int32).view(rows, pages_per_row))
    return tables


def test_prefill_logits_match_for_a_ragged_batch(pair):
    hf, ref = pair
    config = ref.config
    prompts = prompts_for(config.vocab_size, [1, 37, 70, 130])
    pages = -(-max(map(len, prompts)) // PAGE_SIZE)
    groups = len(config.attention_groups)
    kv = PagedKVCache(config, [len(prompts) * pages] * groups, torch.float32, "cpu")
    layout = BatchLayout([len(p) for p in prompts], [0] * len(prompts), scattered_tables(len(prompts), pages, groups))
    hidden = ref.forward(torch.tensor([t for p in prompts for t in p]), layout, kv)
    ours = ref.logits(hidden).split([len(p) for p in prompts])
    for prompt, got in zip(prompts, ours):
        want = hf_prefill_logits(hf, prompt)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_shot(pair):
    _, ref = pair
    config = ref.config
    prompt = prompts_for(config.vocab_size, [150])[0]
    groups = len(config.attention_groups)
    tables = scattered_tables(1, 3, groups)
    one = PagedKVCache(config, [3] * groups, torch.float32, "cpu")
    want = ref.step(torch.tensor(prompt), BatchLayout([150], [0], tables), one)
    chunked = PagedKVCache(config, [3] * groups, torch.float32, "cpu")
    for start, end in ((0, 50), (50, 64), (64, 149), (149, 150)):
        got = ref.step(torch.tensor(prompt[start:end]), BatchLayout([end - start], [start], tables), chunked)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_greedy_decode_matches_across_sliding_window_boundaries(pair):
    """72 greedy steps from ragged prompts decoded together equal transformers token for token."""
    hf, ref = pair
    steps = 72  # windows here are 16-33 keys: every row crosses several window and page boundaries
    prompts = prompts_for(ref.config.vocab_size, [5, 23, 61])
    ours = generate(ref, prompts, steps)
    for prompt, gen in zip(prompts, ours):
        tokens, logprobs = hf_greedy(hf, prompt, steps)
        assert gen.token_ids == tokens
        assert max(abs(a - b) for a, b in zip(gen.logprobs, logprobs)) < 2e-3
