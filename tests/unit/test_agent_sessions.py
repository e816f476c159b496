"""Episode sessions (rl_core.rollout.sessions) and their HTTP front (session_server), driven
by the real `openai` client: token identity across turns, segments when an agent rewrites
its history, the field policy, auth, ended sessions, and aborts of in-flight calls."""

from __future__ import annotations

import asyncio

import openai
import pytest

from rl_core.model.tokenizer import build_tokenizer
from rl_core.rollout.session_server import SessionServer, parse_tool_calls
from rl_core.rollout.sessions import SessionClosed, SessionRegistry
from rl_core.types import GenerationResult, SamplingParams

EXAMPLES = [{"prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"[::-1]} for a in range(0, 99, 7) for b in (3, 45)]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(EXAMPLES, 300)


class ScriptedBackend:
    """Answers each request with the next scripted text + <|im_end|>, recording what it got."""

    def __init__(self, tok, replies, delay_s=0.0):
        self.tok, self.replies, self.delay_s = tok, list(replies), delay_s
        self.requests, self.cancelled = [], []
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    async def generate(self, request):
        self.requests.append(request)
        if self.delay_s:
            try:
                await asyncio.sleep(self.delay_s)
            except asyncio.CancelledError:
                self.cancelled.append(request.request_id)
                raise
        ids = list(self.tok.encode(self.replies.pop(0), add_special_tokens=False)) + [self.im_end]
        return GenerationResult(request.request_id, list(request.prompt_ids), ids, [-0.5] * len(ids), "stop", 3, 4,
                                token_versions=[3] * (len(ids) - 1) + [4])


def _session(registry, tok, backend, params=None):
    return registry.open("g0/a0/1", params or SamplingParams(max_tokens=8, seed=7), tok, backend.generate,
                         seed_for=lambda k: 100 + k)


def test_turns_reuse_the_exact_ids_and_observations_are_masked(tok):
    backend = ScriptedBackend(tok, ["250", "361"])
    registry = SessionRegistry()
    s = _session(registry, tok, backend)

    async def episode():
        msgs = [{"role": "user", "content": "07+45="}]
        ids, text = s.chat_prompt(msgs)
        r1 = await s.call(ids, text)
        msgs += [{"role": "assistant", "content": "250"}, {"role": "user", "content": "+11="}]
        ids2, text2 = s.chat_prompt(msgs)
        assert ids2[:len(ids) + len(r1.token_ids)] == ids + r1.token_ids  # the generated ids, not a re-tokenization
        await s.call(ids2, text2, max_tokens=4)

    asyncio.run(episode())
    t = s.trajectory()
    assert t.segments == 1 and t.turns == 2
    r1, r2 = backend.requests
    assert r1.params.seed == 100 and r2.params.seed == 101 and r2.params.max_tokens == 4
    gen1 = list(tok.encode("250", add_special_tokens=False)) + [backend.im_end]
    gen2 = list(tok.encode("361", add_special_tokens=False)) + [backend.im_end]
    gap = r2.prompt_ids[len(r1.prompt_ids) + len(gen1):]
    assert t.prompt_ids == r1.prompt_ids
    assert t.completion_ids == gen1 + gap + gen2
    assert t.completion_mask == [1] * len(gen1) + [0] * len(gap) + [1] * len(gen2)
    assert t.logprobs == [-0.5] * len(gen1) + [0.0] * len(gap) + [-0.5] * len(gen2)
    assert t.token_versions[len(gen1):len(gen1) + len(gap)] == [-1] * len(gap)
    assert t.turn_starts == [0, len(gen1) + len(gap)]
    assert tok.decode(gap) == "\n<|im_start|>user\n+11=<|im_end|>\n<|im_start|>assistant\n"


def test_a_rewritten_history_is_a_new_segment(tok):
    backend = ScriptedBackend(tok, ["250", "361"])
    s = _session(SessionRegistry(), tok, backend)

    async def episode():
        ids, text = s.chat_prompt([{"role": "user", "content": "07+45="}])
        await s.call(ids, text)
        # the agent edits what the model said: the prompt no longer extends the session's tokens
        ids, text = s.chat_prompt([{"role": "user", "content": "07+45="}, {"role": "assistant", "content": "999"},
                                   {"role": "user", "content": "+11="}])
        await s.call(ids, text)

    asyncio.run(episode())
    t = s.trajectory()
    assert t.segments == 2 and t.turns == 1
    assert t.prompt_ids == backend.requests[1].prompt_ids and t.completion_mask == [1] * len(t.completion_ids)


def test_closed_sessions_refuse_and_abort_in_flight_calls(tok):
    backend = ScriptedBackend(tok, ["250"], delay_s=0.2)
    registry = SessionRegistry()
    s = _session(registry, tok, backend)

    async def episode():
        ids, text = s.chat_prompt([{"role": "user", "content": "07+45="}])
        call = asyncio.ensure_future(s.call(ids, text))
        await asyncio.sleep(0.05)
        await registry.close(s)
        with pytest.raises(SessionClosed):
            await call
        with pytest.raises(SessionClosed):
            await s.call(ids, text)

    asyncio.run(episode())
    assert backend.cancelled == ["g0/a0/1/c0"]
    with pytest.raises(ValueError, match="made no model call"):
        s.trajectory()


def test_the_openai_client_drives_a_session_over_http(tok):
    backend = ScriptedBackend(tok, ["250", "361", "7"])
    registry = SessionRegistry()
    server = SessionServer(registry, tok)

    async def main():
        await server.start()
        try:
            s = _session(registry, tok, backend, SamplingParams(temperature=1.0, max_tokens=8))
            client = openai.AsyncOpenAI(base_url=server.base_url(s), api_key=s.api_key, max_retries=0)
            msgs = [{"role": "user", "content": "07+45="}]
            r = await client.chat.completions.create(model="policy", messages=msgs)
            assert r.choices[0].message.content == "250" and r.choices[0].finish_reason == "stop"
            msgs += [{"role": "assistant", "content": "250"}, {"role": "user", "content": "+11="}]
            r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=5, temperature=1.0)
            assert r.choices[0].message.content == "361"
            c = await client.completions.create(model="policy", prompt="12+34=", max_tokens=3)
            assert c.choices[0].text == "7"
            assert [m.id for m in (await client.models.list()).data] == ["policy"]
            # the field policy: the recipe's sampling governs training episodes
            for bad in ({"temperature": 0.3}, {"top_p": 0.5}, {"seed": 3}, {"n": 2}, {"stream": True}):
                with pytest.raises(openai.BadRequestError) as err:
                    await client.chat.completions.create(model="policy", messages=msgs, **bad)
                assert next(iter(bad)) in str(err.value)
            with pytest.raises(openai.BadRequestError, match="does not render tools"):
                await client.chat.completions.create(model="policy", messages=msgs, tools=[
                    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])
            wrong = openai.AsyncOpenAI(base_url=server.base_url(s), api_key="nope", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model="policy", messages=msgs)
            await registry.close(s)
            with pytest.raises(openai.NotFoundError, match="not open"):
                await client.chat.completions.create(model="policy", messages=msgs)
            t = s.trajectory()
            assert t.segments == 2 and t.turns == 1  # the text-completion call did not extend the chat
        finally:
            await server.stop()

    asyncio.run(main())
    assert backend.requests[1].params.max_tokens == 5


def test_tool_calls_are_parsed_from_the_hermes_convention():
    text, calls = parse_tool_calls('Let me add.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert text == "Let me add." and calls[0]["function"]["name"] == "add"
    assert calls[0]["function"]["arguments"] == '{"a": 1, "b": 2}'
    assert parse_tool_calls("no call here") == ("no call here", [])
    assert parse_tool_calls("<tool_call>{not json}</tool_call>")[1] == []


def test_the_calculator_example_runs_its_text_protocol_through_a_session(tok):
    # examples/agents/calculator_agent.py imports only openai; the tiny template renders no tools,
    # so the agent falls back to CALC(...) text: model asks, agent calculates, model answers
    from examples.agents.calculator_agent import calculate, calculator_agent

    assert calculate("(2+3)*4") == "20" and calculate("7/2") == "3.5" and calculate("__import__('os')").startswith("error")
    backend = ScriptedBackend(tok, ["CALC(7+45)", "52"])
    registry = SessionRegistry()
    server = SessionServer(registry, tok)

    async def main():
        await server.start()
        try:
            s = _session(registry, tok, backend, SamplingParams(max_tokens=8))
            client = openai.AsyncOpenAI(base_url=server.base_url(s), api_key=s.api_key, max_retries=0)
            reward = await calculator_agent(client, {"prompt": "What is 7 + 45?", "answer": "52"})
            await registry.close(s)
            return reward, s.trajectory()
        finally:
            await server.stop()

    reward, t = asyncio.run(main())
    assert reward == 1.0 and t.segments == 1 and t.turns == 2
    assert "= 52" in tok.decode(t.completion_ids)
