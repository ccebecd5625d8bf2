"""Gateway authentication at the edges: a gateway without client keys never listens where other
machines reach it unless its config says it is open on purpose, `check` says so, and a request
carrying two credentials is refused before either is read. Real `relayline serve` processes and
raw sockets."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from fleet import ServeProcess

from helpers import raw_post, sim_toml
from relayline.adapters.sim.background import BackgroundGateway
from relayline.machines.config import parse_config

CLI = [sys.executable, "-m", "relayline.adapters.cli"]
NOT_LOOPBACK = "0.0.0.0"  # every address of the machine: what `serve` must refuse to bind without keys
KEYLESS = sim_toml("m")


def _run(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_without_client_keys_refuses_an_address_beyond_loopback(tmp_path, workers):
    config = tmp_path / "keyless.toml"
    config.write_text(KEYLESS)
    out = _run("serve", "--config", config, "--host", NOT_LOOPBACK, "--port", "0", "--workers", workers)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "api_keys_env" in lines[0] and "not a loopback address" in lines[0], out.stderr


def test_serve_without_config_refuses_an_address_beyond_loopback():
    out = _run("serve", "--host", NOT_LOOPBACK, "--port", "0")
    assert out.returncode == 2 and "api_keys_env" in out.stderr.splitlines()[-1], out.stderr


def test_only_a_keyless_gateway_not_open_on_purpose_is_kept_to_loopback():
    from relayline.adapters.gateway.auth import bind_refusal

    keyless = parse_config(KEYLESS)
    assert bind_refusal(keyless, "0.0.0.0") is not None and bind_refusal(keyless, "::") is not None
    assert bind_refusal(keyless, "127.0.0.1") is None and bind_refusal(keyless, "localhost") is None
    assert bind_refusal(keyless, "::1") is None
    assert bind_refusal(parse_config(sim_toml("m", gateway={"auth": "none"})), "0.0.0.0") is None
    assert bind_refusal(parse_config(sim_toml("m", gateway={"api_keys_env": "K"})), "0.0.0.0") is None


def test_auth_none_beside_client_keys_is_a_config_error(tmp_path):
    config = tmp_path / "both.toml"
    config.write_text(sim_toml("m", gateway={"auth": "none", "api_keys_env": "K"}))
    out = _run("check", config)
    assert out.returncode == 1 and 'gateway.auth: "none"' in out.stderr


def test_check_warns_of_a_gateway_without_client_keys(tmp_path):
    config = tmp_path / "keyless.toml"
    config.write_text(KEYLESS)
    out = _run("check", config)
    assert out.returncode == 0 and "warning: no_client_keys at gateway.api_keys_env" in out.stdout, out.stdout
    config.write_text(sim_toml("m", gateway={"auth": "none"}))
    out = _run("check", config)
    assert out.returncode == 0 and "no_client_keys" not in out.stdout and out.stdout.rstrip().endswith("0 warnings")


@pytest.fixture(scope="module")
def gateway():
    config = {"active": "s", "providers": {"s": {"family": "sim", "model": "m"}}}
    with BackgroundGateway(config, api_keys={"key-1", "key-2"}) as gw:
        yield gw


BODY = b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}'


def _raw(gw, path: str, headers: list[tuple[str, str]]) -> bytes:
    return raw_post(gw.url, path, BODY, headers)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.parametrize("name,value", [("authorization", "Bearer key-{}"), ("x-api-key", "key-{}")])
def test_two_credential_headers_in_one_request_are_a_400(gateway, path, name, value):
    """Two keys, each valid: which one the request is billed to is no guess to make (a proxy in
    front may read the other one). Before, the last one won."""
    answer = _raw(gateway, path, [(name, value.format(1)), (name, value.format(2))])
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert f"more than one {name} header".encode() in answer
    assert (b'"type":"error"' in answer.replace(b" ", b"")) == (path == "/v1/messages")  # the route's dialect
    one = _raw(gateway, path, [(name, value.format(1))])
    assert one.startswith(b"HTTP/1.1 200"), one[:300]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_reload_never_makes_a_gateway_keyless_where_it_listens_beyond_loopback(tmp_path, workers):
    """An open gateway (auth = "none") on every address, reloaded to a file that leaves auth at
    "keys" and names no keys: such a file means loopback only, which serve enforces only where it
    binds. The reload was taken and the gateway served on, keyless, on every address."""
    config = tmp_path / "open.toml"
    config.write_text(sim_toml("m", gateway={"auth": "none"}))
    with ServeProcess(config, "--host", NOT_LOOPBACK, "--workers", workers) as gateway:
        url = "http://127.0.0.1:" + gateway.url.rsplit(":", 1)[1]  # (our own traffic stays on loopback)
        if workers == "2":
            deadline = time.monotonic() + 20
            while gateway.stderr.count("listening on") < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
        config.write_text(KEYLESS)
        refused = httpx.post(f"{url}/admin/reload", timeout=30)
        assert refused.status_code == 422, refused.text
        assert refused.json()["problems"][0].startswith("gateway.api_keys_env: this file names no client keys")
        config.write_text(sim_toml("m2", gateway={"auth": "none"}))
        assert httpx.post(f"{url}/admin/reload", timeout=30).status_code == 200  # (open on purpose: taken)
