"""The session server: an OpenAI-compatible endpoint per agent episode, inside the controller.

Owns: a small HTTP server (FastAPI on uvicorn, in the controller's event loop, bound to
127.0.0.1 on a free port) with, for every open episode session `<id>`,
`GET /sessions/<id>/v1/models`, `POST /sessions/<id>/v1/chat/completions` (the tokenizer's
chat template) and `POST /sessions/<id>/v1/completions`, plus `GET /health`; every route but
`/health` needs `Authorization: Bearer <run secret>`. Each call is one model turn of the
session. Its field policy: the recipe's sampling (other `temperature`, `top_p`, `top_k`,
`seed` refused naming the field), `n` 1, no `stream`, `max_tokens` can only lower the
recipe's, `stop` strings added, `tools` through the chat template and `<tool_call>` replies
as `tool_calls`; an ended or unknown session is 404.

One per run, built and stopped by the controller (or validation), started at the first episode.
Does not own: the sessions (sessions.py), the agent or the backend. Read more: docs/agents.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import socket
import time
import uuid
from typing import Any, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import model_validator

from rl_core.rollout.sessions import EpisodeSession, Generate, SessionClosed, SessionRegistry
from rl_core.serve.protocol import ChatCompletionRequest, CompletionRequest
from rl_core.serve.text import TextCodec, chat_logprobs, cut_at_stop
from rl_core.types import SamplingParams

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


class SessionChatRequest(ChatCompletionRequest):
    """Chat completions of a session: tools allowed (rendered by the chat template)."""

    @model_validator(mode="after")
    def _chat_only(self):
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice must be left out, \"auto\" or \"none\" (the model decides)")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise ValueError("response_format other than {\"type\": \"text\"} is not supported; leave it out")
        if self.top_logprobs:
            raise ValueError("top_logprobs is not supported on episode sessions; leave it out")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        return self


class SessionApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param, "code": None}},
                            status_code=self.status)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split `<tool_call>{json}</tool_call>` blocks out of a reply (the Hermes/Qwen convention)."""
    calls = []
    for m in TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return (TOOL_CALL.sub("", text).strip() if calls else text), calls


def quiet_uvicorn_server(config):
    """uvicorn's server without its signal handlers (the controller owns SIGINT/SIGTERM)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server(config)


class SessionServer:
    """The HTTP front of a `SessionRegistry` (see the module doc): `await open(...)` an episode's
    session (the server starts in the running loop at the first), `base_url(session)` and
    `secret` for the agent's client, `await close(session)` when the episode ends, `await
    stop()` at the end of the run."""

    def __init__(self, registry: SessionRegistry, tokenizer: Any, model_name: str = "policy"):
        self.registry = registry
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.port: int | None = None
        self.counters = {"requests": 0, "client_errors": 0, "tool_calls": 0}
        self._server = None
        self._task: asyncio.Task | None = None
        self._starting: asyncio.Lock | None = None
        template = getattr(tokenizer, "chat_template", None) or ""
        self.template_renders_tools = "tools" in template

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30)
        self._server = quiet_uvicorn_server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="rl_core-session-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the start-up error
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
        self._server = self._task = None

    # ------------------------------------------------------------------ episodes

    async def open(self, request_prefix: str, params: SamplingParams, tokenizer: Any, generate: Generate,
                   seed_for: Callable[[int], int | None]) -> EpisodeSession:
        """A new episode session (`SessionRegistry.open`); starts the server on first use."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._server is None:
                await self.start()
        return self.registry.open(request_prefix, params, tokenizer, generate, seed_for)

    async def close(self, session: EpisodeSession) -> None:
        """End an episode's session: later calls get 404, its model calls in flight are aborted."""
        await self.registry.close(session)

    @property
    def secret(self) -> str:
        """The run's session secret: the API key an episode's client sends."""
        return self.registry.secret

    def base_url(self, session: EpisodeSession) -> str:
        return f"http://127.0.0.1:{self.port}/sessions/{session.session_id}/v1"

    # ------------------------------------------------------------------ the app

    def app(self) -> FastAPI:
        app = FastAPI(title="rl_core episode sessions", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(SessionApiError)
        async def _api_error(request: Request, exc: SessionApiError):
            self.counters["client_errors"] += exc.status < 500
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, exc: RequestValidationError):
            self.counters["client_errors"] += 1
            first = exc.errors()[0] if exc.errors() else {}
            loc = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
            return SessionApiError(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}", loc).response()

        @app.get("/health")
        async def health():
            return {"status": "ok", "sessions": len(self.registry)}

        async def check_key(request: Request) -> None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                          self.registry.secret.encode()):
                raise SessionApiError(401, "missing or wrong API key: use the api_key of the client the episode "
                                           "was given (Authorization: Bearer <key>)")

        auth = [Depends(check_key)]

        @app.get("/sessions/{sid}/v1/models", dependencies=auth)
        async def models(sid: str):
            self._session(sid)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "rl_core"}]}

        @app.post("/sessions/{sid}/v1/chat/completions", dependencies=auth)
        async def chat(sid: str, body: SessionChatRequest):
            return await self.chat(self._session(sid), body)

        @app.post("/sessions/{sid}/v1/completions", dependencies=auth)
        async def completions(sid: str, body: CompletionRequest):
            return await self.completions(self._session(sid), body)

        return app

    def _session(self, sid: str) -> EpisodeSession:
        session = self.registry.get(sid)
        if session is None:
            raise SessionApiError(404, f"episode session {sid!r} is not open (it ended, was aborted as stale, or "
                                       "never existed); an agent may only call the model during its episode")
        return session

    def _check_sampling(self, session: EpisodeSession, body) -> None:
        if body.n != 1:
            raise SessionApiError(400, f"n is {body.n}; an episode session generates one choice per call (the "
                                       "recipe's generation.num_generations_per_prompt sets the group size)", "n")
        if body.stream:
            raise SessionApiError(400, "stream is not supported on episode sessions; send stream: false", "stream")
        p = session.params
        mine = {"temperature": 0.0 if p.greedy else p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                "seed": None}
        for name in SAMPLING_FIELDS:
            if name in body.model_fields_set and getattr(body, name) is not None:
                if name == "seed" or getattr(body, name) != mine[name]:
                    raise SessionApiError(
                        400, f"{name} is {getattr(body, name)!r}, but the sampling of training episodes is the "
                             f"recipe's (generation.*: {name} {mine[name]!r}); leave {name} out of the agent's calls",
                        name)

    async def _run(self, session: EpisodeSession, prompt_ids: list[int], text: str | None, max_tokens, stops):
        self.counters["requests"] += 1
        try:
            return await session.call(prompt_ids, text, max_tokens, stops)
        except SessionClosed as exc:
            raise SessionApiError(404, str(exc)) from None

    async def chat(self, session: EpisodeSession, body: SessionChatRequest) -> dict:
        self._check_sampling(session, body)
        if body.tools and not self.template_renders_tools:
            raise SessionApiError(400, "tools were sent, but this model's chat template does not render tools; "
                                       "describe the tool in the system or user message and parse the reply's text",
                                  "tools")
        messages = [m.for_template() for m in body.messages]
        try:
            ids, text = session.chat_prompt(messages, body.add_generation_prompt, body.continue_final_message,
                                            tools=body.tools)
        except Exception as exc:  # noqa: BLE001 - a template error is about the messages sent
            raise SessionApiError(400, f"the chat template failed on these messages: {exc}", "messages") from None
        stops = body.stop_strings()
        res = await self._run(session, ids, text, body.new_tokens(), stops)
        content, _ = cut_at_stop(self.tokenizer.decode(res.token_ids, skip_special_tokens=True), stops)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish = res.finish_reason
        if body.tools and body.tool_choice != "none":
            content, calls = parse_tool_calls(content)
            if calls:
                self.counters["tool_calls"] += len(calls)
                message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                finish = "tool_calls"
        lp = {"content": chat_logprobs(TextCodec(self.tokenizer), res.token_ids, res.logprobs, None)} \
            if body.logprobs else None
        return {"id": f"chatcmpl-{session.session_id}-{len(session.turns)}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish,
                             "token_ids": list(res.token_ids), "prompt_token_ids": list(ids),
                             "weight_version": res.end_version}],
                "usage": _usage(ids, res.token_ids)}

    async def completions(self, session: EpisodeSession, body: CompletionRequest) -> dict:
        self._check_sampling(session, body)
        prompts = body.prompts()
        if len(prompts) != 1:
            raise SessionApiError(400, f"prompt holds {len(prompts)} prompts; an episode session takes one per call",
                                  "prompt")
        prompt = prompts[0]
        if body.logprobs:
            raise SessionApiError(400, "logprobs is not supported on /completions of episode sessions (the trainer "
                                       "records them); leave it out", "logprobs")
        if isinstance(prompt, str):
            ids, text = session.text_prompt(prompt), prompt
        else:
            ids, text = [int(i) for i in prompt], None
        stops = body.stop_strings()
        res = await self._run(session, ids, text, body.max_tokens, stops)
        content, _ = cut_at_stop(self.tokenizer.decode(res.token_ids, skip_special_tokens=True), stops)
        return {"id": f"cmpl-{session.session_id}-{len(session.turns)}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "text": content, "logprobs": None, "finish_reason": res.finish_reason,
                             "token_ids": list(res.token_ids), "prompt_token_ids": list(ids),
                             "weight_version": res.end_version}],
                "usage": _usage(ids, res.token_ids)}


def _usage(prompt: list[int], completion: list[int]) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(completion),
            "total_tokens": len(prompt) + len(completion)}
