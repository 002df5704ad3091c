"""Served greedy completions match transformers token for token, alone and batched."""

import asyncio
import random

import pytest

from northmk.tokenizer_files import write_tokenizer_files

from ..model.hf_oracle import hf_greedy, write_hf_checkpoint
from .helpers import DEVICE, post

STEPS = 8


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    model = write_hf_checkpoint(directory, "north-rules", seed=3)
    write_tokenizer_files(directory, model.config.vocab_size)
    return directory, model


async def test_concurrent_token_id_completions_match_transformers(aiohttp_client, hf_checkpoint):
    from northmk.engine import AsyncEngine
    from northmk.engine.config import EngineConfig
    from northmk.server import ServerConfig, create_app

    directory, model = hf_checkpoint
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 70)]
    expected = [hf_greedy(model, p, STEPS) for p in prompts]
    engine = AsyncEngine.from_config(EngineConfig(model=directory, device=DEVICE, max_batch=4, max_model_len=256))
    client = await aiohttp_client(create_app(ServerConfig(served_model_names=("hf",)), engine))
    body = {"max_tokens": STEPS, "temperature": 0, "ignore_eos": True, "logprobs": 0, "return_token_ids": True}
    replies = await asyncio.gather(*(post(client, "/v1/completions", {**body, "prompt": p}) for p in prompts))
    for reply, (tokens, logprobs) in zip(replies, expected):
        choice = reply["choices"][0]
        assert choice["token_ids"] == tokens
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-3)
