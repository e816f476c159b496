"""A tiny environment service (rl_core's `env.type: http` protocol), standard library + `openai`.

    python examples/agents/env_service.py --port 8765

Protocol (docs/agents.md): `GET /health` -> 200 {"status": "ok"};
`POST /episodes` with {"example": {...}, "base_url": ..., "api_key": ..., "episode_id": ...}
-> 200 {"rewards": {"turn1": ..., "turn2": ...}} after running the episode against the
model at `base_url` (the episode's OpenAI-compatible session). The episode logic is the
two-turn chain task of chain_agent.py, written here with the synchronous client.
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai


def third_operand(example: dict) -> int:
    return (int(example["id"]) * 37 + 11) % 100


def reversed_digits(total: int) -> str:
    return f"{total:03d}"[::-1]


def run_episode(example: dict, base_url: str, api_key: str, turns: int = 2) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    a, b, c = int(example["a"]), int(example["b"]), third_operand(example)
    expected = [reversed_digits(a + b), reversed_digits(a + b + c)]
    messages = [{"role": "user", "content": example["prompt"]}]
    rewards = {}
    for turn in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages)
        answer = reply.choices[0].message.content or ""
        rewards[f"turn{turn + 1}"] = float(answer.strip() == expected[turn]
                                           and reply.choices[0].finish_reason == "stop") / turns
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"+{c:02d}="}]
    return {"rewards": rewards}


class Handler(BaseHTTPRequestHandler):
    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - the stdlib's handler name
        if self.path == "/health":
            self._send(200, {"status": "ok"})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self):  # noqa: N802
        if self.path != "/episodes":
            return self._send(404, {"error": f"no route {self.path}"})
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            example, base_url, api_key = body["example"], body["base_url"], body["api_key"]
        except (ValueError, KeyError, TypeError) as exc:
            return self._send(400, {"error": f"bad episode request: {exc}"})
        try:
            self._send(200, run_episode(example, base_url, api_key))
        except openai.APIError as exc:
            self._send(502, {"error": f"model call failed: {exc}"})

    def log_message(self, *args):  # quiet
        pass


class Server(ThreadingHTTPServer):
    # a run sends up to async_rl.max_inflight_groups x the group size episodes at once (256 by
    # default), all again at once after a restart; the stdlib's listen backlog of 5 resets
    # connections beyond a few dozen
    request_queue_size = 1024


def make_server(port: int, handler=Handler) -> Server:
    return Server(("127.0.0.1", port), handler)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args(argv)
    server = make_server(args.port)
    print(f"env service on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
