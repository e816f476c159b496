"""The session server's in-process transport (`SessionTransport`, what in-process agents' clients
use) answers exactly as its socket does: the same status, body shape, `param`, `code` and message
for every bad body of rl-core serve's cases, a wrong key, an ended session, an unknown route and
a wrong method, through the client agents get (`SessionTransport.client`: it keeps no
cookie); and a model call through it is one recorded turn, with the same token ids as
the socket gives for the same seed (a real session server over the native engine)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.unit.test_session_isolation import CASES, _serving, model_dir  # noqa: F401 - the fixture

OTHER = [("unknown-route", "POST", "nope", b"{}"), ("wrong-method", "GET", "completions", b""),
         ("models", "GET", "models", b"")]


def test_in_process_transport_answers_as_the_socket(model_dir):  # noqa: F811 - the fixture
    async def main():
        tok, backend, registry, server, engine, open_session = await _serving(model_dir)
        answers = {"socket": {}, "transport": {}}
        try:
            for via in answers:
                s = open_session(f"g-{via}/a0")
                http = httpx.AsyncClient(timeout=60) if via == "socket" else server.transport.client()
                headers = {"Authorization": f"Bearer {s.api_key}", "Content-Type": "application/json"}
                url = server.base_url(s)
                calls = [(name, "POST", route, body.encode() if isinstance(body, str) else body)
                         for name, route, body in CASES] + OTHER
                for name, method, route, body in calls:
                    r = await http.request(method, f"{url}/{route}", content=body, headers=headers)
                    answers[via][name] = (r.status_code, json.loads(r.text.replace(s.session_id, "<id>")))
                r = await http.post(f"{url}/completions", json={"prompt": [5]},
                                    headers={"Authorization": "Bearer not-the-key"})
                answers[via]["wrong-key"] = (r.status_code, json.loads(r.text.replace(s.session_id, "<id>")))
                client = openai.AsyncOpenAI(base_url=url, api_key=s.api_key, max_retries=0, http_client=http)
                reply = await client.chat.completions.create(model="policy",
                                                             messages=[{"role": "user", "content": "12+34="}])
                answers[via]["turn"] = (reply.choices[0].message.content, reply.choices[0].token_ids,
                                        [(len(t.prompt_ids), t.completion_ids) for t in s.turns])
                await server.close(s)
                r = await http.post(f"{url}/completions", json={"prompt": [5]}, headers=headers)
                answers[via]["ended"] = (r.status_code, json.loads(r.text.replace(s.session_id, "<id>")))
                if via == "transport":  # the agents' client keeps no cookie: none passes between episodes
                    http.cookies.extract_cookies(httpx.Response(200, headers={"set-cookie": "k=v"},
                                                                request=httpx.Request("GET", url)))
                    answers[via]["cookies"] = dict(http.cookies)
                    with pytest.raises(ValueError, match="keeps no cookies"):
                        http.cookies.set("k", "v")
                await http.aclose()
        finally:
            await server.stop()
            await backend.shutdown()
        return answers, server.counters

    answers, counters = asyncio.run(main())
    sock, local = answers["socket"], answers["transport"]
    assert local.pop("cookies") == {}
    for name in sock:
        assert local[name] == sock[name], name
    # the same call on the same seed: the same tokens, one turn recorded each way
    assert len(local["turn"][2]) == 1 and local["turn"][2][0][1]
    assert local["wrong-key"][0] == 401 and local["ended"][0] == 404
    assert counters["client_errors"] >= 2 * (len(CASES) + 2)


async def platform_probe(client, example):
    """An agent whose reward says whether its client came with its platform resolved (openai's `_platform`)."""
    resolved = client._platform is not None
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example["prompt"]}])
    return float(resolved)


def test_later_episodes_clients_come_with_the_platform_resolved(model_dir, tmp_path):  # noqa: F811 - the fixture
    """A new openai client resolves its platform in a worker thread at its first call; the
    episodes after the first get what the first resolved, so none pays that thread round trip."""
    from rl_core.envs import make_env
    from rl_core.launch.preflight import load_recipe

    cfg = load_recipe("recipes/tiny-addition.yaml", [f"output_dir={tmp_path}", "env.type=agent",
                                                     "env.target=tests.unit.test_session_transport:platform_probe"])

    async def main():
        tok, backend, registry, server, engine, open_session = await _serving(model_dir)
        env = make_env(cfg.env, tok)
        try:
            env.attach_session_transport(server.transport)
            rewards = []
            for i in range(3):
                s = open_session(f"g{i}/a0")
                rewards.append((await env.run_agent(server.base_url(s), s.api_key, {"prompt": "12+34="})).reward)
                assert len(s.turns) == 1
                await server.close(s)
            return rewards
        finally:
            await env.aclose()
            await server.stop()
            await backend.shutdown()

    assert asyncio.run(main()) == [0.0, 1.0, 1.0]
