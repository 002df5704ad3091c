"""Chat and text completions through the real app and a real engine on a tiny checkpoint."""

from .helpers import ALIAS, MODEL, post, stream

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Write a loop."}], "temperature": 0}


async def test_chat_completion_returns_an_assistant_message_with_usage(client):
    data = await post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 5, "ignore_eos": True})
    assert data["object"] == "chat.completion" and data["model"] == MODEL and data["id"].startswith("chatcmpl-")
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    usage = data["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


async def test_streamed_chat_is_role_then_content_then_finish_then_usage_then_done(client):
    body = {**CHAT, "max_tokens": 6, "ignore_eos": True}
    whole = await post(client, "/v1/chat/completions", body)
    events = await stream(client, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    finish = chunks[-2]["choices"][0]
    assert finish["finish_reason"] == "length" and finish["delta"] == {}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert text == whole["choices"][0]["message"]["content"]  # greedy: same reply either way


async def test_chat_logprobs_list_the_chosen_token_and_its_alternatives(client):
    body = {**CHAT, "max_tokens": 4, "ignore_eos": True, "logprobs": True, "top_logprobs": 3}
    data = await post(client, "/v1/chat/completions", body)
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for item in content:
        assert item["logprob"] <= 0 and len(item["top_logprobs"]) == 3
        assert item["bytes"] == list(item["token"].encode())
        best = item["top_logprobs"][0]
        assert abs(best["logprob"] - item["logprob"]) < 1e-4  # greedy takes the best token


async def test_n_choices_stream_interleaved_by_index(client):
    body = {**CHAT, "temperature": 1.0, "seed": 7, "n": 3, "max_tokens": 4, "ignore_eos": True}
    events = await stream(client, "/v1/chat/completions", body)
    finishes = {}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    data = await post(client, "/v1/chat/completions", body)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert data["usage"]["completion_tokens"] == 12


async def test_seeded_sampling_is_reproducible(client):
    body = {**CHAT, "temperature": 1.0, "seed": 1234, "max_tokens": 8, "ignore_eos": True}
    first = await post(client, "/v1/chat/completions", body)
    second = await post(client, "/v1/chat/completions", body)
    assert first["choices"][0]["message"] == second["choices"][0]["message"]


async def test_token_id_completions_return_token_ids_and_logprobs(client):
    prompt = [5, 17, 99, 3, 250]
    body = {"model": ALIAS, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True}
    data = await post(client, "/v1/completions", body)
    (choice,) = data["choices"]
    assert data["object"] == "text_completion" and data["model"] == ALIAS
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 6
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 6
    assert logprobs["text_offset"][0] == 0 and all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}


async def test_concurrent_greedy_requests_return_what_each_returns_alone(client):
    import asyncio

    prompts = [[1 + i, 40 + 3 * i, 7, 300 + i] for i in range(4)]
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    alone = [(await post(client, "/v1/completions", {**body, "prompt": p}))["choices"][0]["token_ids"]
             for p in prompts]
    together = await asyncio.gather(*(post(client, "/v1/completions", {**body, "prompt": p}) for p in prompts))
    assert [d["choices"][0]["token_ids"] for d in together] == alone
    batched = await post(client, "/v1/completions", {**body, "prompt": prompts})
    assert [c["token_ids"] for c in batched["choices"]] == alone


async def test_several_prompts_with_n_number_choices_prompt_major(client):
    body = {"prompt": ["def f(", "class A"], "n": 2, "max_tokens": 3, "ignore_eos": True, "seed": 1}
    data = await post(client, "/v1/completions", body)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    events = await stream(client, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    finished = sorted(c["choices"][0]["index"] for c in events[:-2] if c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2, 3]
    assert events[-2]["usage"] == data["usage"]


async def test_echo_puts_the_prompt_before_the_completion(client):
    data = await post(client, "/v1/completions",
                      {"prompt": "def fib(n):", "max_tokens": 3, "echo": True, "temperature": 0})
    plain = await post(client, "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 3, "temperature": 0})
    assert data["choices"][0]["text"] == "def fib(n):" + plain["choices"][0]["text"]
    events = await stream(client, "/v1/completions", {"prompt": "def fib(n):", "max_tokens": 3, "echo": True,
                                                       "temperature": 0})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == data["choices"][0]["text"]


async def test_stop_string_ends_the_text_before_it(client):
    body = {"prompt": [11, 22, 33], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = (await post(client, "/v1/completions", body))["choices"][0]["text"]
    stop = next((full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].strip()), None)
    assert stop is not None, f"the greedy text is too short to pick a stop string: {full!r}"
    data = await post(client, "/v1/completions", {**body, "stop": [stop]})
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == full[:full.index(stop)]
    streamed = await stream(client, "/v1/completions", {**body, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == choice["text"]


async def test_chat_template_kwargs_reach_the_template(client):
    messages = [{"role": "user", "content": "hi"}]
    on = await post(client, "/tokenize", {"messages": messages})
    off = await post(client, "/tokenize", {"messages": messages, "chat_template_kwargs": {"reasoning": False}})
    assert on["tokens"] != off["tokens"]
