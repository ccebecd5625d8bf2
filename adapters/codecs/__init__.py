"""Codecs: where every wire format lives. A codec reads one dialect's request body into the
canonical request (machines/wire.py), writes the canonical request as a provider family's body,
reads what the provider answered, and writes the canonical result, stream events and errors in
the client's shape. Codecs are pure: no I/O, no clocks they do not read, no state beyond one
request or one stream; the providers send and read, the gateway decides what is sent and when.

Per dialect: `openai_chat.py` / `anthropic_messages.py` (a client's request read),
`*_render.py` (the request a profile is sent, written), `*_replies.py` (a provider's reply
and stream frames read), `*_answers.py` (what a client is given); `dialects.py` the dialect
objects the gateway routes to; `shape.py` the checks every body and reply is read with;
`common.py` what they share.
"""
