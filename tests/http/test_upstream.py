"""The lean upstream client (providers/upstream.py) and its pool against real loopback servers
that answer with raw bytes, as a provider (or a broken one) would send them: keep-alive reuse
and one write per request, a connection its server closed while idle, a request never sent
twice, chunked framing edge cases split at every byte, malformed HTTP, a body cut short, gzip
and deflate, TLS against a local CA, and the proxies httpx honoured."""

from __future__ import annotations

import gzip
import ssl
import zlib
from functools import partial

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from raw_server import RawServer

from relayline.adapters.codecs.content_coding import UnsupportedEncoding
from relayline.adapters.providers import pool as pool_module
from relayline.adapters.providers.pool import Pools, ProfilePool
from relayline.adapters.providers.upstream import (
    INFLATE_PIECE,
    Connection,
    UpstreamError,
    UpstreamRequest,
    head_fields,
    render,
)

OK_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"


def json_answer(body: bytes = b'{"ok": true}', extra: bytes = b"") -> bytes:
    return OK_HEAD + extra + b"content-length: %d\r\n\r\n" % len(body) + body


def request(url: str, body: bytes = b'{"model": "m"}') -> UpstreamRequest:
    return UpstreamRequest(url, {"content-type": "application/json", "authorization": "Bearer sk-test"}, body)


async def fetch(pool: ProfilePool, req: UpstreamRequest) -> tuple[int, dict, bytes, bool]:
    async with pool.exchange(req) as response:
        body = b"".join([piece async for piece in response])
        return response.status, response.headers, body, response.complete


@pytest.fixture
async def serve(nursery):
    async def start(answer, **kwargs) -> RawServer:
        server = RawServer(answer, **kwargs)
        await server.start(nursery)
        return server

    return start


async def test_keepalive_reuse_with_one_write_per_request(serve, monkeypatch):
    writes: list[bytes] = []
    write = Connection.write

    async def counted(self, data):
        writes.append(data)
        await write(self, data)

    monkeypatch.setattr(Connection, "write", counted)
    server = await serve(lambda number, index: json_answer(b'{"n": %d}' % index))
    pool = ProfilePool()
    for n in range(3):
        status, headers, body, complete = await fetch(pool, request(server.url))
        assert (status, body, complete) == (200, b'{"n": %d}' % n, True)
        assert headers["content-type"] == "application/json"
    assert server.accepted == 1 and [r[0] for r in server.requests] == [1, 1, 1]
    assert len(writes) == 3 and all(w.endswith(b'\r\n\r\n{"model": "m"}') for w in writes)
    head = server.requests[0][1].decode()
    assert head.startswith("POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:")
    assert "authorization: Bearer sk-test" in head and "content-length: 14" in head
    assert "accept-encoding: gzip, deflate" in head and "user-agent: relayline" in head
    await pool.aclose()
    assert pool.opened == 0


async def test_a_connection_its_server_closed_while_idle_is_never_written_to(serve):
    # the server answers, then closes the connection without saying so (no connection: close)
    server = await serve(lambda number, index: json_answer(), close=True)
    pool = ProfilePool()
    for _ in range(3):
        assert (await fetch(pool, request(server.url)))[0] == 200
        await trio.sleep(0.05)  # the server's close reaches us while the connection idles
    assert server.accepted == 3 and [r[0] for r in server.requests] == [1, 2, 3]  # each request once
    await pool.aclose()


async def test_a_request_the_server_dropped_unanswered_is_not_sent_again(serve):
    """Once written, a request may have been read and acted on: the exchange fails as a
    connection error and the driver's retry policy (visible, ledgered) decides, never a
    silent resend here."""
    server = await serve(lambda number, index: json_answer() if (number, index) == (1, 0) else None)
    pool = ProfilePool()
    assert (await fetch(pool, request(server.url)))[0] == 200
    with pytest.raises(UpstreamError, match="connection closed before the response"):
        await fetch(pool, request(server.url))  # on the reused connection, which the server then drops
    assert len(server.requests) == 2 and server.accepted == 1
    assert pool.opened == 0


CHUNKED = OK_HEAD + b"transfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("framed, body", [
    (CHUNKED + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", b"hello world"),
    (CHUNKED + b"5;name=value\r\nhello\r\n0\r\n\r\n", b"hello"),  # a chunk extension
    (CHUNKED + b"A\r\n0123456789\r\n0\r\n\r\n", b"0123456789"),  # upper-case hex
    (CHUNKED + b"0000005\r\nhello\r\n0\r\n\r\n", b"hello"),  # leading zeros
    (CHUNKED + b"3\r\nabc\r\n0\r\nx-checksum: 1\r\nx-other: 2\r\n\r\n", b"abc"),  # trailers
    (CHUNKED + b"0\r\n\r\n", b""),  # an empty body
    (OK_HEAD + b"content-length: 0\r\n\r\n", b""),
    (b"HTTP/1.1 100 Continue\r\n\r\n" + json_answer(b"{}"), b"{}"),  # an informational head first
    # empty lines before a status line (llhttp skips them; the head is read from its "HTTP/")
    (b"\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n\r\n" + json_answer(b"{}"), b"{}"),
])
@pytest.mark.parametrize("pieces", [0, 1, 7])
async def test_framing_read_whole_however_it_is_split_and_the_connection_reused(serve, framed, body, pieces):
    server = await serve(lambda number, index: framed, pieces=pieces)
    pool = ProfilePool()
    with trio.fail_after(10):
        for _ in range(2):
            assert await fetch(pool, request(server.url)) == (200, pool_module_headers(framed), body, True)
    assert server.accepted == 1
    await pool.aclose()


def pool_module_headers(framed: bytes) -> dict:
    head = framed.rsplit(b"HTTP/1.1 ", 1)[1].split(b"\r\n\r\n")[0].decode()
    return dict(line.split(": ", 1) for line in head.split("\r\n")[1:])


@pytest.mark.parametrize("extra", [b"connection: close\r\n", b""])  # (h11 says DONE for the second)
async def test_a_body_closed_by_the_connection_is_read_whole_and_the_connection_not_reused(serve, extra):
    server = await serve(lambda number, index: OK_HEAD + extra + b"\r\nall of it", close=True)
    pool = ProfilePool()
    for _ in range(2):
        assert (await fetch(pool, request(server.url)))[2:] == (b"all of it", True)
        assert pool.opened == 0  # closed at once, not kept idle until the next request notices
    assert server.accepted == 2
    await pool.aclose()


@pytest.mark.parametrize("answer, message", [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten..", "connection lost while reading the response"),
    (CHUNKED + b"5\r\nhello\r\n", "connection lost while reading the response"),
    (CHUNKED + b"zz\r\nhello\r\n0\r\n\r\n", "malformed HTTP response body"),
    (CHUNKED + b"5\r\nhello!!\r\n0\r\n\r\n", "malformed HTTP response body"),  # a chunk longer than it said
    # framing in a trailer (h11 refused it; llhttp took a Transfer-Encoding there as the connection's end)
    (CHUNKED + b"5\r\nhello\r\n0\r\ntransfer-encoding: gzip\r\n\r\n", "malformed HTTP response body"),
    (CHUNKED + b"5\r\nhello\r\n0\r\ncontent-length: 5\r\n\r\n", "malformed HTTP response body"),
    # the connection's management in a trailer (RFC 9110 6.5.1): llhttp ends the connection there
    (CHUNKED + b"5\r\nhello\r\n0\r\nconnection: close\r\n\r\n", "malformed HTTP response body"),
])
async def test_a_cut_or_malformed_body_is_an_upstream_error_and_closes_the_connection(serve, answer, message):
    server = await serve(lambda number, index: answer, close=True)
    pool = ProfilePool()
    with trio.fail_after(5):
        async with pool.exchange(request(server.url)) as response:
            with pytest.raises(UpstreamError, match=message):
                async for _ in response:
                    pass
    assert pool.opened == 0
    await pool.aclose()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 2OO OK\r\n\r\n",  # not a status code
    b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello",  # two lengths
    b"HTTP/1.1 200 OK\r\nbad header line\r\n\r\n",
    b"<html>no HTTP at all</html>\r\n\r\n",
])
async def test_a_malformed_head_is_an_upstream_error(serve, answer):
    server = await serve(lambda number, index: answer)
    pool = ProfilePool()
    with trio.fail_after(5), pytest.raises(UpstreamError, match="malformed HTTP response head"):
        await fetch(pool, request(server.url))
    assert pool.opened == 0


@pytest.mark.parametrize("answer", [
    # what llhttp (the parser) reads but this client refuses, as it did with h11
    b"HTTP/2.0 200 OK\r\ncontent-length: 2\r\n\r\nok",  # not HTTP/1.x
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nabc",  # llhttp would read it to the close
    b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n",  # nothing asked it
    # llhttp frames by the last of two Transfer-Encoding headers: the body would be handed on gzip-coded
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 099 Odd\r\ncontent-length: 2\r\n\r\nok",  # not a status (llhttp waits for a head after it)
    # and what llhttp refuses itself
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nx-key: sk\x00\r\ncontent-length: 2\r\n\r\nok",
    b"HTTP/1.1 200 O\x00K\r\ncontent-length: 2\r\n\r\nok",  # llhttp reads any byte in a reason phrase

    b"HTTP/1.1 200 OK\r\n" + b"x-long: " + b"a" * (101 * 1024) + b"\r\n\r\n",  # a head beyond 100 KiB
    b"HTTP/1.1 200 OK\r\n" + b"x-many: y\r\n" * 10000 + b"\r\n",  # headers that add up beyond it
    # the head's lines are read from its bytes, not from llhttp's callbacks: what llhttp refuses
    # in them is still refused before they are read
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-folded: a\r\n b\r\n\r\nok",  # obs-fold
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-cr: a\rb\r\n\r\nok",  # a CR in a value
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-lf: a\nb\r\n\r\nok",  # a bare LF line
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-space : b\r\n\r\nok",  # whitespace before the colon
    b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\nok",  # one length twice
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n0\r\n\r\n",
])
async def test_what_h11_refused_in_a_head_is_still_refused(serve, answer):
    server = await serve(lambda number, index: answer, close=True)
    pool = ProfilePool()
    with trio.fail_after(5), pytest.raises(UpstreamError, match="malformed HTTP response head"):
        await fetch(pool, request(server.url))
    assert pool.opened == 0


@pytest.mark.parametrize("tail", [
    # (still arriving beyond 100 KiB: what came whole in a read or two was already held)
    b"0\r\nx-trailer: " + b"a" * (400 * 1024) + b"\r\n\r\n",  # one trailer
    b"0\r\n" + b"x: y\r\n" * 70000 + b"\r\n",  # trailers that add up
    b"3;" + b"e" * (400 * 1024) + b"\r\nabc\r\n0\r\n\r\n",  # a chunk extension
])
async def test_what_a_chunked_body_holds_besides_its_data_is_bounded_as_a_head_is(serve, tail):
    # llhttp keeps a trailer line whole in memory, and reads an extension to its end: h11 refused
    # either beyond its size limit, and so does this client (a peer may not grow a worker without end)
    server = await serve(lambda number, index: CHUNKED + b"3\r\nabc\r\n" + tail, close=True)
    pool = ProfilePool()
    with trio.fail_after(5):
        async with pool.exchange(request(server.url)) as response:
            with pytest.raises(UpstreamError, match="malformed HTTP response body"):
                async for _ in response:
                    pass
    assert pool.opened == 0
    await pool.aclose()


@pytest.mark.parametrize("answer", [
    OK_HEAD + b"content-length: 2\r\n\r\n{}",
    b"HTTP/1.1 204 No Content\r\n\r\n",
    CHUNKED + b"2\r\n{}\r\n0\r\n\r\n",
])
async def test_a_second_answer_sent_unasked_with_the_first_is_never_taken_for_any_part_of_it(serve, answer):
    # llhttp goes on parsing past the answer's end in the same read: the unasked answer's
    # status and body must not become the first's (nor its connection go back to the pool)
    unasked = b"HTTP/1.1 500 Smuggled\r\ncontent-length: 13\r\n\r\n{\"smuggled\":1}"
    server = await serve(lambda number, index: answer + unasked)
    pool = ProfilePool()
    for _ in range(2):
        status, _, body, complete = await fetch(pool, request(server.url))
        assert (status, complete) == (int(answer[9:12]), True) and b"smuggled" not in body, body
    assert server.accepted == 2 and pool.opened == 0
    await pool.aclose()


@pytest.mark.parametrize("answer", [
    json_answer() + b"HTTP/1.1 200 OK\r\n",  # bytes after the answer, unasked (the same read)
    b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok",  # HTTP/1.0 without keep-alive
])
async def test_an_answer_with_bytes_after_it_or_from_http_1_0_is_read_and_its_connection_not_reused(serve, answer):
    server = await serve(lambda number, index: answer)
    pool = ProfilePool()
    for _ in range(2):
        assert (await fetch(pool, request(server.url)))[3] is True
    assert server.accepted == 2 and pool.opened == 0
    await pool.aclose()


async def test_a_bounded_pool_gets_its_slot_back_from_every_way_an_exchange_ends(serve):
    """`[gateway] max_in_flight` bounds a profile's connections: an exchange that failed to
    connect, whose head was malformed, whose block raised, or that ended cleanly, each gives its
    slot back (else the next one would wait for ever), and only the clean one keeps its
    connection."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    refused = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    listener.close()
    malformed = await serve(lambda number, index: b"<html>no HTTP at all</html>\r\n\r\n")
    good = await serve(lambda number, index: json_answer())
    pool = ProfilePool(max_connections=1)
    with trio.fail_after(5):
        for _ in range(2):
            with pytest.raises(UpstreamError, match="could not connect"):
                await fetch(pool, request(refused))
            with pytest.raises(UpstreamError, match="malformed HTTP response head"):
                await fetch(pool, request(malformed.url))
            with pytest.raises(KeyError):
                async with pool.exchange(request(good.url)):
                    raise KeyError("the block's own error")
            assert pool.opened == 0  # (the block left its body unread: not reused)
            assert await fetch(pool, request(good.url)) == (200, {"content-type": "application/json",
                                                                   "content-length": "12"}, b'{"ok": true}', True)
            assert pool.opened == 1
    await pool.aclose()


async def test_a_refused_connection_is_an_upstream_error():
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    pool = ProfilePool()
    with pytest.raises(UpstreamError, match="could not connect"):
        await fetch(pool, request(f"http://127.0.0.1:{port}/v1"))
    assert pool.opened == 0


def compressed(coding: bytes, body: bytes) -> bytes:
    return OK_HEAD + b"content-encoding: " + coding + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize("coding, encode", [
    (b"gzip", gzip.compress),
    (b"deflate", zlib.compress),  # with its zlib wrapper, as the RFC says
    (b"deflate", lambda data: zlib.compress(data, wbits=-zlib.MAX_WBITS)),  # raw, as some servers send it
    (b"identity", lambda data: data),
])
async def test_gzip_and_deflate_bodies_are_decoded(serve, coding, encode):
    text = b'{"choices": [{"text": "' + b"a long answer " * 2000 + b'"}]}'
    server = await serve(lambda number, index: compressed(coding, encode(text)), pieces=4096)
    pool = ProfilePool()
    for _ in range(2):
        assert (await fetch(pool, request(server.url)))[2:] == (text, True)
    assert server.accepted == 1
    await pool.aclose()


async def test_a_compressed_body_is_inflated_in_bounded_pieces(serve):
    bomb = gzip.compress(b"\0" * (INFLATE_PIECE * 5 + 10))  # 5 MiB from about 5 KiB
    server = await serve(lambda number, index: compressed(b"gzip", bomb))
    pool = ProfilePool()
    async with pool.exchange(request(server.url)) as response:
        sizes = [len(piece) async for piece in response]
    assert max(sizes) <= INFLATE_PIECE and sum(sizes) == INFLATE_PIECE * 5 + 10
    await pool.aclose()


@pytest.mark.parametrize("coding", [b"br", b"zstd", b"gzip, br"])
async def test_an_encoding_not_asked_for_is_refused_by_name(serve, coding):
    server = await serve(lambda number, index: compressed(coding, b"\x8b\x00\x80garbage"))
    pool = ProfilePool()
    with pytest.raises(UnsupportedEncoding, match=coding.decode().split(", ")[-1]):
        await fetch(pool, request(server.url))
    assert pool.opened == 0


async def test_undecodable_gzip_is_an_upstream_error(serve):
    server = await serve(lambda number, index: compressed(b"gzip", b"not gzip at all"))
    pool = ProfilePool()
    with pytest.raises(UpstreamError, match="does not decode"):
        await fetch(pool, request(server.url))


TEXT = b'{"choices": [{"text": "' + b"an answer " * 300 + b'"}]}'
WRAPPED, RAW = zlib.compress(TEXT), zlib.compress(TEXT, wbits=-zlib.MAX_WBITS)


@pytest.mark.parametrize("coding, body, message", [
    # the HTTP framing is whole (content-length) but the compressed stream did not end in it:
    # part of the answer is missing, and the client must not take the part as the whole
    (b"gzip", gzip.compress(TEXT)[:-8], "cut short"),  # the member's CRC and length missing
    (b"gzip", gzip.compress(TEXT)[:40], "cut short"),
    (b"deflate", WRAPPED[:-4], "cut short"),  # the zlib wrapper's checksum missing
    (b"deflate", RAW[: len(RAW) // 2], "cut short"),
    # or it ended before the body did: what follows is refused, never dropped unread
    (b"gzip", gzip.compress(TEXT) + b"<html>more</html>", "does not decode"),
    (b"deflate", WRAPPED + b"more", "does not decode"),
    (b"deflate", RAW + b"more", "does not decode"),
], ids=["gzip-no-trailer", "gzip-half", "deflate-no-checksum", "raw-deflate-half", "gzip-then-more",
        "deflate-then-more", "raw-deflate-then-more"])
async def test_a_compressed_body_must_end_where_the_http_body_ends(serve, coding, body, message):
    server = await serve(lambda number, index: compressed(coding, body))
    pool = ProfilePool()
    with pytest.raises(UpstreamError, match=message):
        await fetch(pool, request(server.url))
    assert pool.opened == 0


async def test_raw_deflate_is_told_from_wrapped_however_its_first_bytes_are_split(serve):
    # one byte is no verdict: the raw decoder must start from the body's first byte
    server = await serve(lambda number, index: compressed(b"deflate", RAW[:40]), pieces=1)
    pool = ProfilePool()
    with pytest.raises(UpstreamError, match="cut short"):  # (a prefix: the whole is tested above)
        await fetch(pool, request(server.url))
    server = await serve(lambda number, index: compressed(b"deflate", RAW), pieces=1)
    assert (await fetch(pool, request(server.url)))[2:] == (TEXT, True)
    await pool.aclose()


@pytest.mark.parametrize("coding", [b"gzip", b"deflate"])
async def test_an_empty_body_that_names_an_encoding_is_empty_not_cut_short(serve, coding):
    server = await serve(lambda number, index: compressed(coding, b""))
    pool = ProfilePool()
    assert (await fetch(pool, request(server.url)))[2:] == (b"", True)
    await pool.aclose()


@pytest.mark.parametrize("body", [
    gzip.compress(TEXT[:500]) + gzip.compress(TEXT[500:]),  # RFC 1952: a file may hold several members
    gzip.compress(TEXT[:500]) + b"\0" * 64 + gzip.compress(TEXT[500:]) + b"\0" * 64,  # NUL padding (as gzip reads)
], ids=["two-members", "two-members-padded"])
async def test_every_member_of_a_gzip_body_is_read(serve, body):
    server = await serve(lambda number, index: compressed(b"gzip", body), pieces=100)
    pool = ProfilePool()
    for _ in range(2):
        assert (await fetch(pool, request(server.url)))[2:] == (TEXT, True)
    assert server.accepted == 1
    await pool.aclose()


async def test_tls_against_a_local_ca(nursery):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    server = RawServer(lambda number, index: json_answer(b'{"tls": true}'))
    await server.start(nursery, ssl_context=server_context)
    url = server.url.replace("http://", "https://")

    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    pool = ProfilePool(ssl_context=trusting)
    with trio.fail_after(10):
        for _ in range(2):
            assert (await fetch(pool, request(url)))[2:] == (b'{"tls": true}', True)
    assert server.accepted == 1  # reused over TLS too
    await pool.aclose()

    # the CA trust the pools use (certifi's bundle) does not know this CA: refused, not sent
    stranger = ProfilePool(ssl_context=Pools().ssl_context)
    with trio.fail_after(10), pytest.raises(UpstreamError, match="TLS handshake failed"):
        await fetch(stranger, request(url))
    assert len(server.requests) == 2


async def test_an_answer_sent_unasked_over_tls_is_never_taken_for_the_next_requests(nursery):
    """An upstream that answers twice (or writes anything after its answer): on plain TCP the
    extra bytes are seen after the body or make the idle socket readable. Over TLS they may
    already sit in the TLS layer's buffer, read from the socket with the answer's last record
    and not yet decrypted: the socket is not readable, and the connection must not be reused."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    head = OK_HEAD + b"content-length: %d\r\n\r\n"
    body = b"1" * (16384 - len(head % 10000))
    first = head % len(body) + body
    assert len(first) == 16384  # the answer fills one TLS record exactly; the extra is the next
    stale = json_answer(b'{"answer": "stale"}')
    server = RawServer(lambda number, index: first + stale if number == 1 else json_answer(b'{"answer": "fresh"}'))
    await server.start(nursery, ssl_context=server_context)
    trusting = ssl.create_default_context()
    ca.configure_trust(trusting)
    pool = ProfilePool(ssl_context=trusting)
    url = server.url.replace("http://", "https://")
    with trio.fail_after(10):
        assert (await fetch(pool, request(url)))[2] == body
        assert (await fetch(pool, request(url)))[2] == b'{"answer": "fresh"}'
    assert server.accepted == 2
    await pool.aclose()


async def test_a_proxy_in_the_environment_is_honoured_through_httpx(serve, monkeypatch):
    """httpx honoured HTTP(S)_PROXY and NO_PROXY; for a profile a proxy applies to, the pool
    keeps doing so (through httpx), and leaves NO_PROXY's hosts direct."""
    proxy = await serve(lambda number, index: json_answer(b'{"via": "proxy"}'))
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
                 "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
    pool = ProfilePool()
    status, _, body, _ = await fetch(pool, request("http://provider.invalid/v1/chat/completions"))
    assert (status, body) == (200, b'{"via": "proxy"}')
    # the proxy got the request in absolute form, as a proxy must
    assert proxy.requests[0][1].startswith(b"POST http://provider.invalid/v1/chat/completions HTTP/1.1")
    await pool.aclose()

    direct = await serve(lambda number, index: json_answer(b'{"via": "direct"}'))
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    pool = ProfilePool()
    assert (await fetch(pool, request(direct.url)))[2] == b'{"via": "direct"}'
    assert len(proxy.requests) == 1 and len(direct.requests) == 1
    await pool.aclose()


def test_the_client_choice_is_checked_by_name(monkeypatch):
    monkeypatch.setenv("RELAYLINE_UPSTREAM_CLIENT", "curl")
    with pytest.raises(ValueError, match="RELAYLINE_UPSTREAM_CLIENT"):
        pool_module.upstream_client()
    monkeypatch.setenv("RELAYLINE_UPSTREAM_CLIENT", "httpx")
    assert Pools().through_httpx


@pytest.mark.parametrize("headers, message", [
    ({"x-bad": "line\r\nx-injected: 1"}, "x-bad"),
    ({"bad name": "v"}, "bad name"),
    ({"content-length": "1"}, "content-length"),
])
async def test_a_header_that_would_break_the_request_is_refused_before_any_write(serve, headers, message):
    server = await serve(lambda number, index: json_answer())
    pool = ProfilePool()
    with pytest.raises(ValueError, match=message):
        await fetch(pool, UpstreamRequest(server.url, headers, b"{}"))
    await trio.sleep(0.01)
    assert server.requests == []


async def test_an_ip_literal_is_connected_directly_and_a_name_is_resolved(serve, nursery, monkeypatch):
    server = await serve(lambda number, index: json_answer(b'{"ok": true}'))
    resolved: list[str] = []
    open_tcp_stream = trio.open_tcp_stream

    async def counted(host, port, **kwargs):
        resolved.append(host)
        return await open_tcp_stream(host, port, **kwargs)

    monkeypatch.setattr(trio, "open_tcp_stream", counted)
    pool = ProfilePool()
    assert (await fetch(pool, request(server.url)))[2] == b'{"ok": true}'
    assert resolved == []  # 127.0.0.1: one connect(), no resolution or happy-eyeballs nursery
    named = ProfilePool()
    assert (await fetch(named, request(server.url.replace("127.0.0.1", "localhost"))))[2] == b'{"ok": true}'
    assert resolved == ["localhost"] and server.accepted == 2
    await pool.aclose()
    await named.aclose()
    try:
        listeners = await nursery.start(partial(trio.serve_tcp, server._serve, 0, host="::1"))
    except OSError:  # no IPv6 loopback on this machine
        return
    port = listeners[0].socket.getsockname()[1]
    six = ProfilePool()
    assert (await fetch(six, request(f"http://[::1]:{port}/v1/chat/completions")))[2] == b'{"ok": true}'
    assert resolved == ["localhost"]
    await six.aclose()


@pytest.mark.parametrize("headers", [
    {"a\nb": "x"},  # a line feed in a name: two lines of the head (the joined-names lever let it through)
    {"x-ok": "1", "b\nc": "2"},
    {"a\rb": "x"}, {"a b": "x"}, {"": "x"}, {"x-a": "1\r\nhost: evil"}, {"x-a": "1\nx-b: 2"}, {"x-a": "\0"},
    {"x-a": " padded"}, {"x-a": "padded\t"}, {"content-length": "5"}, {"transfer-encoding": "chunked"},
])
def test_a_header_that_would_change_the_heads_lines_or_framing_is_never_written(headers):
    """render() is the last check before bytes go upstream: a profile's or a client's header
    that is not one legal line of its own is refused, naming it."""
    with pytest.raises(ValueError, match="cannot be sent upstream"):
        render(UpstreamRequest("http://127.0.0.1:9/v1/chat/completions", headers, b"{}"))


# the head of an answer as OpenAI's API sends it: twenty-two lines, two of them set-cookie
PROVIDER_HEAD = (
    b"HTTP/1.1 200 OK\r\nDate: Mon, 30 Nov 2026 22:00:00 GMT\r\nContent-Type: application/json\r\n"
    b"Content-Length: 2\r\nConnection: keep-alive\r\naccess-control-expose-headers: X-Request-ID\r\n"
    b"openai-organization: org-abc\r\nopenai-processing-ms: 312\r\nopenai-version: 2020-10-01\r\n"
    b"x-ratelimit-limit-requests: 10000\r\nx-ratelimit-limit-tokens: 30000000\r\n"
    b"x-ratelimit-remaining-requests: 9999\r\nx-ratelimit-remaining-tokens: 29999990\r\n"
    b"x-ratelimit-reset-requests: 6ms\r\nx-ratelimit-reset-tokens: 0s\r\nx-request-id: req_0123abcDEF\r\n"
    b"set-cookie: __cf_bm=abc; path=/; HttpOnly\r\nset-cookie: _cfuvid=def; path=/\r\n"
    b"retry-after:\t 7 \t\r\nx-empty:\r\nserver: cloudflare\r\ncf-ray: 8f0000000000-AMS\r\n"
    b"alt-svc: h3=\":443\"; ma=86400\r\n\r\n{}")


@pytest.mark.parametrize("pieces", [0, 1, 13])
async def test_a_providers_head_is_read_field_by_field_however_it_is_split(serve, pieces):
    early = b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n"
    server = await serve(lambda number, index: (early if index else b"") + PROVIDER_HEAD, pieces=pieces)
    pool = ProfilePool()
    with trio.fail_after(10):
        for _ in range(2):  # the second after an informational head, on the same connection
            status, headers, body, complete = await fetch(pool, request(server.url))
            assert (status, body, complete) == (200, b"{}", True)
            assert len(headers) == 21 and "link" not in headers  # (the two set-cookie lines: the last)
            assert headers["content-length"] == "2" and headers["x-request-id"] == "req_0123abcDEF"
            assert headers["retry-after"] == "7" and headers["x-empty"] == ""
            assert headers["set-cookie"] == "_cfuvid=def; path=/" and headers["alt-svc"] == 'h3=":443"; ma=86400'
            assert headers["date"] == "Mon, 30 Nov 2026 22:00:00 GMT"
    assert server.accepted == 1
    await pool.aclose()


_TOKEN = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_FRAMING_NAMES = {"content-length", "transfer-encoding", "connection", "content-encoding", "upgrade", "keep-alive",
                  "proxy-connection"}


@pytest.mark.property
@given(fields=st.lists(st.tuples(
    st.text(_TOKEN, min_size=1, max_size=12).filter(lambda name: name.lower() not in _FRAMING_NAMES),
    st.text(" \t", max_size=2),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0xFF, blacklist_characters="\x7f"), max_size=12),
    st.sampled_from(["", " ", "a b", "\t"]),
    st.text(" \t", max_size=2)), max_size=30),
    cuts=st.lists(st.integers(min_value=1, max_value=600), max_size=4))
def test_a_heads_fields_are_those_its_lines_say_however_its_reads_are_cut(fields, cuts):
    """What llhttp accepts in a head's lines is read as RFC 9112 says: names folded, the value
    without the whitespace around it, the last of a name's lines winning, whatever the reads."""
    lines = b"".join(f"{name}:{before}{value}{inner}{value}{after}\r\n".encode("latin-1")
                     for name, before, value, inner, after in fields)
    wire = b"HTTP/1.1 200 OK\r\n" + lines + b"content-length: 2\r\n\r\nok"
    connection = Connection(None, None, -1)
    reads = [wire[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(wire)], strict=True) if a < b]
    for read in reads:
        connection._feed(read)
    expected = {name.lower(): f"{value}{inner}{value}".strip(" \t") for name, _, value, inner, _ in fields}
    expected["content-length"] = "2"
    assert connection._status == 200 and connection._done and connection._length == "2"
    assert head_fields(connection._fields) == expected
