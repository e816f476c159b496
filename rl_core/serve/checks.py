"""Request checks shared by `rl-core serve` and the session server of agent episodes.

Owns: the error both answer (`ApiError`: `{"error": {message, type, param, code}}`, 4xx for
what the client sent), their error handlers (`install_error_handlers`: a body that is not
JSON, a field that fails its schema, an unknown route, an unexpected exception: never a
plain-text page), and the limits of one request, checked before anything is tokenized or
queued (`RequestLimits`): body bytes (`BodyLimit`), chat messages, characters of text
against the context (a text longer than the context times the vocabulary's longest token
cannot fit), token ids inside the vocabulary, prompt and `max_tokens` against the context.

Does not own: the routes (app.py, rl_core.rollout.session_server), request schemas
(protocol.py). Read more: docs/generation.md, "Serving and security" (limits and errors);
docs/agents.md, "What the endpoint accepts".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rl_core.serve.protocol import param_of

MIN_BODY_BYTES = 32 * 2**20  # every body may be this large; more only where the context needs it
JSON_BYTES_PER_TOKEN = 64  # a token id as JSON, or a message's keys, with room to spare
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


class ApiError(Exception):
    """An error answer: its status, message, `type`, the field it is about (`param`) and `code`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def invalid_body(errors: Sequence[dict]) -> ApiError:
    """The 400 of a body that failed validation: not JSON (`code: invalid_json`, param null),
    else each failing field with what was received (param: the field)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = str(errors[0].get("ctx", {}).get("error", ""))[:100]
        return ApiError(400, f"the request body is not valid JSON ({detail}); send a JSON object", code="invalid_json")
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "extra_forbidden":
            parts.append(f"{loc}: unknown field (not part of this API; leave it out) (got {short(e.get('input'))})")
        elif e.get("type") == "value_error" and not loc:  # a check across fields: the message names them
            parts.append(str(e.get("msg")).removeprefix("Value error, "))
        else:
            parts.append(f"{loc or 'body'}: {e.get('msg')} (got {short(e.get('input'))})")
    return ApiError(400, "invalid request: " + "; ".join(parts)[:1000], param=param_of(list(errors)))


def parse_body(raw: bytes, model: type[BaseModel]) -> Any:
    """A JSON body read as FastAPI reads a route's body (`json.loads`, then the model), its
    errors as `invalid_body` words them: for a route that checks something before the body."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise invalid_body([{"type": "json_invalid", "ctx": {"error": getattr(exc, "msg", str(exc))}}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_body(exc.errors()) from None


def install_error_handlers(app: FastAPI, count: Callable[[int], None]) -> None:
    """Every error of `app` in the documented shape; `count(status)` is called for each."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        count(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        err = invalid_body(exc.errors())
        count(err.status)
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # unknown route, wrong method, ...
        what = {404: f"no route {request.url.path}: see GET /v1/models and the API's routes",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        count(exc.status_code)
        response = ApiError(exc.status_code, what, code=_HTTP_CODES.get(exc.status_code)).response()
        response.headers.update(exc.headers or {})  # e.g. 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # JSON, never starlette's plain-text 500
        err = unexpected(exc)
        count(err.status)
        return err.response()


def unexpected(exc: Exception) -> ApiError:
    """The 500 answer of an unexpected exception."""
    return ApiError(500, f"internal server error: {type(exc).__name__}: {str(exc)[:300]}", type="server_error")


def body_too_large(size: str, limit: int) -> ApiError:
    """The 413 answer of a body over `limit` bytes (`size`: what it has, as said to the client)."""
    return ApiError(413, f"the request body has {size} bytes; this server takes at most {limit} (more than any "
                         "prompt that fits its context needs); send a smaller body", param="body",
                    code="body_too_large")


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token (as the vocabulary spells it, which is at
    least as long as the text it stands for): no token covers more text than this."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(t) for t in vocab), default=64)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold, from the model's context (`max_model_len`, None: unknown),
    its vocabulary, the longest token in characters and the prompts a request may carry."""

    max_model_len: int | None
    vocab_size: int | None
    token_chars: int
    max_prompts: int = 1

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int | None, vocab_size: int | None,
           max_prompts: int = 1) -> RequestLimits:
        return cls(max_model_len, vocab_size, longest_token_chars(tokenizer), max_prompts)

    @property
    def max_chars(self) -> int | None:
        """The longest text that can still fit the context."""
        return None if self.max_model_len is None else self.max_model_len * self.token_chars

    @property
    def body_bytes(self) -> int:
        """The largest body: MIN_BODY_BYTES, or what `max_prompts` prompts at the context need
        (each character JSON-escaped)."""
        if self.max_model_len is None:
            return MIN_BODY_BYTES
        per_prompt = self.max_model_len * (6 * self.token_chars + JSON_BYTES_PER_TOKEN)
        return max(MIN_BODY_BYTES, self.max_prompts * per_prompt)

    def context_note(self) -> str:
        return (f"this server's context is {self.max_model_len} tokens and no token of this vocabulary is longer "
                f"than {self.token_chars} characters")

    def check_text(self, text: str, param: str) -> None:
        """A text prompt that cannot fit the context is refused before it is tokenized."""
        if self.max_chars is not None and len(text) > self.max_chars:
            raise ApiError(400, f"{param} has {len(text)} characters; {self.context_note()}, so at most "
                                f"{self.max_chars} characters can fit (shorten it)", param=param)

    def check_messages(self, messages: Sequence[dict], tools: Sequence[Any] | None = None) -> None:
        """Chat messages that cannot fit the context (more messages than its tokens, or more
        text than it can hold) are refused before the chat template runs."""
        if self.max_model_len is None:
            return
        if len(messages) > self.max_model_len:
            raise ApiError(400, f"messages holds {len(messages)} messages; this server's context is "
                                f"{self.max_model_len} tokens and every message takes at least one, so at most "
                                f"{self.max_model_len} can fit (send fewer messages)", param="messages")
        sizes = [text_chars(m) for m in messages]
        total = sum(sizes) + (text_chars(list(tools)) if tools else 0)
        if total > self.max_chars:
            i = max(range(len(sizes)), key=sizes.__getitem__)
            param = f"messages.{i}.content" if sizes[i] > self.max_chars else "messages"
            raise ApiError(400, f"the messages hold {total} characters of text ({param}: {sizes[i]}); "
                                f"{self.context_note()}, so at most {self.max_chars} can fit (shorten them)",
                           param=param)

    def check_prompt_ids(self, ids: Sequence[int], index: int = 0) -> None:
        """A prompt's token ids: not empty, inside the vocabulary, leaving room in the context."""
        if not ids:
            raise ApiError(400, "a prompt encodes to zero tokens; send a non-empty prompt", param="prompt")
        vocab = self.vocab_size
        if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
            bad = [t for t in ids if not 0 <= t < vocab][:5]
            raise ApiError(400, f"prompt {index} holds token ids {bad} outside [0, {vocab}) (this model's "
                                "vocabulary)", param="prompt")
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            raise ApiError(400, f"prompt {index} has {len(ids)} tokens; this server's context is {self.max_model_len} "
                                "tokens (prompt + at least one new token: shorten the prompt)", param="prompt")

    def check_max_tokens(self, max_tokens: int | None, field: str) -> None:
        if max_tokens is not None and self.max_model_len is not None and max_tokens > self.max_model_len:
            raise ApiError(400, f"{field} is {max_tokens}; this server's context is {self.max_model_len} tokens "
                                "(prompt + completion), so no completion can be that long. Send at most "
                                f"{self.max_model_len} (a completion that reaches the context ends with "
                                "finish_reason 'length')", param=field)

    def check_stop_ids(self, stop_token_ids: Sequence[int]) -> None:
        vocab = self.vocab_size
        if vocab is not None and any(not 0 <= t < vocab for t in stop_token_ids):
            bad = [t for t in stop_token_ids if not 0 <= t < vocab][:5]
            raise ApiError(400, f"stop_token_ids holds {bad}, outside [0, {vocab}) (this model's vocabulary)",
                           param="stop_token_ids")


def text_chars(value: Any) -> int:
    """Characters of the text in a message (its strings, keys included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(k)) + text_chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return len(json.dumps(value, default=str))


class BodyLimit:
    """ASGI middleware: a body over `limit()` bytes is answered 413 (param `body`) before it is
    read whole (a declared Content-Length) or as soon as it passes the limit (chunked)."""

    def __init__(self, app: Any, limit: Callable[[], int], count: Callable[[int], None] = lambda status: None):
        self.app, self.limit, self.count = app, limit, count

    async def _refuse(self, send: Any, size: str, limit: int) -> None:
        self.count(413)
        body = body_too_large(size, limit).response().body
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, declared.decode(), limit)
        seen, over = 0, False

        async def capped() -> dict:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    raise ApiError(413, "body too large", param="body")
            return message

        async def guarded(message: dict) -> None:
            if not over:
                await send(message)

        try:
            await self.app(scope, capped, guarded)
        except Exception:
            if not over:
                raise
        if over:
            await self._refuse(send, f"more than {limit}", limit)
