"""The agents' OpenAI client: a real `openai.AsyncOpenAI`, less the per-call work a plain call does not need.

Owns: `AgentClient`, the `openai.AsyncOpenAI` subclass rl_core hands each agent episode
(rl_core.envs.agent). Its `chat.completions.create`, for a call whose arguments are plain JSON
values (str, int, float, bool, None, lists, dicts with str keys; `plain`), posts them through the
client's own `post` with the options openai's `create` builds, skipping openai's per-call typed
`transform` of the body (most of a call's time: docs/benchmarks.md): that transform only renames
aliased keys, formats dates and files, dumps pydantic models and turns other iterables into lists,
and on plain values whose request type has no aliased or formatted field (`transform_free`,
checked once against the installed openai's types) it returns an equal body. Every other call
(positional, unknown or missing arguments, `stream: true`, any other value) is openai's own
`create`, unchanged; the request and the answer are the same either way
(tests/unit/test_agent_openai_client.py). Does not own: the episode (rl_core.envs.agent), the
transport (rl_core.rollout.session_server). Guide: docs/agents.md.
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any

import openai
import typing_extensions
from openai._base_client import make_request_options
from openai._streaming import AsyncStream
from openai.resources.chat import AsyncChat
from openai.resources.chat.completions import AsyncCompletions
from openai.types.chat import ChatCompletion, ChatCompletionChunk, completion_create_params

OPTION_ARGS = ("extra_headers", "extra_query", "extra_body", "timeout")  # request options, not body fields
CREATE_ARGS = frozenset(n for n in inspect.signature(AsyncCompletions.create).parameters if n != "self")


def plain(value: Any) -> bool:
    """Whether `value` is plain JSON: str, int, float, bool or None, or lists and str-keyed dicts of those
    (exact types: a subclass, tuple, generator, model or omitted marker is not)."""
    t = type(value)
    if t is str or t is int or t is float or t is bool or value is None:
        return True
    if t is list:
        return all(plain(v) for v in value)
    if t is dict:
        return all(type(k) is str and plain(v) for k, v in value.items())
    return False


def transform_free(tp: Any, _seen: set | None = None) -> bool:
    """Whether openai's request transform leaves plain values of type `tp` as they are: no field in
    `tp`, through TypedDicts, unions and containers, is `Annotated` with an alias or a format (what
    `openai._utils.PropertyInfo` asks the transform for); an unresolved forward reference counts
    as not free."""
    seen = set() if _seen is None else _seen
    if isinstance(tp, (str, typing.ForwardRef)):
        return False
    try:
        if tp in seen:
            return True
        seen.add(tp)
    except TypeError:  # an unhashable annotation: walk it, without the cycle check
        pass
    if typing_extensions.is_typeddict(tp):
        hints = typing_extensions.get_type_hints(tp, include_extras=True)
        return all(transform_free(h, seen) for h in hints.values())
    origin = typing_extensions.get_origin(tp)
    if origin is typing_extensions.Annotated:
        if any(getattr(m, "alias", None) is not None or getattr(m, "format", None) is not None
               for m in tp.__metadata__):
            return False
        return transform_free(tp.__origin__, seen)
    if origin is typing.Literal or origin is typing_extensions.Literal:
        return True
    return all(transform_free(a, seen) for a in typing_extensions.get_args(tp))


@functools.lru_cache(maxsize=None)
def _create_transform_free() -> bool:
    """`transform_free` of the chat request type, once; a type it cannot read counts as not free."""
    try:
        return transform_free(completion_create_params.CompletionCreateParamsNonStreaming)
    except Exception:  # noqa: BLE001 - then every call is openai's own create
        return False


class AgentCompletions(AsyncCompletions):
    """`chat.completions` of an `AgentClient` (see the module doc)."""

    async def create(self, *args: Any, **kwargs: Any):
        stream = kwargs.get("stream")
        if (args or stream or "messages" not in kwargs or "model" not in kwargs
                or not kwargs.keys() <= CREATE_ARGS or not _create_transform_free()
                or not all(plain(v) for k, v in kwargs.items() if k not in OPTION_ARGS)):
            return await super().create(*args, **kwargs)
        body = {k: v for k, v in kwargs.items() if k not in OPTION_ARGS}
        options = make_request_options(extra_headers=kwargs.get("extra_headers"),
                                       extra_query=kwargs.get("extra_query"),
                                       extra_body=kwargs.get("extra_body"),
                                       timeout=kwargs.get("timeout", openai.NOT_GIVEN),
                                       security={"bearer_auth": True})
        return await self._post("/chat/completions", body=body, options=options, cast_to=ChatCompletion,
                                stream=False, stream_cls=AsyncStream[ChatCompletionChunk])


class AgentChat(AsyncChat):
    """`chat` of an `AgentClient`: its `completions` is `AgentCompletions`."""

    @functools.cached_property
    def completions(self) -> AgentCompletions:
        return AgentCompletions(self._client)


class AgentClient(openai.AsyncOpenAI):
    """An `openai.AsyncOpenAI` whose `chat.completions.create` skips the body transform where it
    changes nothing (see the module doc); the rest is openai's."""

    @functools.cached_property
    def chat(self) -> AgentChat:
        return AgentChat(self)

    @property
    def user_agent(self) -> str:
        """The stock client's (openai names it after the client's class)."""
        return f"{openai.AsyncOpenAI.__name__}/Python {self._version}"
