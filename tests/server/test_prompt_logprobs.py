"""Prompt logprobs over HTTP: `echo` + `logprobs` on /v1/completions (OpenAI's legacy shape,
`max_tokens: 0` to score a prompt alone) and vLLM's `prompt_logprobs` extra on both routes."""

import pytest

from .helpers import MODEL, post, stream

PROMPT = [2, 17, 99, 301, 5, 40, 41]
SCORE = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True}


async def token_texts(client, ids: list[int]) -> list[str]:
    return [(await post(client, "/detokenize", {"tokens": [t], "skip_special_tokens": False}))["prompt"] for t in ids]


async def test_echo_with_logprobs_lists_the_prompt_tokens_then_the_generated_ones(client):
    data = await post(client, "/v1/completions", {**SCORE, "max_tokens": 3, "echo": True, "logprobs": 2,
                                                  "prompt_logprobs": 2})
    plain = await post(client, "/v1/completions", {**SCORE, "max_tokens": 3, "logprobs": 2})
    (choice,), (alone,) = data["choices"], plain["choices"]
    lp, generated = choice["logprobs"], alone["logprobs"]
    prompt_texts = await token_texts(client, PROMPT)
    assert lp["tokens"] == prompt_texts + generated["tokens"]  # token-id prompt: the tokens' texts
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # The first generated token's logits come from the all-positions prefill: equal up to rounding.
    assert lp["token_logprobs"][len(PROMPT):] == pytest.approx(generated["token_logprobs"], abs=1e-4)
    for top, alone_top in zip(lp["top_logprobs"][len(PROMPT):], generated["top_logprobs"]):
        assert top == pytest.approx(alone_top, abs=1e-4)
    offsets = [sum(map(len, prompt_texts[:i])) for i in range(len(PROMPT))]
    assert lp["text_offset"][:len(PROMPT)] == offsets
    echoed = choice["text"][: len(choice["text"]) - len(alone["text"])]
    assert lp["text_offset"][len(PROMPT)] == len(echoed)  # generated offsets index the echoed text
    # The same numbers in vLLM's shape: {token id: {logprob, rank, decoded_token}} per position.
    scored = choice["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        own = scored[i][str(PROMPT[i])]
        assert own["logprob"] == lp["token_logprobs"][i] and own["decoded_token"] == prompt_texts[i]
        assert own["rank"] >= 1 and (own["rank"] == 1) == (own["logprob"] >= max(lp["top_logprobs"][i].values()))
        alternatives = sorted((v for k, v in scored[i].items() if v["rank"] <= 2), key=lambda v: v["rank"])
        assert [v["rank"] for v in alternatives] == [1, 2]
        assert {v["decoded_token"]: v["logprob"] for v in alternatives} == lp["top_logprobs"][i]
    assert data["usage"] == plain["usage"]


async def test_streamed_echo_chunk_carries_the_prompt_logprobs(client):
    body = {**SCORE, "max_tokens": 4, "echo": True, "logprobs": 1}
    whole = (await post(client, "/v1/completions", body))["choices"][0]
    events = await stream(client, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    first = chunks[0]
    assert first["text"] == whole["text"][: len(first["text"])] and first["text"]
    assert len(first["logprobs"]["tokens"]) == len(PROMPT) and first["logprobs"]["token_logprobs"][0] is None
    merged = {key: [x for c in chunks if c["logprobs"] for x in c["logprobs"][key]] for key in whole["logprobs"]}
    assert merged == whole["logprobs"]
    assert "".join(c["text"] for c in chunks) == whole["text"]


@pytest.mark.parametrize("streamed", [False, True])
async def test_max_tokens_zero_with_echo_scores_the_prompt_alone(client, streamed):
    body = {**SCORE, "max_tokens": 0, "echo": True, "logprobs": 0}
    if streamed:
        events = await stream(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        choices = [c for e in events[:-1] for c in e["choices"]]
        choice = {"text": "".join(c["text"] for c in choices), "finish_reason": choices[-1]["finish_reason"],
                  "logprobs": choices[0]["logprobs"]}
        usage = events[-2]["usage"]
    else:
        data = await post(client, "/v1/completions", body)
        (choice,), usage = data["choices"], data["usage"]
    prompt_text = (await post(client, "/detokenize", {"tokens": PROMPT, "skip_special_tokens": False}))["prompt"]
    assert choice["text"] == prompt_text and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) and lp["token_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:]) and all(top == {} for top in lp["top_logprobs"][1:])
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(PROMPT)


async def test_a_string_prompt_echo_lists_its_tokens_from_bos(client):
    data = await post(client, "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 0, "echo": True,
                                                  "logprobs": 1})
    choice = data["choices"][0]
    ids = (await post(client, "/tokenize", {"prompt": "def fib(n):"}))["tokens"]
    assert choice["text"] == "def fib(n):"
    assert choice["logprobs"]["tokens"] == await token_texts(client, ids)


async def test_chat_prompt_logprobs_are_top_level_as_in_vllm(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 1, "return_token_ids": True}
    data = await post(client, "/v1/chat/completions", body)
    prompt_ids, scored = data["prompt_token_ids"], data["prompt_logprobs"]
    assert len(scored) == len(prompt_ids) and scored[0] is None
    for token, position in zip(prompt_ids[1:], scored[1:]):
        assert str(token) in position and 1 <= len(position) <= 2
        assert any(v["rank"] == 1 for v in position.values())
    plain = await post(client, "/v1/chat/completions", {**body, "prompt_logprobs": None})
    assert "prompt_logprobs" not in plain and plain["choices"] == data["choices"]


async def test_echo_logprobs_after_the_prompt_was_cached_still_cover_every_token(client):
    prompt = list(range(100, 170))  # more than one 64-token page
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 1}
    await post(client, "/v1/completions", body)
    cached = await post(client, "/v1/completions", body)
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    scored = await post(client, "/v1/completions", {**body, "echo": True, "logprobs": 0})
    lp = scored["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(prompt) + 1 and None not in lp["token_logprobs"][1:]
    assert "prompt_tokens_details" not in scored["usage"]  # scored prompts skip the prefix cache


async def test_each_prompt_of_a_batch_echoes_its_own_tokens_in_every_choice(client):
    prompts = [PROMPT, [2, 300, 301]]
    body = {**SCORE, "prompt": prompts, "n": 2, "max_tokens": 2, "echo": True, "logprobs": 0}
    data = await post(client, "/v1/completions", body)
    events = await stream(client, "/v1/completions", body)
    for choice in data["choices"]:
        ids = prompts[choice["index"] // 2]
        assert choice["logprobs"]["tokens"][:len(ids)] == await token_texts(client, ids)
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 2
        chunks = [c for e in events[:-1] for c in e["choices"] if c["index"] == choice["index"]]
        assert chunks[0]["logprobs"]["tokens"] == choice["logprobs"]["tokens"][:len(ids)]  # the echo comes first
        assert "".join(c["text"] for c in chunks) == choice["text"]
