"""The agents' OpenAI client (`rl_core.envs.openai_client.AgentClient`) sends the same requests and
returns the same answers as a stock `openai.AsyncOpenAI`, call for call: plain calls (which skip
openai's body transform) and every other kind (positional, generators, tuples, omitted markers,
`stream`, unknown or missing arguments: openai's own `create`), through raw responses and
`with_options` copies; and the transform check refuses a request type with an aliased or
formatted field."""

from __future__ import annotations

import asyncio
import json
from typing import Iterable

import httpx
import openai
import pytest
from openai._utils import PropertyInfo
from typing_extensions import Annotated, Required, TypedDict

from rl_core.envs.openai_client import AgentClient, AgentCompletions, plain, transform_free

ANSWER = {"id": "chatcmpl-e0-1", "object": "chat.completion", "created": 7, "model": "policy",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "46"}, "logprobs": None,
                       "finish_reason": "stop", "token_ids": [5, 6, 2], "prompt_token_ids": [1, 2, 3],
                       "weight_version": 4}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                          "required": ["a"]}}}]
TURNS = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "12+34="},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "46"},
         {"role": "user", "content": [{"type": "text", "text": "and +1?"}]}]

PLAIN_CALLS = [
    {"model": "policy", "messages": [{"role": "user", "content": "12+34="}]},
    {"model": "policy", "messages": TURNS, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 8, "stop": ["\n", "."],
     "temperature": None, "stream": False, "logprobs": True, "logit_bias": {"5": -100}, "metadata": {"k": "v"},
     "response_format": {"type": "text"}, "n": 1, "seed": None, "user": "u", "top_p": 1.0},
    {"model": "policy", "messages": TURNS[:2], "stream": None, "max_completion_tokens": 4,
     "extra_body": {"top_k": 5, "min_p": 0.1}, "extra_headers": {"X-Trace": "t1"}, "extra_query": {"q": "1"},
     "timeout": 30.0},
]


def other_calls():
    """Calls that are not plain: openai's own `create` takes them (built fresh: a generator is used up)."""
    return [
        {"model": "policy", "messages": ({"role": "user", "content": "12+34="},)},  # a tuple
        {"model": "policy", "messages": (m for m in TURNS[:2])},  # a generator
        {"model": "policy", "messages": TURNS[:2], "max_tokens": openai.omit, "temperature": openai.NOT_GIVEN},
        {"model": "policy", "messages": [{"role": "user", "content": "x", "name": openai.omit}]},
        {"model": "policy", "messages": TURNS[:2], "stop": ("\n",)},
    ]


class Recorder(httpx.AsyncBaseTransport):
    """Records each request and answers `ANSWER` (the session server's chat answer shape)."""

    def __init__(self):
        self.requests: list[httpx.Request] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        self.requests.append(request)
        return httpx.Response(200, headers={"content-type": "application/json"}, content=json.dumps(ANSWER).encode())


def seen(request: httpx.Request) -> tuple:
    """What the server sees of a request: method, URL, headers (but the per-process platform ones) and JSON body."""
    headers = sorted((k, v) for k, v in request.headers.items() if k not in ("content-length",))
    return request.method, str(request.url), headers, json.loads(request.content)


def both(make_call, *, via: str = "create") -> tuple:
    """The requests seen and the answers returned for the call `make_call()` by a stock client and by an
    `AgentClient` (each given a call of its own: a generator is used up by the first)."""
    async def main():
        out = []
        for cls in (openai.AsyncOpenAI, AgentClient):
            call = make_call()
            rec = Recorder()
            async with httpx.AsyncClient(transport=rec, timeout=None) as http:
                client = cls(base_url="http://127.0.0.1:1/sessions/e0-ab/v1", api_key="key-0", max_retries=0,
                             http_client=http)
                completions = client.chat.completions
                if via == "raw":
                    answer = (await completions.with_raw_response.create(**call)).parse()
                elif via == "copy":
                    answer = await client.with_options(timeout=5.0).chat.completions.create(**call)
                else:
                    answer = await completions.create(**call)
                out.append(([seen(r) for r in rec.requests], answer.model_dump(), type(answer)))
        return out

    return tuple(asyncio.run(main()))


@pytest.mark.parametrize("i", range(len(PLAIN_CALLS)))
@pytest.mark.parametrize("via", ["create", "raw", "copy"])
def test_plain_calls_send_and_return_what_openai_does(i, via):
    call = PLAIN_CALLS[i]
    assert all(plain(v) for k, v in call.items() if not k.startswith("extra_") and k != "timeout")
    stock, ours = both(lambda: call, via=via)
    assert len(stock[0]) == 1
    assert ours == stock
    assert ours[1]["choices"][0]["token_ids"] == [5, 6, 2]  # the session's extra fields reach the agent


@pytest.mark.parametrize("i", range(len(other_calls())))
def test_other_calls_go_through_openais_create(i):
    assert not all(plain(v) for v in other_calls()[i].values())
    stock, ours = both(lambda: other_calls()[i])
    assert len(stock[0]) == 1
    assert ours == stock


def test_refusals_are_openais():
    async def main():
        errors = []
        for cls in (openai.AsyncOpenAI, AgentClient):
            async with httpx.AsyncClient(transport=Recorder(), timeout=None) as http:
                client = cls(base_url="http://127.0.0.1:1/v1", api_key="k", max_retries=0, http_client=http)
                for call in ({"model": "policy"}, {"model": "policy", "messages": [], "not_a_field": 1}):
                    with pytest.raises(TypeError) as info:
                        await client.chat.completions.create(**call)
                    errors.append(str(info.value))
        return errors

    errors = asyncio.run(main())
    assert errors[:2] == errors[2:]


def test_the_client_is_a_real_openai_client():
    client = AgentClient(base_url="http://127.0.0.1:1/v1", api_key="k", max_retries=0)
    assert isinstance(client, openai.AsyncOpenAI)
    assert isinstance(client.chat.completions, AgentCompletions)
    assert isinstance(client.with_options(timeout=1.0).chat.completions, AgentCompletions)


class Aliased(TypedDict, total=False):
    name: Required[Annotated[str, PropertyInfo(alias="Name")]]


class Nested(TypedDict, total=False):
    items: Iterable[Aliased]


class Formatted(TypedDict, total=False):
    when: Annotated[str, PropertyInfo(format="iso8601")]


class Free(TypedDict, total=False):
    kind: Annotated[str, PropertyInfo(discriminator="type")]
    items: Iterable["Free"]


def test_transform_check():
    from openai.types.chat import completion_create_params

    assert transform_free(completion_create_params.CompletionCreateParamsNonStreaming)
    assert not transform_free(Aliased) and not transform_free(Nested) and not transform_free(Formatted)
    assert transform_free(Free)  # a discriminator is not a transform; the self reference ends


def test_plain():
    assert plain({"a": [1, 2.0, "x", None, True, {"b": []}]})
    for value in [(1,), {1: "a"}, openai.omit, openai.NOT_GIVEN, b"x", {"a": (1,)}, iter([1])]:
        assert not plain(value), value


def test_plain_calls_skip_the_transform_and_others_take_it(monkeypatch):
    import openai.resources.chat.completions.completions as stock

    transformed = []
    real = stock.async_maybe_transform

    async def counting(data, expected_type):
        transformed.append(expected_type)
        return await real(data, expected_type)

    monkeypatch.setattr(stock, "async_maybe_transform", counting)  # this test's counter only
    both(lambda: PLAIN_CALLS[1])
    assert len(transformed) == 1  # the stock client's call alone
    both(lambda: other_calls()[1])
    assert len(transformed) == 3  # both clients' calls
