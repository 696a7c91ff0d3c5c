"""Server-sent events as the OpenAI streaming API uses them.

Each event is one `data: <json>\\n\\n` frame; the stream ends with `data: [DONE]\\n\\n`
(OpenAI API reference, "Streaming"; the SSE format itself is WHATWG HTML,
"Server-sent events").
"""

from __future__ import annotations

import orjson
from aiohttp import web

DONE = b"data: [DONE]\n\n"

HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",   # proxies must not buffer the stream
}


def event(obj: dict) -> bytes:
    """One SSE frame carrying `obj` as JSON."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def open_stream(request: web.Request, headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Sends the 200 status and SSE headers; returns the response to write frames to.

    Raises: ConnectionResetError if the client is already gone.
    """
    resp = web.StreamResponse(status=200, headers={**HEADERS, **(headers or {})})
    await resp.prepare(request)
    return resp
