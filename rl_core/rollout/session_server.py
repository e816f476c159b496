"""The session server: an OpenAI-compatible endpoint per agent episode, inside the controller.

Owns: a small HTTP server (FastAPI on uvicorn, in the controller's event loop, bound to
127.0.0.1 on a free port) with, for every open episode session `<id>`,
`GET /sessions/<id>/v1/models`, `POST /sessions/<id>/v1/chat/completions` (the tokenizer's
chat template; a large request's in a worker thread) and `POST /sessions/<id>/v1/completions`,
`GET /health`, and the same routes in-process for agents in this process (`SessionTransport`:
no socket); all but `/health` need `Authorization: Bearer <the session's own key>` (an ended
or unknown session is 404, another session's key 401). Each call is one model turn.
Field policy: the recipe's sampling (other `temperature`, `top_p`, `top_k`, `seed` refused),
`n` 1, no `stream`, `max_tokens` only lowers the recipe's, `stop` strings added, `tools`
through the chat template, `<tool_call>` replies as `tool_calls`; the checks, limits and error
shape of `rl-core serve` (rl_core.serve.checks), before anything is tokenized or generated.
One per run, built and stopped by the controller (or validation); not the sessions, agent or backend.
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
from typing import Any, Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse  # plain dicts of JSON types: no jsonable_encoder pass
from pydantic import model_validator

from rl_core.rollout.sessions import EpisodeSession, Generate, SessionClosed, SessionRegistry
from rl_core.serve.checks import (ApiError, BodyLimit, RequestLimits, body_too_large, install_error_handlers,
                                  parse_body, text_chars, unexpected)
from rl_core.serve.protocol import ChatCompletionRequest, CompletionRequest
from rl_core.serve.text import TextCodec, chat_logprobs, cut_at_stop
from rl_core.types import SamplingParams
from rl_core.usercode import run_on

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


def refusal(status: int, message: str, param: str | None = None) -> ApiError:
    """An error answer of a session route (rl-core serve's `ApiError`), naming the field `param`."""
    return ApiError(status, message, "invalid_request_error" if status < 500 else "server_error", param)


def context_limits(tokenizer: Any, backend: Any = None) -> RequestLimits:
    """The limits of a session call: the backend's context and vocabulary where it tells them
    (`max_model_len`, `vocab_size`: the native engine does), else the tokenizer's
    `model_max_length` (when set) and its vocabulary."""
    context = getattr(backend, "max_model_len", None)
    if context is None:
        context = getattr(tokenizer, "model_max_length", None)
        context = context if isinstance(context, int) and 0 < context < 10**8 else None
    vocab = getattr(backend, "vocab_size", None) or (len(tokenizer) if hasattr(tokenizer, "__len__") else None)
    return RequestLimits.of(tokenizer, context, vocab)


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


INLINE_CHARS = 16384  # a request with at most this much text is rendered and tokenized on the loop


async def off_loop_if_large(chars: int, fn: Callable, *args, **kwargs):
    """`fn(*args, **kwargs)`: in a worker thread when the request holds more than INLINE_CHARS
    characters (a large request never holds up the event loop), else here (a small one costs
    less than the thread hop: ~0.1 ms for a turn of a few hundred characters)."""
    if chars > INLINE_CHARS:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


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
    `session.api_key` for the agent's client, `await close(session)` when the episode ends,
    `await stop()` at the end of the run. `backend` (the run's generation backend) gives the
    context and vocabulary requests are checked against (`context_limits`)."""

    def __init__(self, registry: SessionRegistry, tokenizer: Any, model_name: str = "policy", backend: Any = None):
        self.registry = registry
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.backend = backend
        self.limits: RequestLimits | None = None  # at start: a remote backend knows its context once started
        self.port: int | None = None
        self.counters = {"requests": 0, "client_errors": 0, "tool_calls": 0}
        self._server = None
        self._app: FastAPI | None = None
        self._transport = None
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
        self.limits = context_limits(self.tokenizer, self.backend)
        self._app = self.app()
        config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off",
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
    def transport(self):
        """The in-process transport of this server (`SessionTransport`), None before it started."""
        if self._transport is None and self._app is not None:
            self._transport = SessionTransport(self, self._app)
        return self._transport

    def count(self, status: int) -> None:
        """Count an error answer (`counters["client_errors"]`: the 4xx)."""
        self.counters["client_errors"] += status < 500

    def base_url(self, session: EpisodeSession) -> str:
        return f"http://127.0.0.1:{self.port}/sessions/{session.session_id}/v1"

    # ------------------------------------------------------------------ the app

    def app(self) -> FastAPI:
        app = FastAPI(title="rl_core episode sessions", docs_url=None, redoc_url=None, openapi_url=None)

        install_error_handlers(app, self.count)  # rl-core serve's error shape
        app.add_middleware(BodyLimit, limit=lambda: self.limits.body_bytes, count=self.count)

        @app.get("/health")
        async def health():
            return {"status": "ok", "sessions": len(self.registry)}

        # the session and its key are checked before the body is parsed
        @app.get("/sessions/{sid}/v1/models")
        async def models(request: Request, sid: str):
            self._session(request.headers, sid)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "rl_core"}]}

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def chat(request: Request, sid: str):
            return JSONResponse(await self.answer("chat/completions", sid, request.headers, request.body))

        @app.post("/sessions/{sid}/v1/completions")
        async def completions(request: Request, sid: str):
            return JSONResponse(await self.answer("completions", sid, request.headers, request.body))

        return app

    async def answer(self, route: str, sid: str, headers: Any, read_body: Callable[[], Awaitable[bytes]]) -> dict:
        """The answer to a call of a model route ("chat/completions" or "completions") of session
        `sid`: its key is checked before the body is read (`read_body`) and parsed. The socket's
        routes and the in-process transport (`SessionTransport`) both answer through here."""
        session = self._session(headers, sid)
        if route == "chat/completions":
            return await self.chat(session, parse_body(await read_body(), SessionChatRequest))
        return await self.completions(session, parse_body(await read_body(), CompletionRequest))

    def _session(self, headers: Any, sid: str) -> EpisodeSession:
        """The open session `sid`, if `headers` carry its key (404: not open; 401: not its key)."""
        session = self.registry.get(sid)
        if session is None:
            raise refusal(404, f"episode session {sid!r} is not open (it ended, was aborted as stale, or "
                               "never existed); an agent may only call the model during its episode")
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), session.api_key.encode()):
            raise refusal(401, f"missing or wrong API key for episode session {sid!r}: each episode has its "
                               "own key; use the client (base_url and api_key) this episode was given, "
                               "never one kept from another episode (Authorization: Bearer <key>)")
        return session

    def _check_sampling(self, session: EpisodeSession, body) -> None:
        if body.n != 1:
            raise refusal(400, f"n is {body.n}; an episode session generates one choice per call (the "
                               "recipe's generation.num_generations_per_prompt sets the group size)", "n")
        if body.stream:
            raise refusal(400, "stream is not supported on episode sessions; send stream: false", "stream")
        p = session.params
        mine = {"temperature": 0.0 if p.greedy else p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                "seed": None}
        for name in SAMPLING_FIELDS:
            if name in body.model_fields_set and getattr(body, name) is not None:
                if name == "seed" or getattr(body, name) != mine[name]:
                    raise refusal(
                        400, f"{name} is {getattr(body, name)!r}, but the sampling of training episodes is the "
                             f"recipe's (generation.*: {name} {mine[name]!r}); leave {name} out of the agent's calls",
                        name)

    async def _run(self, session: EpisodeSession, prompt_ids: list[int], text: str | None, body, max_tokens: str):
        """The model turn, once the prompt passed rl-core serve's checks (rl_core.serve.checks);
        an episode that ended meanwhile is refused before its generation starts."""
        self.limits.check_prompt_ids(prompt_ids)
        self.limits.check_max_tokens(getattr(body, max_tokens), max_tokens)
        try:
            stops = body.stop_strings()
        except ValueError as exc:
            raise refusal(400, str(exc), "stop") from None
        self.counters["requests"] += 1
        try:
            return await session.call(prompt_ids, text, getattr(body, max_tokens), stops), stops
        except SessionClosed as exc:
            raise refusal(404, str(exc)) from None
        except ValueError as exc:  # the engine refused the request
            raise refusal(400, str(exc)) from None

    async def chat(self, session: EpisodeSession, body: SessionChatRequest) -> dict:
        self._check_sampling(session, body)
        if body.tools and not self.template_renders_tools:
            raise refusal(400, "tools were sent, but this model's chat template does not render tools; "
                               "describe the tool in the system or user message and parse the reply's text",
                          "tools")
        messages = [m.for_template() for m in body.messages]
        self.limits.check_messages(messages, body.tools)
        try:  # a large request's template and tokenizer run off the event loop
            chars = text_chars(messages) + text_chars(body.tools or [])
            ids, text = await off_loop_if_large(chars, session.chat_prompt, messages, body.add_generation_prompt,
                                                body.continue_final_message, tools=body.tools)
        except Exception as exc:  # noqa: BLE001 - a template error is about the messages sent
            raise refusal(400, f"the chat template failed on these messages: {exc}", "messages") from None
        res, stops = await self._run(session, ids, text, body, body.max_tokens_field())
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
            raise refusal(400, f"prompt holds {len(prompts)} prompts; an episode session takes one per call",
                          "prompt")
        prompt = prompts[0]
        if body.logprobs:
            raise refusal(400, "logprobs is not supported on /completions of episode sessions (the trainer "
                               "records them); leave it out", "logprobs")
        if isinstance(prompt, str):
            self.limits.check_text(prompt, "prompt")
            ids, text = await off_loop_if_large(len(prompt), session.text_prompt, prompt), prompt
        else:
            ids, text = [int(i) for i in prompt], None
        res, stops = await self._run(session, ids, text, body, "max_tokens")
        content, _ = cut_at_stop(self.tokenizer.decode(res.token_ids, skip_special_tokens=True), stops)
        return {"id": f"cmpl-{session.session_id}-{len(session.turns)}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "text": content, "logprobs": None, "finish_reason": res.finish_reason,
                             "token_ids": list(res.token_ids), "prompt_token_ids": list(ids),
                             "weight_version": res.end_version}],
                "usage": _usage(ids, res.token_ids)}


class SessionTransport(httpx.AsyncBaseTransport):
    """An httpx transport to a `SessionServer` in this process: an in-process agent's client
    (rl_core.envs.agent) sends its model calls through it with no socket, HTTP parsing,
    connection pool or web framework between: a POST to a model route goes straight to
    `SessionServer.answer`, its body limit and errors as on the socket (rl_core.serve.checks);
    any other request goes to the server's app (`httpx.ASGITransport`). Agents run on a loop of
    their own (rl_core.usercode.UserLoop): each request is answered on the server's loop, the one
    this transport was made on (cancelling the call cancels it there). Services in other
    processes use the socket."""

    ROUTE = re.compile(r"^/sessions/([^/]+)/v1/(chat/completions|completions)$")

    def __init__(self, server: SessionServer, app: FastAPI):
        self.server = server
        self.asgi = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        self.loop = asyncio.get_running_loop()  # the server's (the controller's) loop

    def client(self) -> httpx.AsyncClient:
        """An httpx client over this transport for agents' OpenAI clients (no timeout: the
        episode's deadline bounds it), without cookie handling: the session routes set no
        cookie, and httpx would otherwise parse every answer for one (`Cookies.extract_cookies`,
        a good part of a call's time on the agents' loop: docs/benchmarks.md); nor can a cookie
        pass from one episode to another through the shared client."""
        return _CookielessClient(transport=self, timeout=None)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()  # the body in memory: the request can cross to the server's loop
        return await run_on(self.loop, self._answer(request))

    async def _answer(self, request: httpx.Request) -> httpx.Response:
        m = self.ROUTE.match(request.url.path)
        if m is None or request.method != "POST":
            return await self.asgi.handle_async_request(request)
        raw = request.content

        async def read() -> bytes:
            return raw

        try:
            limit = self.server.limits.body_bytes
            if len(raw) > limit:
                raise body_too_large(str(len(raw)), limit)
            status, out = 200, await self.server.answer(m.group(2), m.group(1), request.headers, read)
        except ApiError as exc:
            status, out = exc.status, exc.response().body
        except Exception as exc:  # noqa: BLE001 - as the socket's handler: a JSON 500, never a raise
            err = unexpected(exc)
            status, out = err.status, err.response().body
        if status != 200:
            self.server.count(status)
        content = out if isinstance(out, bytes) else json.dumps(out, ensure_ascii=False).encode()
        return httpx.Response(status, headers={"content-type": "application/json"}, content=content)


class _NoCookies(httpx.Cookies):
    """Cookies that stay empty (`SessionTransport.client`): no answer sets one, nor does a caller."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None

    def set(self, name: str, value: str, domain: str = "", path: str = "/") -> None:
        raise ValueError("the agents' client over the in-process session transport keeps no cookies")


class _CookielessClient(httpx.AsyncClient):
    """`httpx.AsyncClient` whose cookies stay empty: answers' Set-Cookie headers are not read."""

    @property
    def cookies(self) -> httpx.Cookies:
        return _NO_COOKIES

    @cookies.setter
    def cookies(self, value) -> None:
        if value:
            _NO_COOKIES.update(value)  # refused


_NO_COOKIES = _NoCookies()


def _usage(prompt: list[int], completion: list[int]) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(completion),
            "total_tokens": len(prompt) + len(completion)}
