"""A minimal asyncio HTTP/1.1 client for server-sent events, so tests can hold hundreds of
streams open at once and close a connection at a moment of their choosing."""
from __future__ import annotations

import asyncio
import json


async def open_stream(base_url: str, path: str, body: dict, read_head: bool = True,
                      headers: dict[str, str] | None = None
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int | None]:
    """Send a POST (with ``headers`` added) and (unless not ``read_head``) read the status line
    and headers; returns (reader, writer, status)."""
    host, port = base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
                 f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
    await writer.drain()
    if not read_head:
        return reader, writer, None
    status = int((await reader.readline()).split()[1])
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    return reader, writer, status


async def read_events(reader: asyncio.StreamReader, limit: int | None = None) -> list[str]:
    """``data:`` payloads until the stream ends (or ``limit`` events were read).

    Daphne sends chunked transfer encoding; chunk-size lines are skipped, as they never
    start with ``data:``.
    """
    events: list[str] = []
    while limit is None or len(events) < limit:
        line = await reader.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            events.append(line[6:].rstrip(b"\r\n").decode("utf-8"))
    return events


async def stream(base_url: str, path: str, body: dict) -> tuple[int, list[str]]:
    reader, writer, status = await open_stream(base_url, path, body)
    events = await read_events(reader)
    writer.close()
    return status, events
