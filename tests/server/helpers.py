"""Names and small HTTP helpers shared by the server tests."""

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import northmk

MODEL = "tiny"
ALIAS = "tiny-alias"
MAX_MODEL_LEN = 256
STARTUP_S = 90  # a `python -m northmk.serve` process becomes healthy within this
# Where the engine under test runs: the CPU in CI; tools/gpu_run.sh sets cuda.
DEVICE = os.environ.get("NORTHMK_TEST_DEVICE", "cpu")


def serve_env(**extra: str) -> dict[str, str]:
    """Environment for a `python -m northmk.serve` child importing the same northmk as this test."""
    paths = [str(Path(northmk.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}


async def post(client, path: str, body: dict, status: int = 200) -> dict:
    response = await client.post(path, json=body)
    data = await response.json()
    assert response.status == status, data
    return data


async def stream(client, path: str, body: dict) -> list:
    """The SSE events of a streamed request; the final [DONE] as the string "[DONE]"."""
    response = await client.post(path, json={**body, "stream": True})
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = []
    async for line in response.content:
        if line.strip():
            assert line.startswith(b"data: "), line
            payload = line[len(b"data: "):].strip()
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus metric's samples in an exposition text."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total


# ---- tools and schemas for the structured-output tests ------------------------------------
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def special_texts(checkpoint) -> list[str]:
    from northmk.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(checkpoint)
    return [tokenizer.id_to_token(i) for i in tokenizer.all_special_ids]


def assert_clean(text: str | None, specials: list[str]) -> None:
    """No special-token text leaked into what a client reads."""
    assert not any(s in (text or "") for s in specials), text


# ---- server processes -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}: {process.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("server did not become healthy")


# ---- engine workloads shared by the CPU and GPU engine tests --------------------------------
async def ahead_workload(engine, run, prompts: list[list[int]], stop_ids: list[int]) -> list:
    """Requests one after another, so every engine steps the same rows together: a sampled one
    with logprobs (prompts[0], 100 tokens: across page boundaries), two choices of which one
    should stop early on one of stop_ids (a row leaves the batch while the other goes on;
    prompts[1]), a greedy one (prompts[2]). run(engine, prompt, request_id, **params) ->
    (ids, logprobs) of choice 0; returns (ids, logprobs) per row, the choices' logprobs empty."""
    from northmk.engine import GenerationRequest, SamplingParams

    out = [await run(engine, prompts[0], "a", temperature=0.9, seed=3, max_tokens=100, logprobs=0)]
    request = GenerationRequest("b", prompts[1], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=90,
                                                                 stop_token_ids=stop_ids))
    choices: dict[int, list[int]] = {}
    async for item in engine.generate(request):
        for c in item.outputs:
            choices.setdefault(c.index, []).extend(c.token_ids)
    out += [(choices[0], []), (choices[1], [])]
    out.append(await run(engine, prompts[2], "c", max_tokens=70))
    return out
