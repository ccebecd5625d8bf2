"""Codecs: where dialect translation lives. A codec reads one client dialect's request body into
the canonical request (machines/wire.py) and renders the canonical result, stream events and
errors back in that dialect's shape. Codecs are pure: no I/O, no clocks they do not read, no
state beyond one request or one stream; the gateway decides what is sent and when.
"""
