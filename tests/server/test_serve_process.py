"""`python -m northmk.serve` as a real process on loopback, driven by the official openai SDK."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from northmk.serve import main

from .helpers import DEVICE, MODEL, free_port, serve_env, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    port = free_port()
    env = serve_env(NORTHMK_API_KEY=KEY)
    command = [sys.executable, "-m", "northmk.serve", "--model", str(tiny_checkpoint),
               "--device", DEVICE, "--dtype", "float32", "--port", str(port),
               "--served-model-name", MODEL, "--max-model-len", "256", "--max-batch", "4",
               "--drain-timeout", "2", "--log-level", "warning"]
    process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        yield url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def sdk(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "Write a function."}]


def test_chat_non_streamed_and_streamed_agree_with_usage(sdk):
    reply = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens


def test_completions_with_stop_seed_n_and_logprobs(sdk):
    full = sdk.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert len(choice.logprobs.tokens) == 10 and full.usage.completion_tokens == 10
    stop = choice.text[3:5]
    if stop.strip():
        stopped = sdk.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0,
                                         stop=[stop], extra_body={"ignore_eos": True})
        assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    seeded = [sdk.completions.create(model=MODEL, prompt="x = ", max_tokens=8, temperature=1.0, seed=5, n=2)
              for _ in range(2)]
    assert [c.text for c in seeded[0].choices] == [c.text for c in seeded[1].choices]
    assert [c.index for c in seeded[0].choices] == [0, 1]
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == choice.text


def test_completions_score_a_prompt_with_echo_and_max_tokens_zero(sdk):
    prompt = [2, 17, 99, 301, 5]
    scored = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                    extra_body={"prompt_logprobs": 1})
    choice = scored.choices[0]
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(prompt) and choice.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    vllm = choice.model_extra["prompt_logprobs"]
    assert vllm[0] is None and [vllm[i][str(t)]["logprob"] for i, t in enumerate(prompt) if i] == \
        choice.logprobs.token_logprobs[1:]


def test_chat_logprobs_and_top_logprobs(sdk):
    reply = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0,
                                        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_sdk_error_classes(sdk, server):
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=7)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=MODEL, prompt=[1] * 300, max_tokens=1)
    wrong = openai.OpenAI(base_url=f"{server[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert [m.id for m in sdk.models.list()] == [MODEL]


def test_bench_serving_reports_latencies(server):
    command = [sys.executable, "tools/bench_serving.py", "--url", server[0], "--api-key", KEY,
               "--num-requests", "6", "--concurrency", "3", "--prompt-lens", "8,24", "--max-tokens", "5", "--json"]
    done = subprocess.run(command, cwd=ROOT, env=serve_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["succeeded"] == 6 and report["failed"] == 0
    assert report["ttft_s"]["p50"] > 0 and report["itl_s"]["p90"] > 0
    assert report["output_tokens_per_s"] > 0 and report["requests_per_s"] > 0


def test_sigterm_drains_in_flight_streams_and_exits_zero(server, sdk):
    url, process = server
    received: list[str] = []

    def consume() -> None:
        try:
            for chunk in sdk.completions.create(model=MODEL, prompt="long", max_tokens=150, stream=True,
                                                extra_body={"ignore_eos": True}):
                received.extend(c.text for c in chunk.choices)
        except (openai.APIError, OSError):  # cut off when the drain timeout ran out
            received.append("<cut>")

    reader = threading.Thread(target=consume)
    reader.start()
    while not received:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    reader.join(timeout=30)
    assert not reader.is_alive()


@pytest.mark.parametrize("argv,message", [
    (["--port", "http"], "--port"), (["--port", "70000"], "port"), (["--max-batch", "0"], "--max-batch"),
    (["--model", "/no/such/dir"], "config.json"), (["--backend", "jax"], "--backend"), (["--bogus"], "--bogus"),
    (["--device", "tpu"], "device"),
])
def test_bad_cli_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
