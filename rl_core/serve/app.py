"""The HTTP server of `rl-core serve`: OpenAI-compatible generation plus RL control endpoints.

Owns: the routes (`/health`, `/v1/models`, `/v1/completions`, `/v1/chat/completions`, the
`/rl/*` weight, abort, cache and metrics routes), bearer-token auth and the control
secret of managed servers, OpenAI-style error bodies (`{"error": {message, type, param,
code}}` on every route, unknown ones too: 4xx for what the client sent, 500 `server_error`
for engine failures, 503 when stopped), and how one HTTP request becomes engine requests (choice i of request r runs as
`"r/i"`; `/rl/abort` of r and a client disconnect abort all of them, `/rl/abort` of "r/i" that
choice alone) and a response.

Does not own: the engine or its thread (rl_core.generation), request schemas
(protocol.py), text handling (text.py), or process start-up (rl_core.launch.serve).

Read more: docs/generation.md, "`rl-core serve`" (endpoints, field policy, limits, auth).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from safetensors import SafetensorError

from rl_core.generation.base import GenerationError, StreamDelta
from rl_core.generation.native.backend import NativeBackend
from rl_core.resilience import cancel_and_wait
from rl_core.server_contract import CONTROL_SECRET_HEADER, DEFAULT_CONTROL_SECRET_ENV
from rl_core.metrics.gc_pauses import freeze_setup_objects, unfreeze
from rl_core.serve.checks import ApiError, BodyLimit, RequestLimits, install_error_handlers
from rl_core.serve.protocol import (AbortRequest, ChatCompletionRequest, CompletionRequest, ReceiveWeightsRequest,
                                    SamplingBody, UpdateWeightsRequest, WeightGroupRequest, packed_choice)
from rl_core.serve.text import TextCodec, TextStream, chat_logprobs, completion_logprobs, cut_at_stop
from rl_core.types import GenerationRequest, GenerationResult
from rl_core.weights.broadcast import BroadcastHeaderError

DISCONNECT_POLL_S = 0.25


@dataclass
class ServerSettings:
    model_name: str
    api_key: str | None = None  # None: no auth (only allowed on loopback; the launcher enforces it)
    max_model_len: int = 4096
    vocab_size: int | None = None  # prompt ids are checked against it before anything is queued
    managed: bool = False  # --managed: the /rl/* control routes are on (and need control_secret)
    control_secret: str | None = None
    max_choices: int = 512  # prompts x n of one request (--max-choices-per-request)


@dataclass
class _Job:
    choice: int
    prompt_index: int
    request: GenerationRequest


class Server:
    """State shared by the routes: the backend, the tokenizer, requests in flight."""

    def __init__(self, backend: NativeBackend, tokenizer: Any, settings: ServerSettings):
        self.backend = backend
        self.codec = TextCodec(tokenizer)
        self.settings = settings
        # the checks the session server of agent episodes shares (rl_core.serve.checks)
        self.limits = RequestLimits.of(tokenizer, settings.max_model_len, settings.vocab_size, settings.max_choices)
        self.inflight: dict[str, list[str]] = {}  # request_id -> engine request ids
        self.weights_lock = asyncio.Lock()
        self.weight_receiver = None  # rl_core.weights.WeightReceiver once the trainer's broadcast group is joined
        self.counters = {"requests": 0, "client_errors": 0, "server_errors": 0, "aborted_requests": 0}
        if settings.managed and not settings.control_secret:
            raise ValueError("a managed server needs a control secret")

    # ------------------------------------------------------------------ auth

    async def check_token(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API token: send the header 'Authorization: Bearer <token>' with "
                                "the token the server was started with", code="invalid_api_key")

    async def check_control(self, request: Request) -> None:
        """The guard of the control routes (see the module doc)."""
        if not self.settings.managed:
            raise ApiError(403, f"{request.url.path} is a control route, and this server was not started as a managed "
                                "rollout server; start it with `rl-core serve --managed` and a control secret "
                                f"({DEFAULT_CONTROL_SECRET_ENV} or --control-secret-file), as HttpBackend does for "
                                "the servers it launches", type="permission_error", code="control_routes_disabled")
        sent = request.headers.get(CONTROL_SECRET_HEADER, "")
        if not secrets.compare_digest(sent.encode(), self.settings.control_secret.encode()):
            raise ApiError(401, f"missing or wrong control secret: send the header '{CONTROL_SECRET_HEADER}: <secret>' "
                                "with the secret this managed server was started with", type="permission_error",
                           code="invalid_control_secret")

    # ------------------------------------------------------------------ building engine requests

    def _jobs(self, body: SamplingBody, prompts: list[list[int]], max_tokens: int | None, top: int,
              base: str) -> list[_Job]:
        if body.model is not None and body.model != self.settings.model_name:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves "
                                f"{self.settings.model_name!r} (see GET /v1/models)", param="model",
                           code="model_not_found")
        if base in self.inflight:
            raise ApiError(400, f"request_id {base!r} is already in flight; use a unique id", param="request_id")
        choices = len(prompts) * body.n
        if choices > self.settings.max_choices:
            raise ApiError(400, f"this request asks for {len(prompts)} prompt(s) x n={body.n} = {choices} choices; "
                                f"this server's cap is {self.settings.max_choices} per request (rl-core serve "
                                "--max-choices-per-request). Send fewer prompts or a smaller n per request",
                           param="n")
        self.limits.check_max_tokens(max_tokens, body.max_tokens_field())
        self.limits.check_stop_ids(body.stop_token_ids)
        jobs = []
        for p, ids in enumerate(prompts):
            self.limits.check_prompt_ids(ids, p)
            room = self.settings.max_model_len - len(ids)
            try:
                for i in range(body.n):
                    choice = p * body.n + i
                    params = body.sampling_params(max_tokens or room, i, top)
                    jobs.append(_Job(choice, p, GenerationRequest(f"{base}/{choice}", ids, params)))
            except ValueError as exc:
                raise ApiError(400, str(exc), param="stop") from None
        return jobs

    def _encode_prompts(self, body: CompletionRequest) -> list[list[int]]:
        out = []
        for p in body.prompts():
            if isinstance(p, str):
                self.limits.check_text(p, "prompt")
            ids = self.codec.encode(p) if isinstance(p, str) else list(p)
            self.limits.check_prompt_ids(ids, len(out))
            out.append(ids)
        return out

    # ------------------------------------------------------------------ running them

    async def _generate_all(self, base: str, jobs: list[_Job], request: Request) -> list[GenerationResult]:
        self.inflight[base] = [j.request.request_id for j in jobs]
        task = asyncio.ensure_future(asyncio.gather(*(self.backend.generate(j.request) for j in jobs)))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():  # nobody will read the answer: free the engine
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                    raise ApiError(499, "client disconnected")
        except ValueError as exc:  # the engine refused a request
            raise ApiError(400, str(exc)) from None
        except GenerationError as exc:
            raise ApiError(500, f"generation failed: {exc}", type="server_error") from None
        except RuntimeError as exc:
            raise ApiError(503, f"the engine is not serving: {exc}", type="server_error") from None
        finally:
            self.inflight.pop(base, None)
            if not task.done():
                task.cancel()

    async def _stream_all(self, base: str,
                          jobs: list[_Job]) -> AsyncIterator[tuple[_Job, StreamDelta | GenerationResult]]:
        """(job, delta or final result) of every choice, as they come."""
        self.inflight[base] = [j.request.request_id for j in jobs]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(job: _Job) -> None:
            try:
                async for item in self.backend.generate_stream(job.request):
                    queue.put_nowait((job, item))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((job, exc))

        tasks = [asyncio.ensure_future(pump(j)) for j in jobs]
        try:
            remaining = len(jobs)
            while remaining:
                job, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, GenerationResult):
                    remaining -= 1
                yield job, item
        finally:
            self.inflight.pop(base, None)
            await cancel_and_wait(tasks)

    async def abort(self, request_ids: list[str]) -> int:  # a request by its id, or one choice by <id>/<choice>
        n = 0
        for rid in request_ids:
            ids = self.inflight.get(rid)
            if ids is None:
                ids = [rid] if rid in self.inflight.get(rid.rpartition("/")[0], ()) else []
            for engine_id in ids:
                await self.backend.abort(engine_id)
                n += 1
        self.counters["aborted_requests"] += n
        return n

    # ------------------------------------------------------------------ responses

    def _extension(self, body: SamplingBody, result: GenerationResult) -> dict:
        if not body.return_token_ids:
            return {}
        return {"prompt_token_ids": result.prompt_ids, "token_ids": result.token_ids,
                "start_version": result.start_version, "end_version": result.end_version,
                "token_versions": result.token_versions}

    def _usage(self, prompts: list[list[int]], results: list[GenerationResult]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion = sum(len(r.token_ids) for r in results)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    async def completions(self, body: CompletionRequest, request: Request):
        self.counters["requests"] += 1
        prompts = self._encode_prompts(body)
        top = body.logprobs or 0
        base = body.request_id or f"cmpl-{uuid.uuid4().hex}"
        jobs = self._jobs(body, prompts, body.max_tokens, top, base)
        stops = body.stop_strings()
        created = int(time.time())
        head = {"id": base, "object": "text_completion", "created": created, "model": self.settings.model_name}
        if body.stream:
            return _sse(self._stream_completions(body, prompts, jobs, stops, head, base))
        results = await self._generate_all(base, jobs, request)
        if body.return_token_arrays:  # rl_core's packed choices (protocol.packed_choice)
            packed = [{"index": j.choice, "finish_reason": r.finish_reason, **packed_choice(r)} for j, r in zip(jobs, results)]
            return {**head, "choices": packed, "usage": self._usage(prompts, results)}
        choices = []
        for job, res in zip(jobs, results):
            text, _ = cut_at_stop(self.codec.decode(res.token_ids), stops)
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(self.codec, res.token_ids, res.logprobs, res.top_logprobs if top else None)
            choices.append({"index": job.choice, "text": text, "logprobs": lp, "finish_reason": res.finish_reason,
                            **self._extension(body, res)})
        return {**head, "choices": choices, "usage": self._usage(prompts, results)}

    async def _stream_choices(self, body, prompts, jobs, head, base, delta: Callable, end: Callable):
        """The chunks of a streamed answer, as its tokens come: `delta(job, item, choice)` fills a
        chunk of new tokens, `end(job, result, choice)` a choice's last chunk (rl_core's extension
        fields follow each when asked for); then the usage chunk if `stream_options` asks for it."""
        results = []
        async for job, item in self._stream_all(base, jobs):
            choice: dict[str, Any] = {"index": job.choice, "logprobs": None, "finish_reason": None}
            if isinstance(item, StreamDelta):
                delta(job, item, choice)
                if body.return_token_ids:
                    choice["token_ids"] = item.token_ids
            else:
                results.append(item)
                end(job, item, choice)
                if body.return_token_ids:
                    choice.update({k: v for k, v in self._extension(body, item).items() if k != "token_ids"},
                                  token_ids=[])
            yield {**head, "choices": [choice]}
        if body.stream_options is not None and body.stream_options.include_usage:
            yield {**head, "choices": [], "usage": self._usage(prompts, results)}

    def _stream_completions(self, body, prompts, jobs, stops, head, base):
        texts = {j.choice: TextStream(self.codec, stops) for j in jobs}
        offsets = {j.choice: 0 for j in jobs}

        def delta(job, item: StreamDelta, choice: dict) -> None:
            choice["text"] = texts[job.choice].push(item.token_ids)
            if body.logprobs is not None:
                choice["logprobs"] = completion_logprobs(self.codec, item.token_ids, item.logprobs,
                                                         item.top_logprobs if body.logprobs else None,
                                                         offsets[job.choice])
                offsets[job.choice] = choice["logprobs"]["text_offset"][-1] + len(choice["logprobs"]["tokens"][-1])

        def end(job, result: GenerationResult, choice: dict) -> None:
            choice.update(text=texts[job.choice].finish(), finish_reason=result.finish_reason)

        return self._stream_choices(body, prompts, jobs, head, base, delta, end)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        self.counters["requests"] += 1
        messages = [m.for_template() for m in body.messages]
        self.limits.check_messages(messages)
        try:
            ids = self.codec.chat_prompt(messages, body.add_generation_prompt, body.continue_final_message)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        except Exception as exc:  # a template error (jinja) is about the messages sent
            raise ApiError(400, f"the chat template failed on these messages: {exc}", param="messages") from None
        top = (body.top_logprobs or 0) if body.logprobs else 0
        base = body.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        jobs = self._jobs(body, [ids], body.new_tokens(), top, base)
        stops = body.stop_strings()
        head = {"id": base, "object": "chat.completion", "created": int(time.time()),
                "model": self.settings.model_name}
        if body.stream:
            return _sse(self._stream_chat(body, [ids], jobs, stops, {**head, "object": "chat.completion.chunk"}, base))
        results = await self._generate_all(base, jobs, request)
        choices = []
        for job, res in zip(jobs, results):
            text, _ = cut_at_stop(self.codec.decode(res.token_ids), stops)
            lp = None
            if body.logprobs:
                lp = {"content": chat_logprobs(self.codec, res.token_ids, res.logprobs,
                                               res.top_logprobs if top else None)}
            choices.append({"index": job.choice, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": res.finish_reason, **self._extension(body, res)})
        return {**head, "choices": choices, "usage": self._usage([ids], results)}

    async def _stream_chat(self, body, prompts, jobs, stops, head, base):
        texts = {j.choice: TextStream(self.codec, stops) for j in jobs}
        for job in jobs:  # the role comes first, as in OpenAI's streams
            yield {**head, "choices": [{"index": job.choice, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}

        def delta(job, item: StreamDelta, choice: dict) -> None:
            choice["delta"] = {"content": texts[job.choice].push(item.token_ids)}
            if body.logprobs:
                choice["logprobs"] = {"content": chat_logprobs(self.codec, item.token_ids, item.logprobs,
                                                               item.top_logprobs if body.top_logprobs else None)}

        def end(job, result: GenerationResult, choice: dict) -> None:
            rest = texts[job.choice].finish()
            choice.update(delta={"content": rest} if rest else {}, finish_reason=result.finish_reason)

        async with contextlib.aclosing(self._stream_choices(body, prompts, jobs, head, base, delta, end)) as chunks:
            async for chunk in chunks:
                yield chunk

    # ------------------------------------------------------------------ RL control

    async def update_weights(self, body: UpdateWeightsRequest) -> dict:
        path = Path(body.path)
        if not path.is_dir():
            raise ApiError(400, f"path {body.path!r} is not a directory on the server; send a directory the server "
                                "can read (a shared file system for remote servers)", param="path")
        async with self.weights_lock:
            t0 = time.monotonic()
            try:
                await asyncio.to_thread(_check_weight_files, path)  # a truncated file: 400 naming it
                if body.require_marker:
                    weights = await asyncio.to_thread(_read_ready_version, path, body.version)
                    await self.backend.update_weights(body.version, weights)
                else:
                    await self.backend.update_weights(body.version, path)
            except (ValueError, OSError, SafetensorError) as exc:  # a bad or incomplete directory, wrong shapes
                raise ApiError(400, str(exc), param="path") from None
            if body.invalidate_kv_cache:
                await self.backend.invalidate_kv_cache()
            return {"weight_version": self.backend.weight_version, "seconds": time.monotonic() - t0}

    async def init_weight_broadcast(self, body: WeightGroupRequest) -> dict:
        """Join the trainer's broadcast group (blocks until every member joined). Joining again
        leaves the previous group: the trainer forms a new one when its servers change (one
        restarted, one gone)."""
        from rl_core.weights.broadcast import BroadcastGroup, WeightReceiver

        self.weight_receiver = None  # the previous group, if any, is left
        t0 = time.monotonic()
        device = str(self.backend.engine.device)
        group = await asyncio.to_thread(BroadcastGroup.create, body.host, body.port, body.rank, body.world_size,
                                        device, body.timeout_s)
        self.weight_receiver = WeightReceiver(group, body.bucket_size_mb)
        return {"device": device, "seconds": time.monotonic() - t0}

    async def receive_weights(self, body: ReceiveWeightsRequest) -> dict:
        """Receive one broadcast version and load it (returns once it is live)."""
        if self.weight_receiver is None:
            raise ApiError(400, "no weight-broadcast group: POST /rl/init_weight_broadcast first", param="version")
        async with self.weights_lock:
            try:
                version, state, report = await asyncio.to_thread(self.weight_receiver.recv)
            except BroadcastHeaderError as exc:
                raise ApiError(400, str(exc), param=None) from None
            if version != body.version:
                raise ApiError(400, f"the broadcast carried weight version {version}, the request says {body.version}",
                               param="version")
            t0 = time.monotonic()
            try:  # checked before anything is copied: a tensor the model lacks, a wrong shape
                await self.backend.update_weights(version, state)
            except (ValueError, KeyError) as exc:
                raise ApiError(400, f"the broadcast of weight version {version} does not fit this model: {exc}",
                               param=None, code="weights_do_not_fit") from None
            if body.invalidate_kv_cache:
                await self.backend.invalidate_kv_cache()
            load_s = time.monotonic() - t0
            return {"weight_version": self.backend.weight_version, "bytes": report.bytes,
                    "recv_s": report.seconds, "load_s": load_s}

    def health(self) -> dict:
        m = self.backend.metrics()
        return {"status": "ok", "model": self.settings.model_name, "weight_version": self.backend.weight_version,
                "max_batch_size": self.backend.capacity(), "max_model_len": self.settings.max_model_len,
                "running": int(m["running"]), "waiting": int(m["waiting"]), "requests_in_flight": len(self.inflight)}


def _check_weight_files(path: Path) -> None:
    """Every *.safetensors file of a weight directory is complete (headers only are read)."""
    from rl_core.server_contract import check_safetensors_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors file; send a directory of safetensors weights")
    for file in files:
        check_safetensors_file(file)


def _read_ready_version(path: Path, version: int) -> dict:
    """The tensors of a `rl_core.weights.filesystem` version directory, checked: its name is
    the version's, its READY marker exists and its files have the marker's sizes."""
    from rl_core.weights.filesystem import read_version, version_dir

    expected = version_dir(path.parent, version)
    if path.name != expected.name:
        raise ValueError(f"path {str(path)!r} is not the directory of weight version {version} (expected a directory "
                         f"named {expected.name!r}, as rl_core.weights.filesystem writes); send that version's "
                         "directory, or require_marker: false for a plain HF directory")
    return read_version(path.parent, version)


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except ApiError as exc:
            yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.type}})}\n\n"
        except (ValueError, GenerationError) as exc:
            kind = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
            yield f"data: {json.dumps({'error': {'message': str(exc), 'type': kind}})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(backend: NativeBackend, tokenizer: Any, settings: ServerSettings) -> FastAPI:
    """The FastAPI app; it starts the backend on startup and shuts it down on exit."""
    server = Server(backend, tokenizer, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        freeze_setup_objects()  # the engine's loop then never waits on a full scan of the model's objects
        try:
            yield
        finally:
            unfreeze()
            await backend.shutdown()

    app = FastAPI(title="rl_core native engine", lifespan=lifespan)
    app.state.server = server

    def count(status: int) -> None:
        server.counters["server_errors" if status >= 500 else "client_errors"] += 1

    install_error_handlers(app, count)  # the shape of every error, shared with the session server
    app.add_middleware(BodyLimit, limit=lambda: server.limits.body_bytes, count=count)

    @app.get("/health")
    async def health():
        return server.health()

    api = APIRouter(dependencies=[Depends(server.check_token)])

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "rl_core",
                "max_model_len": settings.max_model_len}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != settings.model_name:
            raise ApiError(404, f"model {model_id!r} is not served here; this server serves "
                                f"{settings.model_name!r} (see GET /v1/models)", param="model",
                           code="model_not_found")
        return model_card()

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @api.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @api.get("/rl/weight_version")
    async def weight_version():
        return {"weight_version": backend.weight_version}

    @api.get("/rl/metrics")
    async def metrics():
        return {**backend.metrics(), **{f"server_{k}": float(v) for k, v in server.counters.items()}}

    # the control routes: off unless --managed, then the launch's secret (checked before the body is validated)
    control = APIRouter(dependencies=[Depends(server.check_token), Depends(server.check_control)])

    @control.post("/rl/update_weights")
    async def update_weights(body: UpdateWeightsRequest):
        return await server.update_weights(body)

    @control.post("/rl/init_weight_broadcast")
    async def init_weight_broadcast(body: WeightGroupRequest):
        return await server.init_weight_broadcast(body)

    @control.post("/rl/receive_weights")
    async def receive_weights(body: ReceiveWeightsRequest):
        return await server.receive_weights(body)

    @control.post("/rl/abort")
    async def abort(body: AbortRequest):
        ids = list(server.inflight) if body.all else body.request_ids
        return {"aborted": await server.abort(ids)}

    @control.post("/rl/invalidate_kv_cache")
    async def invalidate():
        await backend.invalidate_kv_cache()
        return {"ok": True}

    app.include_router(api)
    app.include_router(control)
    return app
