"""Names and small HTTP helpers shared by the server tests."""

import json

MODEL = "tiny"
ALIAS = "tiny-alias"
MAX_MODEL_LEN = 256


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
