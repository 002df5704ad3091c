"""The HTTP surface: errors in OpenAI's shape, auth, limits, ids, info routes, hostile clients."""

import asyncio

import pytest

from northmk.server.state import ENGINE

from .helpers import MAX_MODEL_LEN, MODEL, metric, post

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
LONG = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "temperature": 0}


async def error_of(response, status: int) -> dict:
    assert response.status == status, await response.text()
    assert response.headers["Content-Type"].startswith("application/json")
    error = (await response.json())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("body", [
    b'{"model": "tiny", "messages": [', b"not json at all", b'{"messages": "\xff\xfe"}', b"",
])
async def test_malformed_bodies_are_400(client, body):
    response = await client.post("/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    error = await error_of(response, 400)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("fields,param", [
    ({"temperature": "warm"}, "temperature"), ({"temperature": 9}, "temperature"), ({"n": 0}, "n"),
    ({"messages": []}, "messages"), ({"max_tokens": -4}, "max_tokens"), ({"top_p": 0}, "top_p"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
])
async def test_bad_fields_are_400_naming_the_field(client, fields, param):
    error = await error_of(await client.post("/v1/chat/completions", json={**CHAT, **fields}), 400)
    assert error["param"] == param


async def test_unknown_model_is_404_and_unknown_route_is_404_and_wrong_method_is_405(client):
    error = await error_of(await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    await error_of(await client.get("/v1/nothing"), 404)
    response = await client.get("/v1/chat/completions")
    await error_of(response, 405)
    assert "POST" in response.headers["Allow"]


async def test_prompt_and_max_tokens_beyond_the_context_are_400(client):
    body = {"prompt": [1] * (MAX_MODEL_LEN - 4), "max_tokens": 5}
    error = await error_of(await client.post("/v1/completions", json=body), 400)
    assert error["code"] == "context_length_exceeded"
    error = await error_of(await client.post("/v1/completions", json={"prompt": [1] * MAX_MODEL_LEN}), 400)
    assert error["code"] == "context_length_exceeded"
    error = await error_of(await client.post("/v1/completions", json={"prompt": [10**6]}), 400)
    assert error["param"] == "prompt"


async def test_bodies_over_the_limit_are_413(make_client):
    client = await make_client(server={"max_body_bytes": 4096})
    body = {"prompt": "x" * 5000, "max_tokens": 1}
    error = await error_of(await client.post("/v1/completions", json=body), 413)
    assert error["code"] == "body_too_large"
    assert (await client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1})).status == 200


async def test_api_key_guards_every_route_but_health(make_client):
    client = await make_client(server={"api_key": "sesame"})
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                         ("POST", "/tokenize")):
        response = await client.request(method, path, json={"prompt": "x"})
        assert (await error_of(response, 401))["type"] == "authentication_error"
    wrong = await client.get("/v1/models", headers={"Authorization": "Bearer open"})
    await error_of(wrong, 401)
    assert (await client.get("/health")).status == 200
    good = await client.get("/v1/models", headers={"Authorization": "Bearer sesame"})
    assert good.status == 200


async def test_request_id_is_echoed_or_generated(client):
    response = await client.get("/v1/models", headers={"X-Request-Id": "trace-123"})
    assert response.headers["X-Request-Id"] == "trace-123"
    generated = (await client.get("/v1/models")).headers["X-Request-Id"]
    assert len(generated) == 32
    hostile = await client.get("/v1/models", headers={"X-Request-Id": "a b\tc" * 50})
    assert hostile.headers["X-Request-Id"] != "a b\tc" * 50
    error = await client.post("/v1/completions", data=b"{", headers={"X-Request-Id": "bad-1"})
    assert error.headers["X-Request-Id"] == "bad-1"


async def test_models_tokenize_and_detokenize(client):
    models = await (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    with_bos = await post(client, "/tokenize", {"prompt": "def main():"})
    tokens = await post(client, "/tokenize", {"prompt": "def main():", "add_special_tokens": False,
                                              "return_token_strs": True})
    assert with_bos["tokens"][1:] == tokens["tokens"]
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 0
    text = await post(client, "/detokenize", {"tokens": tokens["tokens"]})
    assert text["prompt"] == "def main():"
    await post(client, "/tokenize", {}, status=400)
    await post(client, "/detokenize", {"tokens": [10**7]}, status=400)


async def test_over_the_concurrency_limit_is_429(make_client):
    client = await make_client(server={"max_concurrent_requests": 1})
    running = await client.post("/v1/completions", json={**LONG, "stream": True})
    assert running.status == 200
    await running.content.readline()
    refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    await error_of(refused, 429)
    assert refused.headers["Retry-After"] == "1"
    running.close()


async def test_a_full_waiting_queue_is_503_with_retry_after(make_client):
    client = await make_client(engine={"max_batch": 1, "max_waiting": 1})
    running = await client.post("/v1/completions", json={**LONG, "stream": True})
    await running.content.readline()
    waiting = asyncio.create_task(client.post("/v1/completions", json={**LONG, "max_tokens": 2}))
    await asyncio.sleep(0.2)
    refused = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    error = await error_of(refused, 503)
    assert int(refused.headers["Retry-After"]) >= 1 and error["code"] == "overloaded"
    running.close()
    assert (await waiting).status == 200


async def test_health_is_503_once_the_engine_stopped(client):
    assert (await client.get("/health")).status == 200
    await client.server.app[ENGINE].shutdown(0)
    response = await client.get("/health")
    assert (await error_of(response, 503))["code"] == "engine_dead"
    await error_of(await client.post("/v1/completions", json={"prompt": "x"}), 503)


async def wait_until_idle(client) -> str:
    for _ in range(200):
        text = await (await client.get("/metrics")).text()
        if (metric(text, "northmk:num_requests_running") == 0
                and metric(text, "northmk:kv_cache_usage_perc") == 0):
            return text
        await asyncio.sleep(0.05)
    raise AssertionError(f"the engine did not return to idle:\n{text}")


async def test_abandoned_streams_free_their_rows_and_pages(client):
    async def abandon(i: int) -> None:
        path = "/v1/completions" if i % 2 else "/v1/chat/completions"
        body = {**LONG, "stream": True, "n": 1 + i % 3} if i % 2 else \
            {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
        response = await client.post(path, json=body)
        assert response.status == 200
        await response.content.readline()
        response.close()  # the client goes away mid-stream

    await asyncio.gather(*(abandon(i) for i in range(24)))
    # hostile bodies in between
    for body in (b"{", b'{"prompt": 5}', b'{"prompt": "x", "n": 1000}'):
        assert (await client.post("/v1/completions", data=body)).status == 400
    text = await wait_until_idle(client)
    assert metric(text, "northmk:http_requests_total") > 0
    data = await post(client, "/v1/completions", {"prompt": "after", "max_tokens": 3, "ignore_eos": True})
    assert data["usage"]["completion_tokens"] == 3


async def test_a_client_that_disconnects_from_a_non_streamed_request_aborts_it(client):
    task = asyncio.create_task(client.post("/v1/completions", json=LONG))
    await asyncio.sleep(0.3)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await wait_until_idle(client)
