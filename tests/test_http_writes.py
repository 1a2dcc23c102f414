"""`tputune serve`'s HTTP protocol (api.server.CoalescingHttpToolsProtocol): uvicorn's httptools protocol,
whose writes of one step of the event loop go out as one.

What is checked, with uvicorn's real protocol and a transport that records what it is asked to write (the
socket is the boundary): a small response's status line, headers and body are one write, not two; a
streamed response's headers and first chunk go out at once, before the app sends the next chunk (nothing
waits for the end of the response); data written before a close is not lost; header fields past
MAX_HEADER_BYTES are answered with 431 and never reach the app. (Every test that runs
`tputune serve`, through tests/support/serve.py, goes through it as well.)
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from api.server import MAX_HEADER_BYTES, CoalescingHttpToolsProtocol


class Transport:
    """What the protocol writes, call by call."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def connect(app: Any) -> tuple[Any, Transport]:
    assert CoalescingHttpToolsProtocol is not None
    config = uvicorn.Config(app, http=CoalescingHttpToolsProtocol, log_config=None, lifespan="off")
    config.load()
    protocol = CoalescingHttpToolsProtocol(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    return protocol, transport


async def small(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_small_response_is_one_write() -> None:
    asyncio.run(_test_a_small_response_is_one_write())


async def _test_a_small_response_is_one_write() -> None:
    protocol, transport = connect(small)
    for _ in range(3):  # three requests on one connection, one after the other
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
        await settle()
    assert len(transport.writes) == 3
    for write in transport.writes:
        assert write.startswith(b"HTTP/1.1 200 OK\r\n") and write.endswith(b"\r\n\r\nok")


def test_a_stream_goes_out_as_it_is_made() -> None:
    asyncio.run(_test_a_stream_goes_out_as_it_is_made())


async def _test_a_stream_goes_out_as_it_is_made() -> None:
    go_on = asyncio.Event()

    async def stream(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        await go_on.wait()
        await send({"type": "http.response.body", "body": b"second", "more_body": False})

    protocol, transport = connect(stream)
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
    await settle()
    # The headers and the first chunk are out while the app waits (chunked: no Content-Length).
    assert len(transport.writes) == 1
    assert b"transfer-encoding: chunked" in transport.writes[0]
    assert transport.writes[0].endswith(b"\r\n\r\n5\r\nfirst\r\n")
    go_on.set()
    await settle()
    assert b"".join(transport.writes[1:]) == b"6\r\nsecond\r\n0\r\n\r\n"


def test_what_was_written_before_a_close_goes_out_first() -> None:
    asyncio.run(_test_what_was_written_before_a_close_goes_out_first())


async def _test_what_was_written_before_a_close_goes_out_first() -> None:
    async def closing(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-length", b"3"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"bye"})

    protocol, transport = connect(closing)
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: test\r\n\r\n")
    await settle()
    assert transport.closed
    assert len(transport.writes) == 1 and transport.writes[0].endswith(b"\r\n\r\nbye")


def test_header_fields_past_the_limit_are_431_and_the_app_never_sees_them() -> None:
    asyncio.run(_test_header_fields_past_the_limit())


async def _test_header_fields_past_the_limit() -> None:
    """httptools takes any header fields: 2 MB of one, or 200,000 of them, were parsed, held and handed to
    the app. Past MAX_HEADER_BYTES the request is answered with 431 and the connection closed."""
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)
        await small(scope, receive, send)

    # Just under, in one field and in many, on one kept-alive connection: answered.
    protocol, transport = connect(app)
    room = MAX_HEADER_BYTES - len(b"host: test\r\n") - len(b"x-big: \r\n")
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * room + b"\r\n\r\n")
    await settle()
    many = b"".join(b"X-%05d: a\r\n" % i for i in range((MAX_HEADER_BYTES - 12) // 12))
    protocol.data_received(b"GET / HTTP/1.1\r\nHost: test\r\n" + many + b"\r\n")
    await settle()
    assert [write[:15] for write in transport.writes] == [b"HTTP/1.1 200 OK"] * 2 and len(seen) == 2
    for extra in (b"X-Big: " + b"a" * MAX_HEADER_BYTES + b"\r\n", many + b"X-One-More: a\r\n"):
        protocol, transport = connect(app)
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: test\r\n" + extra + b"\r\n")
        await settle()
        assert transport.closed and len(seen) == 2
        status, _, body = transport.writes[-1].partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
        assert json.loads(body)["error"]["code"] == "headers_too_large"
