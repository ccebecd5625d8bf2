"""The gateway's HTTP/1.1 server: llhttp (httptools) on trio, one task per connection, nothing in
between.

hypercorn's trio worker put several hand-offs and its own event plumbing between the socket and
the app, and cost more per request than the whole turn (bench/run.py, "server floor"). This
server keeps what the gateway relied on hypercorn for, and more (tests/http/test_http11.py, and
tests/http/test_http11_attack.py with docs/http-server.md for the attacks):

- a request head must be complete within `keep_alive_s`, which is also how long an idle
  keep-alive connection is kept (one bound, closed without an answer, as hypercorn and nginx do;
  one watchdog task for all connections, `Server._watch_heads`, not a timer per request);
- a head still arriving beyond `max_header_bytes` is a 431, a malformed request a 400 (llhttp's
  verdict), and the connection is closed after either;
- keep-alive, HTTP/1.0 and `connection: close` follow h11's rules (HTTP/1.0 is never kept alive);
  pipelined requests are answered one at
  a time, in order, and what a client sends ahead while a request runs is buffered only up to
  `READ_AHEAD` bytes;
- a client that goes away is an `http.disconnect` from `receive()` (the gateway cancels the turn);
  a write to it is dropped, never an exception in the app. Where epoll is, an app may instead
  ask to be called when the client hangs up (`scope["extensions"]["relayline.hangup"]`, see
  `Hangups`), and keep no task waiting in `receive()`;
- an app may ask whether a request's whole body has arrived (`relayline.body_here`: then the
  next `receive()` answers all of it at once), and bound only a body still arriving in time
  (the gateway's `body_timeout_s` timer is set only then);
- `Expect: 100-continue` is answered when the app first reads the body;
- what could desynchronise this server from a proxy in front of it is refused and the connection
  closed: a request with both Content-Length and Transfer-Encoding (400, RFC 9112 6.3), an HTTP
  version other than 1.x (505); llhttp, strict, refuses the rest (conflicting or repeated
  lengths, a transfer coding other than chunked, malformed chunks), and `Reader` what llhttp
  would read and h11 refused (a missing or repeated Host, an Upgrade or CONNECT with a body);
- out of file descriptors, the connections that have waited longest for a request head are
  closed to make room for new clients (`server.py`'s listener);
- a write that makes no progress for `send_timeout_s` ends the connection (a client that stops
  reading holds neither a turn nor its buffers for ever: nginx's send_timeout);
- the drain: on `stop`, no new connection is accepted, idle ones are closed, requests in flight
  finish (their answers say `connection: close`), and after `graceful_s` what is left is
  cancelled.

A body in one message gets a content-length (one write, no chunked framing); a streamed body is
chunked. The ASGI surface is the subset the gateway uses: `http` scopes, no lifespan.

The package, one module a part: the request side of a connection (reader.py: llhttp's events),
one connection's requests handed to the app (connection.py), its answers framed and written
(answer.py), the hang-up watch (hangups.py), and the server that accepts, watches and drains
connections (server.py). A response head is rendered by
the HTTP/1 rules the upstream client shares (adapters/codecs/http1.py).
"""

from .answer import Message
from .connection import READ_AHEAD, READ_SIZE, App, Receive, Scope, Send
from .server import ErrorBody, Server, listening_sockets, url_of

__all__ = [
    "READ_AHEAD", "READ_SIZE", "App", "ErrorBody", "Message", "Receive", "Scope", "Send", "Server",
    "listening_sockets", "url_of",
]
