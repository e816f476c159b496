"""Bad inputs of `rl-core serve`, as a table: each command line exits 2 with one paragraph
naming the flag or file (no traceback) before anything is built or bound; each HTTP body is
a 4xx JSON error naming the field (`param`) before anything reaches the engine. The
control routes are off on a default server and need the launch's secret on a managed one;
a truncated weight file is a 400 naming the file, an unexpected failure a JSON 500; the
error counters separate 4xx from 5xx.

The HTTP cases run against the real app (real engine on a tiny model) in-process through
Starlette's TestClient; one CLI case also runs as a real subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from tests.helpers.serving import ROOT, make_model_dir

from rl_core.launch import serve as serve_mod
from rl_core.launch.cli import build_parser, main

pytestmark = pytest.mark.timeout(300)
SECRET = "bad-inputs-control-secret-42"
CONTROL_ROUTES = [("/rl/update_weights", {"version": 1, "path": "/nonexistent"}),
                  ("/rl/init_weight_broadcast", {"host": "127.0.0.1", "port": 1, "rank": 1, "world_size": 2}),
                  ("/rl/receive_weights", {"version": 1}), ("/rl/abort", {"all": True}),
                  ("/rl/invalidate_kv_cache", None)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model") / "tiny")


# ---------------------------------------------------------------------- the command line


def _truncate(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garbage(d):
    (d / "model.safetensors").write_bytes(os.urandom(4096))


def _empty(d):
    (d / "model.safetensors").write_bytes(b"")


def _header_lies(d):  # a header announcing more bytes than the file holds
    (d / "model.safetensors").write_bytes((10**6).to_bytes(8, "little") + b"{}")


def _config(text):
    return lambda d: (d / "config.json").write_text(text)


def _no_tokenizer(d):
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"):
        (d / name).unlink(missing_ok=True)


def _secret_file(mode):
    def make(d):
        path = d / "secret"
        path.write_text("x" * 32)
        path.chmod(mode)
    return make


CLI_CASES = [
    # (id, damage to a copy of the model dir, extra argv, env, what the message must name)
    ("port-70000", None, ["--port", "70000"], {}, "--port got 70000"),
    ("port-minus-1", None, ["--port", "-1"], {}, "--port got -1"),
    ("max-seq-len-0", None, ["--max-seq-len", "0"], {}, "--max-seq-len got 0"),
    ("max-seq-len-negative", None, ["--max-seq-len", "-8"], {}, "--max-seq-len got -8"),
    ("max-batch-size-0", None, ["--max-batch-size", "0"], {}, "--max-batch-size got 0"),
    ("max-num-kv-tokens-0", None, ["--max-num-kv-tokens", "0"], {}, "--max-num-kv-tokens got 0"),
    ("max-choices-0", None, ["--max-choices-per-request", "0"], {}, "--max-choices-per-request got 0"),
    ("weight-version-negative", None, ["--weight-version", "-1"], {}, "--weight-version got -1"),
    ("kv-scale-margin-0", None, ["--kv-scale-margin", "0"], {}, "--kv-scale-margin got 0"),
    ("seed-2-70", None, ["--seed", str(2**70)], {}, f"--seed got {2**70}; expected an integer in 0..2^64 - 1"),
    ("seed-negative", None, ["--seed", "-1"], {}, "--seed got -1"),
    ("truncated-safetensors", _truncate, [], {}, "model.safetensors"),
    ("garbage-safetensors", _garbage, [], {}, "model.safetensors"),
    ("empty-safetensors", _empty, [], {}, "model.safetensors"),
    ("safetensors-header-lies", _header_lies, [], {}, "model.safetensors"),
    ("config-not-json", _config("{not json"), [], {}, "config.json is not valid JSON"),
    ("config-a-list", _config("[1, 2]"), [], {}, "config.json is not an HF model config"),
    ("config-without-model-type", _config('{"hidden_size": 4}'), [], {}, "model_type"),
    ("config-missing", lambda d: (d / "config.json").unlink(), [], {}, "config.json"),
    ("no-tokenizer-files", _no_tokenizer, [], {}, "no tokenizer files"),
    ("managed-without-secret", None, ["--managed"], {}, "RL_CORE_CONTROL_SECRET holds 0"),
    ("managed-short-secret", None, ["--managed"], {"RL_CORE_CONTROL_SECRET": "short"}, "at least 16 characters"),
    ("secret-file-world-readable", _secret_file(0o644), ["--managed", "--control-secret-file", "{dir}/secret"], {},
     "mode 0644"),
    ("secret-file-missing", None, ["--managed", "--control-secret-file", "{dir}/nope"], {}, "cannot be read"),
    ("secret-file-without-managed", _secret_file(0o600), ["--control-secret-file", "{dir}/secret"], {},
     "without --managed"),
]


@pytest.mark.parametrize("damage, argv, env, named", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_serve_command_line_refuses_with_one_paragraph(model_dir, tmp_path, monkeypatch, capsys, damage, argv, env,
                                                       named):
    work = tmp_path / "m"
    shutil.copytree(model_dir, work)
    if damage is not None:
        damage(work)
    monkeypatch.delenv("RL_CORE_CONTROL_SECRET", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def never(*a, **k):
        raise AssertionError("built or bound before the check")

    monkeypatch.setattr(serve_mod, "build_app", never)
    monkeypatch.setattr(serve_mod, "bind_socket", never)
    code = main(["serve", str(work), "--port", "0", *[a.replace("{dir}", str(work)) for a in argv]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert named in err, err
    assert "Traceback" not in err and err.count("\n") == 1 and "Fix:" in err  # one paragraph with the fix


def test_bad_port_in_a_real_process_exits_2_without_traceback(model_dir):
    done = subprocess.run([sys.executable, "-m", "rl_core.launch.cli", "serve", str(model_dir), "--port", "70000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--port got 70000" in done.stderr and "Traceback" not in done.stderr


# ---------------------------------------------------------------------- HTTP


def _app(model_dir, *flags, secret=None):
    from fastapi.testclient import TestClient

    args = build_parser().parse_args(["serve", str(model_dir), "--max-batch-size", "4", "--max-seq-len", "64",
                                      "--max-choices-per-request", "16", *flags])
    return TestClient(serve_mod.build_app(args, None, secret), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(model_dir):
    with _app(model_dir) as c:
        yield c


@pytest.fixture(scope="module")
def managed(model_dir):
    with _app(model_dir, "--managed", secret=SECRET) as c:
        yield c


CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
P = '"prompt": [5, 6, 7]'
MSG = '"messages": [{"role": "user", "content": "hi"}]'
HTTP_CASES = [
    # (id, route, raw body, expected status, expected param, words the message must hold)
    ("temperature-infinity", CMPL, '{%s, "temperature": Infinity}' % P, 400, "temperature", "finite"),
    ("temperature-nan", CMPL, '{%s, "temperature": NaN}' % P, 400, "temperature", "finite"),
    ("temperature-1e308", CMPL, '{%s, "temperature": 1e308}' % P, 400, "temperature", "less than or equal to 10"),
    ("temperature-negative", CMPL, '{%s, "temperature": -0.5}' % P, 400, "temperature", "greater than or equal"),
    ("temperature-wrong-type", CMPL, '{%s, "temperature": "hot"}' % P, 400, "temperature", "number"),
    ("top-p-zero", CMPL, '{%s, "top_p": 0}' % P, 400, "top_p", "greater than 0"),
    ("top-p-above-1", CMPL, '{%s, "top_p": 1.5}' % P, 400, "top_p", "less than or equal to 1"),
    ("top-p-nan", CMPL, '{%s, "top_p": NaN}' % P, 400, "top_p", "finite"),
    ("top-k-negative", CMPL, '{%s, "top_k": -5}' % P, 400, "top_k", "greater than or equal"),
    ("max-tokens-0", CMPL, '{%s, "max_tokens": 0}' % P, 400, "max_tokens", "greater than or equal to 1"),
    ("max-tokens-negative", CMPL, '{%s, "max_tokens": -3}' % P, 400, "max_tokens", "greater than or equal to 1"),
    ("max-tokens-above-context", CMPL, '{%s, "max_tokens": 100000}' % P, 400, "max_tokens", "context is 64"),
    ("chat-max-completion-tokens-above-context", CHAT, '{%s, "max_completion_tokens": 65}' % MSG, 400,
     "max_completion_tokens", "context is 64"),
    ("stop-token-ids-above-vocab", CMPL, '{%s, "stop_token_ids": [1000000]}' % P, 400, "stop_token_ids",
     "vocabulary"),
    ("stop-token-ids-negative", CMPL, '{%s, "stop_token_ids": [-1]}' % P, 400, "stop_token_ids", "vocabulary"),
    ("prompt-ids-above-vocab", CMPL, '{"prompt": [1000000]}', 400, "prompt", "vocabulary"),
    ("role-bogus", CHAT, '{"messages": [{"role": "bogus", "content": "hi"}]}', 400, "messages.0.role", "'user'"),
    ("seed-2-70", CMPL, '{%s, "seed": %d}' % (P, 2**70), 400, "seed", "less than or equal"),
    ("seed-negative", CMPL, '{%s, "seed": -1}' % P, 400, "seed", "greater than or equal"),
    ("seeds-not-one-per-choice", CMPL, '{%s, "n": 3, "seeds": [1, 2]}' % P, 400, "seeds", "one per choice"),
    ("seeds-and-seed", CMPL, '{%s, "seeds": [1], "seed": 2}' % P, 400, "seeds", "not both"),
    ("token-arrays-with-stream", CMPL, '{%s, "return_token_arrays": true, "stream": true}' % P, 400,
     "return_token_arrays", "stream"),
    ("token-arrays-with-top-logprobs", CMPL, '{%s, "return_token_arrays": true, "logprobs": 2}' % P, 400,
     "return_token_arrays", "send logprobs 0"),
    ("seeds-negative", CMPL, '{%s, "n": 2, "seeds": [1, -1]}' % P, 400, "seeds.1", "greater than or equal"),
    ("malformed-json", CMPL, '{"prompt": [5, 6', 400, None, "not valid JSON"),
    ("body-not-an-object", CMPL, '[1, 2]', 400, None, "invalid request"),
    ("prompts-times-n-above-cap", CMPL, '{"prompt": [[5], [6], [7]], "n": 6}', 400, "n",
     "--max-choices-per-request"),
    ("n-zero", CMPL, '{%s, "n": 0}' % P, 400, "n", "greater than or equal to 1"),
    ("n-wrong-type", CMPL, '{%s, "n": "two"}' % P, 400, "n", "integer"),
    ("prompt-wrong-type", CMPL, '{"prompt": 5}', 400, "prompt", "invalid request"),
    ("prompt-missing", CMPL, '{"max_tokens": 2}', 400, "prompt", "Field required"),
    ("unknown-field", CMPL, '{%s, "foo": 1}' % P, 400, "foo", "unknown field"),
    ("logit-bias-refused", CMPL, '{%s, "logit_bias": {"5": 1.0}}' % P, 400, "logit_bias", "not supported"),
    ("presence-penalty-refused", CMPL, '{%s, "presence_penalty": 0.5}' % P, 400, "presence_penalty",
     "not supported"),
    ("tools-refused", CHAT, '{%s, "tools": [{"type": "function"}]}' % MSG, 400, "tools", "not supported"),
    ("response-format-refused", CHAT, '{%s, "response_format": {"type": "json_object"}}' % MSG, 400,
     "response_format", "not supported"),
    ("messages-empty", CHAT, '{"messages": []}', 400, "messages", "at least 1"),
    ("model-unknown", CMPL, '{%s, "model": "gpt-99"}' % P, 404, "model", "not served here"),
    # issue 49: each refused before the tokenizer or the engine sees it
    ("prompt-ids-negative", CMPL, '{"prompt": [-1, 5]}', 400, "prompt", "[-1] outside [0,"),
    ("prompt-empty-text", CMPL, '{"prompt": ""}', 400, "prompt", "zero tokens"),
    ("prompt-ids-over-context", CMPL, '{"prompt": [%s]}' % ", ".join(["5"] * 64), 400, "prompt", "context is 64"),
    ("prompt-text-over-context", CMPL, '{"prompt": "%s"}' % ("ab " * 2000), 400, "prompt", "characters"),
    ("chat-5000-messages", CHAT, '{"messages": [%s]}' % ", ".join(['{"role": "user", "content": "hi"}'] * 5000),
     400, "messages", "at most 64"),
    ("chat-20mb-message", CHAT, '{"messages": [{"role": "user", "content": "%s"}]}' % ("x" * 20 * 2**20), 400,
     "messages.0.content", "characters"),
]


@pytest.mark.parametrize("route, body, status, param, words", [c[1:] for c in HTTP_CASES],
                         ids=[c[0] for c in HTTP_CASES])
def test_bad_http_bodies_are_4xx_naming_the_field(client, route, body, status, param, words):
    r = client.post(route, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert words in err["message"], err
    assert err["type"] in ("invalid_request_error",)


def test_harmless_openai_fields_are_accepted(client):
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "user": "u1", "metadata": {"k": "v"}, "store": False,
            "service_tier": "auto", "seed": 2**63 - 1, "n": 2, "temperature": 10}
    r = client.post(CMPL, json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    chat = {"messages": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
            "max_completion_tokens": 2, "parallel_tool_calls": False, "tool_choice": "none",
            "response_format": {"type": "text"}}
    assert client.post(CHAT, json=chat).status_code == 200


# ---------------------------------------------------------------------- control routes


@pytest.mark.parametrize("route, body", CONTROL_ROUTES, ids=[r for r, _ in CONTROL_ROUTES])
def test_a_default_server_refuses_the_control_routes(client, route, body):
    r = client.post(route, json=body, headers={"X-RL-Core-Secret": SECRET})  # a secret does not open them
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert "--managed" in err["message"] and err["code"] == "control_routes_disabled"
    assert client.get("/rl/weight_version").json() == {"weight_version": 0}  # read-only routes stay


@pytest.mark.parametrize("route, body", CONTROL_ROUTES, ids=[r for r, _ in CONTROL_ROUTES])
@pytest.mark.parametrize("sent", [None, "wrong-secret-of-some-length", SECRET[:-1], SECRET + "x", ""])
def test_a_managed_server_needs_its_secret(managed, route, body, sent):
    headers = {} if sent is None else {"X-RL-Core-Secret": sent}
    r = managed.post(route, json=body, headers=headers)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_control_secret" and "X-RL-Core-Secret" in r.json()["error"]["message"]


def test_a_managed_server_obeys_its_secret(managed):
    ok = {"X-RL-Core-Secret": SECRET}
    assert managed.post("/rl/abort", json={"all": True}, headers=ok).json() == {"aborted": 0}
    assert managed.post("/rl/invalidate_kv_cache", headers=ok).json() == {"ok": True}


def _weights(model_dir, tmp_path, damage):
    d = tmp_path / "w"
    d.mkdir()
    shutil.copy(model_dir / "model.safetensors", d / "model.safetensors")
    damage(d)
    return d


@pytest.mark.parametrize("damage, words", [(_truncate, "truncated"), (_garbage, "not"), (_empty, "too short")],
                         ids=["truncated", "garbage", "empty"])
def test_update_weights_with_a_damaged_file_is_400_naming_it(managed, model_dir, tmp_path, damage, words):
    d = _weights(model_dir, tmp_path, damage)
    r = managed.post("/rl/update_weights", json={"version": 1, "path": str(d), "require_marker": False},
                     headers={"X-RL-Core-Secret": SECRET})
    assert r.status_code == 400, r.text  # a data error: HttpBackend does not retry it as infrastructure
    err = r.json()["error"]
    assert err["param"] == "path" and str(d / "model.safetensors") in err["message"] and words in err["message"]
    assert managed.get("/rl/weight_version").json() == {"weight_version": 0}


def test_a_broadcast_naming_a_tensor_the_model_lacks_is_400_naming_it(model_dir):
    """A real 2-rank gloo group: rank 0 broadcasts a state dict with a tensor this model does not
    have; the managed server's receive is a 400 naming it, and the weights stay as they were."""
    import threading

    import torch

    from rl_core.weights.broadcast import BroadcastGroup, WeightBroadcaster
    from tests.helpers.trainers import free_port

    port = free_port()

    def trainer():
        group = BroadcastGroup.create("127.0.0.1", port, 0, 2, timeout_s=60)
        WeightBroadcaster(group).send(1, {"model.bogus_layer.weight": torch.zeros(4, 4)})

    sender = threading.Thread(target=trainer)
    sender.start()
    with _app(model_dir, "--managed", secret=SECRET) as c:
        ok = {"X-RL-Core-Secret": SECRET}
        r = c.post("/rl/init_weight_broadcast", json={"host": "127.0.0.1", "port": port, "rank": 1, "world_size": 2,
                                                      "timeout_s": 60}, headers=ok)
        assert r.status_code == 200, r.text
        r = c.post("/rl/receive_weights", json={"version": 1}, headers=ok)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "model.bogus_layer.weight" in err["message"] and err["type"] == "invalid_request_error", err
        assert c.get("/rl/weight_version").json() == {"weight_version": 0}
    sender.join(60)


def test_error_counters_separate_client_and_server_errors(model_dir, tmp_path, monkeypatch):
    with _app(model_dir, "--managed", secret=SECRET) as c:
        before = c.get("/rl/metrics").json()
        assert before["server_client_errors"] == 0 and before["server_server_errors"] == 0
        for case in HTTP_CASES[:3]:
            assert c.post(case[1], content=case[2], headers={"Content-Type": "application/json"}).status_code == 400
        assert c.post("/rl/abort", json={"all": True}).status_code == 401

        async def broken(version, weights):  # a fault inside the engine: an unexpected server-side failure
            raise RuntimeError("device lost")

        monkeypatch.setattr(c.app.state.server.backend, "update_weights", broken)
        r = c.post("/rl/update_weights", json={"version": 1, "path": str(model_dir), "require_marker": False},
                   headers={"X-RL-Core-Secret": SECRET})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"  # JSON, not plain text
        assert "device lost" in r.json()["error"]["message"]
        after = c.get("/rl/metrics").json()
    assert after["server_client_errors"] == 4 and after["server_server_errors"] == 1
    assert "server_errors" not in after


def test_local_servers_are_launched_managed_with_a_fresh_secret_outside_argv(tmp_path, monkeypatch):
    from rl_core.generation.http import servers as http_servers

    launched = []

    class _Popen:  # records what would be started: the command line and the environment
        def __init__(self, cmd, env, **kw):
            launched.append((cmd, env))

    monkeypatch.setattr(http_servers.subprocess, "Popen", _Popen)
    server = http_servers.LocalServer(0, tmp_path, http_servers.EngineArgs(), "tok", tmp_path / "logs", "m")
    secrets_seen = []
    for _ in range(2):
        server.launch()
        cmd, env = launched[-1]
        secret = env[http_servers.CONTROL_SECRET_ENV]
        assert server.control_secret == secret and len(secret) >= 32
        assert "--managed" in cmd and not any(secret in part for part in cmd)
        assert secret not in (tmp_path / "logs" / "server0.log").read_text()
        secrets_seen.append(secret)
    assert secrets_seen[0] != secrets_seen[1]  # a relaunch gets a new secret


def test_the_server_removes_the_secret_from_its_environment(monkeypatch):
    monkeypatch.setenv("RL_CORE_CONTROL_SECRET", "s" * 20)
    args = build_parser().parse_args(["serve", "x", "--managed"])
    assert serve_mod.read_control_secret(args) == "s" * 20
    assert "RL_CORE_CONTROL_SECRET" not in os.environ
