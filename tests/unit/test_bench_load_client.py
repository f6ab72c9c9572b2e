"""bench/retrieve_load.py's lean load client against small asyncio HTTP servers: bodies by
Content-Length and chunked, keep-alive, a server error counted, a closed connection
reopened."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from retrieve_load import load  # noqa: E402

HIT = {"document": {"id": "1", "contents": "x"}, "score": 1.0}


async def _serve(mode: str):
    served = {"requests": 0, "connections": 0}

    async def handle(reader, writer):
        served["connections"] += 1
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(
                line.split(b":")[1] for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ))  # fmt: skip
            body = json.loads(await reader.readexactly(length))
            served["requests"] += 1
            payload = json.dumps({"result": [[HIT] * body["topk"]]}).encode()
            if mode == "error":
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n{}")
            elif mode == "chunked":
                half = len(payload) // 2
                chunks = b"".join(
                    b"%x\r\n%s\r\n" % (len(c), c) for c in (payload[:half], payload[half:])
                )
                writer.write(
                    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
                )
            else:
                close = mode == "close"
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n"
                    % (len(payload), b"Connection: close\r\n" if close else b"") + payload
                )  # fmt: skip
            await writer.drain()
            if mode == "close":
                writer.close()
                return

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, served


def _run(mode: str) -> tuple[dict, dict]:
    async def go():
        server, served = await _serve(mode)
        port = server.sockets[0].getsockname()[1]
        async with server:
            result = await load(f"http://127.0.0.1:{port}/retrieve", ["q"], clients=4,
                                seconds=0.3, topk=3, client="raw")  # fmt: skip
        return result, served

    return asyncio.run(go())


def test_keep_alive_requests_are_counted_by_content_length_and_chunked():
    for mode in ("length", "chunked"):
        result, served = _run(mode)
        assert result["requests_failed"] == 0, result["failures"]
        assert result["requests_ok"] == served["requests"] > 4
        assert served["connections"] == 4  # one keep-alive connection per client


def test_errors_are_counted_and_closed_connections_reopened():
    result, served = _run("error")
    assert result["requests_ok"] == 0 and result["failures"] == {"HTTP 500": served["requests"]}
    result, served = _run("close")
    assert result["requests_failed"] == 0 and served["connections"] == served["requests"]
