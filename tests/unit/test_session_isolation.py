"""Issue 49, findings 1 and 2: episode sessions are isolated and checked as `rl-core serve` checks.

A real session server on loopback over the real native engine (a tiny Qwen2 model, context
64), driven by the `openai` client and raw HTTP:
- every session has its own key and a 128-bit id; a call with another live episode's key is
  401, a call to an ended episode 404, and neither reaches the engine nor touches the victim's
  recorded turns (finding 1);
- each bad body gets the same 4xx (status, `param`, `code`) from the session server as from
  `rl-core serve` (same model, same context), before the engine sees anything (a body over
  32 MiB is 413, chunked or not), and a 20 MB message or 5,000 messages never block the
  event loop for a second (finding 2).
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from rl_core.generation.native.backend import NativeBackend
from rl_core.generation.native.options import EngineOptions
from rl_core.launch import serve as serve_mod
from rl_core.launch.cli import build_parser
from rl_core.rollout.session_server import SessionServer
from rl_core.rollout.sessions import SessionRegistry
from rl_core.types import SamplingParams
from tests.helpers.serving import make_model_dir

pytestmark = pytest.mark.timeout(300)
CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model") / "tiny")


class Counted:
    """The engine behind the sessions, counting the generations that reached it."""

    def __init__(self, backend: NativeBackend):
        self.backend, self.requests = backend, []

    async def generate(self, request):
        self.requests.append(request.request_id)
        return await self.backend.generate(request)


async def _serving(model_dir):
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    backend = NativeBackend.from_pretrained(model_dir, EngineOptions(max_batch_size=4, max_seq_len=CONTEXT))
    await backend.start()
    registry = SessionRegistry()
    server = SessionServer(registry, tok, backend=backend)
    await server.start()
    engine = Counted(backend)

    def open_session(name):
        return registry.open(name, SamplingParams(max_tokens=4, seed=1), tok, engine.generate, seed_for=lambda k: k)

    return tok, backend, registry, server, engine, open_session


def test_an_episode_cannot_call_into_another_and_ended_episodes_are_refused(model_dir):
    async def main():
        tok, backend, registry, server, engine, open_session = await _serving(model_dir)
        try:
            victim, other = open_session("g0/a0"), open_session("g0/a1")
            for s in (victim, other):  # 128 random bits in the id, 256 in the key
                assert re.fullmatch(r"e\d+-[0-9a-f]{32}", s.session_id) and len(s.api_key) >= 43
            assert victim.api_key != other.api_key
            mine = openai.AsyncOpenAI(base_url=server.base_url(victim), api_key=victim.api_key, max_retries=0)
            msgs = [{"role": "user", "content": "hello"}]
            await mine.chat.completions.create(model="policy", messages=msgs)
            before = [(t.prompt_ids, t.completion_ids, t.logprobs) for t in victim.turns]
            calls = list(engine.requests)

            # the other episode's agent (or a service given both ids) calls the victim's session
            intruder = openai.AsyncOpenAI(base_url=server.base_url(victim), api_key=other.api_key, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="own key"):
                await intruder.chat.completions.create(model="policy", messages=msgs)
            with pytest.raises(openai.AuthenticationError):
                await intruder.completions.create(model="policy", prompt=[5, 6, 7])
            async with httpx.AsyncClient() as raw:
                r = await raw.post(f"{server.base_url(victim)}/completions", json={"prompt": [5, 6]})
                assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
                # a malformed body from an intruder learns nothing either: the key is checked first
                r = await raw.post(f"{server.base_url(victim)}/completions", content=b"{",
                                   headers={"Authorization": f"Bearer {other.api_key}",
                                            "Content-Type": "application/json"})
                assert r.status_code == 401, r.text
            assert engine.requests == calls  # nothing reached the engine
            assert [(t.prompt_ids, t.completion_ids, t.logprobs) for t in victim.turns] == before
            traj = victim.trajectory()
            assert traj.turns == 1 and traj.prompt_ids == before[0][0]
            assert not other.turns

            # the episode ended (its agent returned): a late call, or a client kept for the next episode
            await server.close(victim)
            with pytest.raises(openai.NotFoundError, match="not open"):
                await mine.chat.completions.create(model="policy", messages=msgs)
            with pytest.raises(openai.NotFoundError):
                await mine.completions.create(model="policy", prompt=[5, 6, 7])
            next_episode = open_session("g1/a0")  # a cached client cannot reach the next episode either
            stale = openai.AsyncOpenAI(base_url=server.base_url(next_episode), api_key=victim.api_key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await stale.chat.completions.create(model="policy", messages=msgs)
            assert engine.requests == calls and not next_episode.turns
        finally:
            await server.stop()
            await backend.shutdown()

    asyncio.run(main())


BIG = "x" * (20 * 2**20)
CASES = [
    # (id, route, raw body); expected: what rl-core serve answers
    ("prompt-id-above-vocab", "completions", json.dumps({"prompt": [99999]})),
    ("prompt-ids-negative", "completions", json.dumps({"prompt": [-1, 5]})),
    ("prompt-empty-text", "completions", json.dumps({"prompt": ""})),
    ("prompt-ids-over-context", "completions", json.dumps({"prompt": [5] * CONTEXT})),
    ("prompt-text-over-context", "completions", json.dumps({"prompt": "ab " * 2000})),
    ("max-tokens-over-context", "completions", json.dumps({"prompt": [5], "max_tokens": CONTEXT + 1})),
    ("stop-empty-string", "completions", json.dumps({"prompt": [5], "stop": [""]})),
    ("5000-messages", "chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}] * 5000})),
    ("20mb-message", "chat/completions", json.dumps({"messages": [{"role": "user", "content": BIG}]})),
    ("malformed-json", "completions", '{"prompt": [5, 6'),
    ("unknown-field", "completions", json.dumps({"prompt": [5], "foo": 1})),
    ("role-bogus", "chat/completions", json.dumps({"messages": [{"role": "bogus", "content": "hi"}]})),
    ("body-over-32-mib", "completions", json.dumps({"prompt": "y" * (33 * 2**20)})),
]


def _serve_answers(model_dir) -> dict:
    from fastapi.testclient import TestClient

    args = build_parser().parse_args(["serve", str(model_dir), "--max-batch-size", "4", "--max-seq-len",
                                      str(CONTEXT)])
    out = {}
    with TestClient(serve_mod.build_app(args, None, None), raise_server_exceptions=False) as client:
        for name, route, body in CASES:
            r = client.post(f"/v1/{route}", content=body, headers={"Content-Type": "application/json"})
            out[name] = (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"])
    return out


def test_session_bodies_get_the_errors_of_rl_core_serve_without_blocking_the_loop(model_dir):
    expected = _serve_answers(model_dir)
    assert all(400 <= status < 500 for status, _, _ in expected.values()), expected

    async def main():
        tok, backend, registry, server, engine, open_session = await _serving(model_dir)
        lags = []

        async def ticker():  # the controller's loop: how late does a 10 ms tick come?
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.01)
                lags.append(time.monotonic() - t - 0.01)

        tick = asyncio.create_task(ticker())
        got, messages = {}, {}
        try:
            s = open_session("g0/a0")
            headers = {"Authorization": f"Bearer {s.api_key}", "Content-Type": "application/json"}
            for name, route, body in CASES:  # sent from a thread: the loop serves, the ticker measures
                r = await asyncio.to_thread(httpx.post, f"{server.base_url(s)}/{route}", content=body,
                                            headers=headers, timeout=60)
                err = r.json()["error"]
                got[name], messages[name] = (r.status_code, err["param"], err["code"]), err["message"]

            def chunked():  # no Content-Length: refused once the bytes read pass the limit
                yield b'{"prompt": "'
                for _ in range(40):
                    yield b"z" * 2**20
                yield b'"}'

            r = await asyncio.to_thread(httpx.post, f"{server.base_url(s)}/completions", content=chunked(),
                                        headers=headers, timeout=60)
            got["chunked"] = (r.status_code, r.json()["error"]["param"], r.json()["error"]["code"])
        finally:
            tick.cancel()
            await server.stop()
            await backend.shutdown()
        return got, messages, lags, engine.requests, s.turns

    got, messages, lags, requests, turns = asyncio.run(main())
    assert got.pop("chunked") == (413, "body", "body_too_large")
    assert got == expected
    assert expected["malformed-json"] == (400, None, "invalid_json") and "not valid JSON" in messages["malformed-json"]
    assert expected["20mb-message"][1] == "messages.0.content" and "characters" in messages["20mb-message"]
    assert expected["5000-messages"][1] == "messages" and expected["prompt-id-above-vocab"][1] == "prompt"
    assert "vocabulary" in messages["prompt-ids-negative"] and "zero tokens" in messages["prompt-empty-text"]
    assert expected["body-over-32-mib"] == (413, "body", "body_too_large")
    assert requests == [] and turns == []  # refused before any generation
    assert max(lags) < 1.0, f"the event loop was blocked {max(lags):.2f} s"
