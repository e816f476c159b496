"""`rl-core serve` beyond its documented routes and at its default size: an unknown route or
a wrong method answers the documented error shape (`{"error": {message, type, param, code}}`,
never FastAPI's `{"detail": ...}`), and an IPv6 server prints and writes its address in
brackets (served on ::1 where the host can bind it). The default size is in test_kv_sizing.py."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from rl_core.launch import serve as serve_mod
from rl_core.launch.cli import build_parser

from tests.helpers.serving import make_model_dir, running_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def client(model_dir):
    from fastapi.testclient import TestClient

    args = build_parser().parse_args(["serve", str(model_dir), "--max-seq-len", "64"])
    with TestClient(serve_mod.build_app(args, "tok"), raise_server_exceptions=False) as c:
        yield c


def _shape(r, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == code, body
    return body["error"]


@pytest.mark.parametrize("method, path", [("GET", "/nope"), ("POST", "/v1/nope"), ("GET", "/v1/completions/x"),
                                          ("DELETE", "/rl/nope")])
def test_unknown_routes_answer_the_documented_error_shape(client, method, path):
    err = _shape(client.request(method, path, headers={"Authorization": "Bearer tok"}), 404, "not_found")
    assert path in err["message"]
    # without the token too: an unknown route is not a route, so no 401 and no detail
    _shape(client.request(method, path), 404, "not_found")


def test_a_wrong_method_answers_405_in_the_error_shape_with_allow(client):
    r = client.get("/v1/completions", headers={"Authorization": "Bearer tok"})
    err = _shape(r, 405, "method_not_allowed")
    assert "GET" in err["message"] and "/v1/completions" in err["message"]
    assert r.headers["allow"] == "POST"
    assert client.get("/rl/metrics", headers={"Authorization": "Bearer tok"}).json()["server_client_errors"] >= 1


def test_http_urls_bracket_ipv6_addresses():
    assert serve_mod.http_url("::1", 8000) == "http://[::1]:8000"
    assert serve_mod.http_url("fe80::1%eth0", 80) == "http://[fe80::1%eth0]:80"
    assert serve_mod.http_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert serve_mod.http_url("localhost", 1) == "http://localhost:1"


def _ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host cannot bind the IPv6 loopback ::1")
def test_an_ipv6_server_prints_and_serves_its_bracketed_address(model_dir, tmp_path):
    with running_server(model_dir, tmp_path / "srv", "--host", "::1") as (url, proc):
        assert url.startswith("http://[::1]:"), url
        with urllib.request.urlopen(f"{url}/health", timeout=30) as r:
            assert json.loads(r.read())["status"] == "ok"
    log = next((tmp_path / "srv").glob("*.log")).read_text()
    assert f"on {url} " in log, log
