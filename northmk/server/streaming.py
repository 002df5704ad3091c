"""Server-sent events and the plumbing between engine iterators and a response.

An SSE stream is `data: <json>\\n\\n` events ending with `data: [DONE]\\n\\n`. A client that
goes away shows up as ConnectionResetError on write; the handler then stops iterating,
and `contextlib.aclosing` closes the engine iterator, which aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Iterable

import msgspec
from aiohttp import web

from ..engine.types import EngineError, RequestOutput
from .errors import APIError, as_api_error

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not buffer the stream
}


def sse_event(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class EventStream:
    """One SSE response; `send` batches events into one write."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers=SSE_HEADERS)
        self.disconnected = False

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payloads: Iterable[bytes]) -> None:
        data = b"".join(sse_event(p) for p in payloads)
        if data:
            await self._write(data)

    async def send_error(self, error: APIError) -> None:
        """An error after the stream started: an event with the error body (then [DONE])."""
        await self._write(sse_event(msgspec.json.encode(error.body())))

    async def close(self) -> web.StreamResponse:
        if not self.disconnected:
            with contextlib.suppress(ConnectionResetError):
                await self._write(DONE)
                await self.response.write_eof()
        return self.response

    async def _write(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionResetError:
            self.disconnected = True
            raise


async def serve_events(request: web.Request, outputs: AsyncIterator, events: AsyncIterator[list[bytes]]
                       ) -> web.StreamResponse:
    """Streams `events` (batches of SSE payloads made from the engine iterator `outputs`).

    A client that goes away ends the response quietly; an API or engine error after the
    stream opened becomes an error event. Either way `outputs` is closed, aborting the request.
    """
    stream = EventStream(request)
    async with contextlib.aclosing(outputs), contextlib.aclosing(events):
        try:
            await stream.open()
            async for batch in events:
                await stream.send(batch)
        except ConnectionResetError:
            return stream.response
        except (APIError, EngineError) as error:
            await stream.send_error(as_api_error(error))
    return await stream.close()


async def merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests as they come, tagged with the iterator's index.

    Closing the merged iterator (or an error in any one) closes all of them.
    """
    if len(iterators) == 1:
        async with contextlib.aclosing(iterators[0]) as only:
            async for output in only:
                yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(i: int, iterator: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(iterator):
                async for output in iterator:
                    await queue.put((i, output))
            await queue.put((i, finished))
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 -- re-raised by the consumer
            await queue.put((i, error))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is finished:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
