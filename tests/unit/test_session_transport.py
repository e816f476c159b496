"""The session server's in-process transport (`SessionTransport`, what in-process agents' clients
use) answers exactly as its socket does: the same status, body shape, `param`, `code` and message
for every bad body of rl-core serve's cases, a wrong key, an ended session, an unknown route and
a wrong method; and a model call through it is one recorded turn, with the same token ids as
the socket gives for the same seed (a real session server over the native engine)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai

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
                http = httpx.AsyncClient(timeout=60) if via == "socket" else \
                    httpx.AsyncClient(transport=server.transport, timeout=60)
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
                await http.aclose()
        finally:
            await server.stop()
            await backend.shutdown()
        return answers, server.counters

    answers, counters = asyncio.run(main())
    sock, local = answers["socket"], answers["transport"]
    for name in sock:
        assert local[name] == sock[name], name
    # the same call on the same seed: the same tokens, one turn recorded each way
    assert len(local["turn"][2]) == 1 and local["turn"][2][0][1]
    assert local["wrong-key"][0] == 401 and local["ended"][0] == 404
    assert counters["client_errors"] >= 2 * (len(CASES) + 2)
