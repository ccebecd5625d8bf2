"""The gateway's HTTP/1.1 server (adapters/gateway/http11/) keeps every protection the gateway
had from hypercorn: head and idle timeouts, the head size limit, malformed requests refused,
keep-alive and HTTP/1.0 rules, pipelined requests answered in order with bounded read-ahead, a
client leaving seen as http.disconnect, Expect: 100-continue, errors, and the drain. Real
loopback sockets, raw bytes on the client side."""

from __future__ import annotations

import socket

import pytest
import trio

from relayline.adapters.gateway.http11 import READ_AHEAD, READ_SIZE, Server, listening_sockets


class App:
    """Answers `path` with its body; /slow waits for `release`; /watch waits for the client to
    leave; /boom raises; /stream answers in three pieces."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.events: list[str] = []
        self.release = trio.Event()
        self.started = trio.Event()

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"]
        self.seen.append(path)
        body = b""
        if scope["method"] == "POST":
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        if path == "/boom":
            raise RuntimeError("the app failed")
        if path == "/slow":
            self.started.set()
            await self.release.wait()
        if path == "/watch":
            self.started.set()
            message = await receive()
            while message["type"] == "http.request":  # a GET's (empty) body first
                message = await receive()
            self.events.append(message["type"])
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"late"})  # to a client that left: dropped
            self.events.append("sent")
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        if path == "/stream":
            for piece in (b"one ", b"two ", b"three"):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.body", "body": f"{path} {len(body)}".encode()})


async def start(nursery, app, **limits):
    settings = {"keep_alive_s": 5.0, "max_header_bytes": 4096, "graceful_s": 5.0, **limits}
    server = Server(app, **settings)
    stop = trio.Event()
    sockets = listening_sockets("127.0.0.1", 0)
    port = sockets[0].getsockname()[1]
    await nursery.start(server.run, sockets, stop)
    return server, stop, port


async def read_until_closed(stream, limit_s: float = 5.0) -> bytes:
    data = b""
    with trio.move_on_after(limit_s):
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                return data
            data += chunk
    raise AssertionError(f"still open after {limit_s} s; got {data[:200]!r}")


async def read_response(stream, buffer: bytearray) -> bytes:
    """One response (content-length or chunked) from the stream; the rest stays in buffer."""
    with trio.fail_after(5):
        while True:
            head_end = buffer.find(b"\r\n\r\n")
            if head_end >= 0:
                head = bytes(buffer[:head_end]).lower()
                if b"content-length:" in head:
                    length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
                    end = head_end + 4 + length
                else:
                    end = buffer.find(b"\r\n0\r\n\r\n", head_end) + 7 if b"\r\n0\r\n\r\n" in buffer else -1
                    end = end if end > 6 else -1
                if 0 < end <= len(buffer):
                    response = bytes(buffer[:end])
                    del buffer[:end]
                    return response
            chunk = await stream.receive_some(65536)
            assert chunk, f"closed before a whole response: {bytes(buffer)[:200]!r}"
            buffer += chunk


GET = b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n"


async def test_keep_alive_serves_requests_in_turn_one_body_with_a_length_a_stream_chunked():
    app = App()
    async with trio.open_nursery() as nursery:
        server, stop, port = await start(nursery, app)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        buffer = bytearray()
        await stream.send_all(GET % b"/first")
        first = await read_response(stream, buffer)
        await stream.send_all(b"POST /second HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello")
        second = await read_response(stream, buffer)
        await stream.send_all(GET % b"/stream")
        third = await read_response(stream, buffer)
        stop.set()
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 8\r\n" in first.lower()
    assert first.endswith(b"/first 0") and b"date: " in first.lower()
    assert second.endswith(b"/second 5")
    assert b"transfer-encoding: chunked" in third.lower() and b"three" in third
    assert app.seen == ["/first", "/second", "/stream"]


async def test_pipelined_requests_are_answered_in_order_one_at_a_time():
    app = App()
    async with trio.open_nursery() as nursery:
        _, stop, port = await start(nursery, app)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(GET % b"/slow" + GET % b"/after")
        await app.started.wait()
        await trio.sleep(0.1)
        assert app.seen == ["/slow"]  # the second waits for the first's answer
        app.release.set()
        buffer = bytearray()
        first, second = await read_response(stream, buffer), await read_response(stream, buffer)
        stop.set()
    assert first.endswith(b"/slow 0") and second.endswith(b"/after 0")


async def test_what_a_client_sends_ahead_is_buffered_only_up_to_the_limit():
    app = App()
    async with trio.open_nursery() as nursery:
        server, stop, port = await start(nursery, app, graceful_s=0.3)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(GET % b"/watch")
        await app.started.wait()
        with trio.move_on_after(1):
            await stream.send_all(b"x" * (8 * 1024 * 1024))  # the server stops reading: this blocks
        (connection,) = server.connections
        assert connection.read_ahead <= READ_AHEAD + READ_SIZE
        stop.set()
        await stream.aclose()


async def test_a_head_too_slow_and_an_idle_connection_are_closed_without_an_answer():
    app = App()
    async with trio.open_nursery() as nursery:
        _, stop, port = await start(nursery, app, keep_alive_s=0.3)
        slow = await trio.open_tcp_stream("127.0.0.1", port)
        await slow.send_all(b"GET /never HTTP/1.1\r\nhost: x\r\n")  # no blank line: the head never ends
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await idle.send_all(GET % b"/once")
        started = trio.current_time()
        assert await read_until_closed(slow) == b""
        answered = await read_until_closed(idle)
        waited = trio.current_time() - started
        stop.set()
    assert answered.startswith(b"HTTP/1.1 200") and answered.endswith(b"/once 0")
    assert 0.25 <= waited < 3
    assert app.seen == ["/once"]


async def test_a_keep_alive_connection_waits_for_its_next_head_with_no_timer_of_its_own(monkeypatch):
    """The head watchdog (one task for the server) bounds each wait for a head: serving requests
    on a kept-alive connection enters no cancel scope (a deadline registered and removed per
    request cost more than reading the head)."""
    entered: list[str] = []
    enter = trio.CancelScope.__enter__

    def counted(scope):
        task = trio.lowlevel.current_task()
        if task.name.endswith("_run_handler"):  # a connection's task (not the watchdogs' sleeps, nor the client's)
            entered.append(task.name)
        return enter(scope)

    async with trio.open_nursery() as nursery:
        _, stop, port = await start(nursery, App(), keep_alive_s=0.4)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        buffer = bytearray()
        await stream.send_all(GET % b"/first")
        await read_response(stream, buffer)
        monkeypatch.setattr(trio.CancelScope, "__enter__", counted)
        for path in (b"/a", b"/b", b"/c"):
            await stream.send_all(GET % path)
            assert (await read_response(stream, buffer)).endswith(path + b" 0")
        monkeypatch.undo()
        assert entered == []
        started = trio.current_time()
        assert await read_until_closed(stream) == b""  # idle: closed by the watchdog, unanswered
        waited = trio.current_time() - started
        stop.set()
    assert 0.35 <= waited < 3


async def test_a_drain_closes_a_connection_waiting_for_its_next_head_gracefully():
    """A connection the drain (or the head watchdog) closes between requests is closed without a
    reset, even with the client's next request unread: the client reads EOF, and what it sent is
    read and dropped (linger). A close with input unread resets the connection, and a reset can
    destroy an answer the client has not read yet."""
    import os

    app = App()
    async with trio.open_nursery() as nursery:
        server, stop, port = await start(nursery, app)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(GET % b"/a")
        assert (await read_response(stream, bytearray())).endswith(b"/a 0")
        await trio.sleep(0.05)  # (the connection waits for its next head)
        (connection,) = server.connections
        os.write(stream.socket.fileno(), GET % b"/b")  # its next request, unread when...
        connection.drain()  # ...the drain closes the connection (no checkpoint in between)
        with trio.fail_after(5):
            assert await stream.receive_some(100) == b""  # EOF, not a reset (BrokenResourceError)
        await stream.aclose()
        stop.set()
    assert app.seen == ["/a"]  # (the request it sent ahead was never served)


async def test_a_head_beyond_the_limit_is_431_and_a_malformed_request_400_both_closed():
    app = App()
    async with trio.open_nursery() as nursery:
        _, stop, port = await start(nursery, app, max_header_bytes=1024)
        big = await trio.open_tcp_stream("127.0.0.1", port)
        await big.send_all(b"GET / HTTP/1.1\r\nhost: x\r\nx-filler: " + b"a" * 4000)  # still arriving
        bad = await trio.open_tcp_stream("127.0.0.1", port)
        await bad.send_all(b"NOT HTTP AT ALL\r\n\r\n")
        too_big, malformed = await read_until_closed(big), await read_until_closed(bad)
        stop.set()
    assert too_big.startswith(b"HTTP/1.1 431") and b"connection: close" in too_big.lower()
    assert malformed.startswith(b"HTTP/1.1 400") and b"connection: close" in malformed.lower()
    assert app.seen == []


async def test_http_1_0_and_connection_close_end_the_connection_after_the_answer():
    app = App()
    async with trio.open_nursery() as nursery:
        _, stop, port = await start(nursery, app)
        old = await trio.open_tcp_stream("127.0.0.1", port)
        await old.send_all(b"GET /old HTTP/1.0\r\n\r\n")
        closing = await trio.open_tcp_stream("127.0.0.1", port)
        await closing.send_all(b"GET /close HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" + GET % b"/ignored")
        first, second = await read_until_closed(old), await read_until_closed(closing)
        stop.set()
    assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"/old 0")
    assert second.endswith(b"/close 0") and b"/ignored" not in second
    assert "/ignored" not in app.seen


async def test_a_stream_to_http_1_0_or_to_connection_close_is_framed_by_the_close_and_else_chunked():
    # RFC 9112 6.1: no chunked to an HTTP/1.0 client; 6.3's last case: a response with neither
    # a length nor chunked ends with the connection's close, legal for both clients
    app = App()
    async with trio.open_nursery() as nursery:
        _, stop, port = await start(nursery, app)
        answers = []
        for request in (b"GET /stream HTTP/1.0\r\n\r\n",
                        b"GET /stream HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
                        b"GET /stream HTTP/1.1\r\nhost: x\r\nconnection: keep-alive, close\r\n\r\n"):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(request)
            answers.append(await read_until_closed(stream))
        kept = await trio.open_tcp_stream("127.0.0.1", port)
        await kept.send_all(GET % b"/stream")
        chunked = await read_response(kept, bytearray())
        stop.set()
    for answer in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        assert lines[0] == b"http/1.1 200 ok" and b"connection: close" in lines, answer
        assert not any(line.startswith((b"content-length", b"transfer-encoding")) for line in lines), answer
        assert body == b"one two three"  # the bytes as sent, then the close
    head, _, body = chunked.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower() and b"connection" not in head.lower()
    assert body == b"4\r\none \r\n4\r\ntwo \r\n5\r\nthree\r\n0\r\n\r\n"


async def test_expect_100_continue_is_answered_when_the_body_is_read():
    app = App()
    async with trio.open_nursery() as nursery:
        _, stop, port = await start(nursery, app)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nexpect: 100-continue\r\n\r\n")
        with trio.fail_after(5):
            interim = await stream.receive_some(65536)
        assert interim.startswith(b"HTTP/1.1 100")
        await stream.send_all(b"abc")
        answer = await read_response(stream, bytearray())
        stop.set()
    assert answer.endswith(b"/upload 3")


# (garbage sent ahead: the reader's fault in it must not stop the server seeing the client leave)
@pytest.mark.parametrize("ahead", [b"", b"NOT HTTP AT ALL\r\n\r\n"])
async def test_a_client_that_leaves_is_a_disconnect_and_writes_to_it_are_dropped(ahead):
    app = App()
    async with trio.open_nursery() as nursery:
        _, stop, port = await start(nursery, app)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(GET % b"/watch" + ahead)
        await app.started.wait()
        await stream.aclose()
        with trio.fail_after(5):
            while "sent" not in app.events:
                await trio.sleep(0.01)
        stop.set()
    assert app.events == ["http.disconnect", "sent"]


async def _answer_to_a_failing_app(app, path: bytes) -> bytes:
    async with trio.open_nursery() as nursery:
        _, stop, port = await start(nursery, app, error_body=lambda status, message: b'{"error": "x"}')
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(GET % path)
        answer = await read_until_closed(stream)
        stop.set()
    return answer


async def test_an_app_error_before_its_answer_is_a_500_and_the_connection_closes():
    answer = await _answer_to_a_failing_app(App(), b"/boom")
    assert answer.startswith(b"HTTP/1.1 500") and answer.endswith(b'{"error": "x"}')


async def test_an_app_error_after_its_start_message_but_before_any_body_is_still_a_500():
    # the head waits for the body (one head per answer): nothing was written when the app
    # raised, so the client gets a 500, not a connection closed without a byte (which SDKs
    # read as a network failure, and resend the request)
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-from", b"app")]})
        raise RuntimeError("a bug between the start and the body")

    answer = await _answer_to_a_failing_app(app, b"/")
    assert answer.startswith(b"HTTP/1.1 500") and answer.endswith(b'{"error": "x"}') and b"x-from" not in answer


async def test_the_drain_refuses_new_connections_closes_idle_ones_and_lets_requests_finish():
    app = App()
    async with trio.open_nursery() as nursery:
        server, stop, port = await start(nursery, app)
        idle = await trio.open_tcp_stream("127.0.0.1", port)
        await idle.send_all(GET % b"/before")
        await read_response(idle, bytearray())
        busy = await trio.open_tcp_stream("127.0.0.1", port)
        await busy.send_all(GET % b"/slow")
        await app.started.wait()
        stop.set()
        assert await read_until_closed(idle) == b""  # idle between requests: closed at once
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        app.release.set()
        finished = await read_until_closed(busy)
    assert finished.startswith(b"HTTP/1.1 200") and b"connection: close" in finished.lower()
    assert finished.endswith(b"/slow 0")


async def test_what_is_still_running_after_the_grace_is_cancelled():
    app = App()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            _, stop, port = await start(nursery, app, graceful_s=0.2)
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(GET % b"/slow")  # never released
            await app.started.wait()
            stop.set()
            assert await read_until_closed(stream) == b""


async def test_a_header_an_app_sends_is_still_checked_when_its_head_is_built_with_the_body():
    """The head is built once the body is known (one header check), so a header that would split
    the response (a CR LF in its value) is refused there: the client gets a 500, never the header."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-echo", b"a\r\nset-cookie: injected=1")]})
        await send({"type": "http.response.body", "body": b"never sent"})

    async with trio.open_nursery() as nursery:
        _server, stop, port = await start(nursery, app)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(GET % b"/")
        answer = await read_until_closed(stream)
        stop.set()
    assert answer.startswith(b"HTTP/1.1 500 ") and b"injected" not in answer and b"never sent" not in answer


async def test_an_app_asking_to_be_told_of_a_hang_up_is_called_back_once_and_only_while_its_request_runs():
    """`relayline.hangup`: the server calls the app back when the client closes while the request
    runs (data it sent ahead does not hide the close), and not for a close after the answer."""
    calls: list[str] = []
    release = trio.Event()

    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        scope["extensions"]["relayline.hangup"](lambda: calls.append(scope["path"]))
        if scope["path"] == "/wait":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    async with trio.open_nursery() as nursery:
        server, stop, port = await start(nursery, app)
        assert server.hangups is not None
        quick = await trio.open_tcp_stream("127.0.0.1", port)
        await quick.send_all(GET % b"/quick")
        assert (await read_response(quick, bytearray())).endswith(b"done")
        await quick.aclose()  # after its answer: no call-back
        waiting = await trio.open_tcp_stream("127.0.0.1", port)
        await waiting.send_all(GET % b"/wait" + GET % b"/next")
        await trio.sleep(0.1)
        await waiting.aclose()
        with trio.fail_after(5):
            while not calls:
                await trio.sleep(0.01)
        release.set()
        await trio.sleep(0.1)
        stop.set()
    # (the pipelined /next may be served too, to a client already gone: its call-back is right)
    assert calls[:1] == ["/wait"] and "/quick" not in calls and not server.hangups.callbacks, calls


class _CountedEpoll:
    """The hang-up set's epoll, its registrations counted (select.epoll's methods are C)."""

    def __init__(self, epoll) -> None:
        self.inner = epoll
        self.calls: list[str] = []

    def register(self, fd, events):
        self.calls.append("register")
        self.inner.register(fd, events)

    def unregister(self, fd):
        self.calls.append("unregister")
        self.inner.unregister(fd)

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def test_a_connection_joins_the_hang_up_set_once_for_all_its_requests():
    """Two epoll_ctl calls a connection, not two a request: the socket stays in the set between
    requests (without a call-back) and leaves it when the connection ends."""
    calls: list[str] = []

    async def app(scope, receive, send):
        scope["extensions"]["relayline.hangup"](lambda: calls.append(scope["path"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    async with trio.open_nursery() as nursery:
        server, stop, port = await start(nursery, app)
        epoll = server.hangups.epoll = _CountedEpoll(server.hangups.epoll)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        buffer = bytearray()
        for path in (b"/a", b"/b", b"/c"):
            await stream.send_all(GET % path)
            assert (await read_response(stream, buffer)).endswith(b"done")
        assert epoll.calls == ["register"] and len(server.hangups.callbacks) == 1
        await stream.aclose()  # after its answers: no call-back
        with trio.fail_after(5):
            while server.connections:
                await trio.sleep(0.01)
        stop.set()
    assert epoll.calls == ["register", "unregister"] and not server.hangups.callbacks and not calls


async def test_a_hang_up_heard_between_requests_is_told_to_the_next_request_at_once():
    """A client that hangs up while its connection has no request running: the next request
    it sent ahead is told at once when it asks, as a new registration would have told it."""
    from relayline.adapters.gateway.http11.hangups import Hangups

    hangups = Hangups()
    ours, theirs = socket.socketpair()
    owner = object()
    heard: list[str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hangups.run)
        hangups.watch(ours.fileno(), owner, lambda: heard.append("first"))
        assert hangups.unwatch(ours.fileno(), owner) is not None  # the first request ended, unheard
        theirs.shutdown(socket.SHUT_WR)
        with trio.fail_after(5):
            while not hangups.callbacks[ours.fileno()].hung_up:
                await trio.sleep(0.01)
        assert heard == []  # no request was running
        hangups.watch(ours.fileno(), owner, lambda: heard.append("second"))
        assert heard == ["second"]
        hangups.forget(ours.fileno(), owner)
        assert not hangups.callbacks
        nursery.cancel_scope.cancel()
    ours.close()
    theirs.close()


async def test_an_app_is_told_when_the_whole_body_is_here_and_not_before():
    """`relayline.body_here`: True only when receive() will answer the whole body at once (it
    came with its head), so the gateway sets no body timer for it; a body still arriving, or one
    already read, is False."""
    said: list[tuple[str, bool, bool]] = []

    async def app(scope, receive, send):
        here = scope["extensions"]["relayline.body_here"]
        before = here()
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        said.append((scope["path"], before, here()))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"%d" % len(body)})

    post = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n"
    async with trio.open_nursery() as nursery:
        _server, stop, port = await start(nursery, app)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        buffer = bytearray()
        await stream.send_all(post % b"/whole" + b"0123456789")
        assert (await read_response(stream, buffer)).endswith(b"\r\n\r\n10")
        await stream.send_all(post % b"/halves" + b"01234")
        await trio.sleep(0.1)
        await stream.send_all(b"56789")
        assert (await read_response(stream, buffer)).endswith(b"\r\n\r\n10")
        await stream.send_all(GET % b"/get")
        await read_response(stream, buffer)
        await stream.aclose()
        stop.set()
    assert said == [("/whole", True, False), ("/halves", False, False), ("/get", True, False)], said


async def test_the_server_tells_its_owner_how_many_connections_are_open_as_they_open_and_close():
    counts: list[int] = []
    async with trio.open_nursery() as nursery:
        settings = {"keep_alive_s": 5.0, "max_header_bytes": 4096, "graceful_s": 5.0}
        server = Server(App(), on_connections=counts.append, **settings)
        stop = trio.Event()
        sockets = listening_sockets("127.0.0.1", 0)
        await nursery.start(server.run, sockets, stop)
        port = sockets[0].getsockname()[1]
        streams = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(3)]
        for stream in streams:  # an answer on each: every connection has been taken
            await stream.send_all(GET % b"/a")
            await read_response(stream, bytearray())
        assert counts == [1, 2, 3]
        for stream in streams:
            await stream.aclose()
        with trio.fail_after(5):
            while len(counts) < 6:
                await trio.sleep(0.01)
        assert counts == [1, 2, 3, 2, 1, 0]
        stop.set()
