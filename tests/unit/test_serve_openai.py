"""`rl-core serve` as a real subprocess, driven by the official `openai` client (completions,
chat, streaming, logprobs, token ids) and by httpx for the RL endpoints (weight versions,
abort, KV invalidation); answers are checked against the native engine run in-process on
the same model directory. Bound off loopback, the server rejects missing or wrong tokens,
and it refuses to start there without one."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time

import httpx
import numpy as np
import openai
import pytest
import torch
from tests.helpers.serving import (CONTROL, TOKEN_ENV, engine_results, make_model, make_model_dir, make_tokenizer,
                                   running_server, serve_command)

from rl_core.types import GenerationRequest, SamplingParams
from rl_core.weights.filesystem import FilesystemWeightSync, version_dir

pytestmark = pytest.mark.timeout(600)
SERVER_ARGS = ("--max-batch-size", "8")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model") / "tiny-chat")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    with running_server(model_dir, tmp_path_factory.mktemp("server"), *SERVER_ARGS, managed=True) as (url, proc):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="not-checked-on-loopback", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def engine_run(model_dir, requests, state_dict=None) -> dict:
    """The same requests through an in-process engine (the reference)."""
    return engine_results(model_dir, requests, 8, state_dict)  # the server's --max-batch-size


# ---------------------------------------------------------------------- OpenAI API


def test_models_and_completion_match_the_engine(client, model_dir, tokenizer):
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("gpt-4")
    prompt = "The quick brown fox"
    resp = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                                     extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    ref = engine_run(model_dir, [GenerationRequest("r", ids, SamplingParams(greedy=True, max_tokens=12))])["r"]
    extra = choice.model_extra
    assert extra["prompt_token_ids"] == ids and extra["token_ids"] == ref.token_ids
    assert extra["start_version"] == 0 and extra["token_versions"] == [0] * len(ref.token_ids)
    assert choice.text == tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    assert choice.finish_reason == ref.finish_reason
    assert torch.allclose(torch.tensor(choice.logprobs.token_logprobs), torch.tensor(ref.logprobs), atol=1e-4)
    assert len(choice.logprobs.tokens) == len(ref.token_ids)
    for chosen, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) >= chosen - 1e-6
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == len(ref.token_ids)


def test_token_id_prompts_n_choices_and_seeds(client, model_dir):
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    kwargs = dict(model="tiny-chat", prompt=prompts, n=2, max_tokens=10, temperature=1.0, seed=7,
                  extra_body={"return_token_ids": True})
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    tokens = [c.model_extra["token_ids"] for c in first.choices]
    assert tokens == [c.model_extra["token_ids"] for c in again.choices]  # seeded: reproducible
    assert tokens[0] != tokens[1]  # choice i uses seed + i
    ref = engine_run(model_dir, [GenerationRequest(f"{p}/{i}", prompts[p], SamplingParams(max_tokens=10, seed=7 + i))
                                 for p in range(2) for i in range(2)])
    assert tokens == [ref[f"{p}/{i}"].token_ids for p in range(2) for i in range(2)]
    assert first.usage.prompt_tokens == 7


def test_seeds_per_choice_and_packed_token_arrays(client, model_dir):
    # the rl_core extensions HttpBackend sends a prompt group with: `seeds` (choice i samples with
    # seeds[i]) and `return_token_arrays` (ids, logprobs, versions packed; no text)
    seeds = [3, (1 << 62) + 11, 5]
    base = dict(model="tiny-chat", prompt=[5, 6, 7, 8], n=3, max_tokens=10, temperature=1.0)
    lists = client.completions.create(**base, logprobs=0, extra_body={"return_token_ids": True, "seeds": seeds})
    packed = client.completions.create(**base, extra_body={"seeds": seeds, "return_token_arrays": True})
    ref = engine_run(model_dir, [GenerationRequest(f"s{i}", base["prompt"], SamplingParams(max_tokens=10, seed=seed))
                                 for i, seed in enumerate(seeds)])
    for i, (a, b) in enumerate(zip(lists.choices, packed.choices)):
        extra = b.model_extra
        ids = np.frombuffer(bytes.fromhex(extra["token_ids_i32"]), dtype="<i4").tolist()
        lps = np.frombuffer(bytes.fromhex(extra["token_logprobs_f32"]), dtype="<f4")
        assert ids == a.model_extra["token_ids"] == ref[f"s{i}"].token_ids
        assert np.array_equal(lps, np.asarray(a.logprobs.token_logprobs, dtype=np.float32))  # float32: exact
        assert (extra["start_version"], extra["end_version"]) == (0, 0) and "token_versions" not in extra
        assert b.index == i and b.finish_reason == a.finish_reason and b.text is None and b.logprobs is None
    assert len({tuple(c.model_extra["token_ids"]) for c in lists.choices}) == 3
    assert packed.usage.completion_tokens == lists.usage.completion_tokens


def test_packed_choice_carries_its_versions_when_the_weights_changed_during_it():
    from rl_core.generation.http.backend import HttpBackend
    from rl_core.generation.http.fleet import Endpoint
    from rl_core.serve.protocol import packed_choice
    from rl_core.types import GenerationResult

    res = GenerationResult("r", [1], [7, 150000, 3], [-0.5, -1.25, -3.0], "length", 2, 3, token_versions=[2, 3, 3])
    choice = {"index": 0, "finish_reason": "length", **json.loads(json.dumps(packed_choice(res)))}
    assert choice["token_versions"] == [2, 3, 3] and (choice["start_version"], choice["end_version"]) == (2, 3)
    ids, lps = HttpBackend._columns(Endpoint("http://x"), choice)
    assert ids.dtype == np.int64 and ids.tolist() == [7, 150000, 3] and lps.tolist() == [-0.5, -1.25, -3.0]
    assert "token_versions" not in packed_choice(GenerationResult("r", [1], [7], [-0.5], "stop", 4, 4, token_versions=[4]))


def test_chat_completion_uses_the_chat_template(client, model_dir, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    resp = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert choice.model_extra["prompt_token_ids"] == list(ids)
    ref = engine_run(model_dir, [GenerationRequest("c", list(ids), SamplingParams(greedy=True, max_tokens=8))])["c"]
    assert choice.model_extra["token_ids"] == ref.token_ids
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    records = choice.logprobs.content
    assert [r.token for r in records] == [tokenizer.decode([t]) for t in ref.token_ids]
    assert torch.allclose(torch.tensor([r.logprob for r in records]), torch.tensor(ref.logprobs), atol=1e-4)
    assert all(len(r.top_logprobs) == 2 and r.top_logprobs[0].logprob >= r.logprob - 1e-6 for r in records)
    assert bytes(records[0].bytes).decode("utf-8", "replace") == records[0].token


def test_streaming_matches_non_streaming(client):
    kwargs = dict(model="tiny-chat", prompt="Once upon a time", max_tokens=20, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, logprobs=0,
                                            **kwargs))
    assert len(chunks) > 3
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    streamed_lp = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert len(streamed_lp) == 20
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices

    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_stop_strings_end_the_choice_and_are_not_returned(client):
    base = client.completions.create(model="tiny-chat", prompt="The dog", max_tokens=40, temperature=0).choices[0].text
    start = next(i for i in range(8, len(base) - 2) if "\ufffd" not in base[i:i + 2] and base[i:i + 2].strip())
    stop = base[start:start + 2]
    cut = base[:base.find(stop)]
    resp = client.completions.create(model="tiny-chat", prompt="The dog", max_tokens=40, temperature=0, stop=[stop])
    assert (resp.choices[0].text, resp.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model="tiny-chat", prompt="The dog", max_tokens=40, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut


def test_bad_requests_name_the_field(client):
    with pytest.raises(openai.BadRequestError, match="foo"):
        client.completions.create(model="tiny-chat", prompt="x", extra_body={"foo": 1})
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny-chat", prompt="x", presence_penalty=0.5)
    with pytest.raises(openai.NotFoundError, match="tiny-chat"):
        client.completions.create(model="gpt-99", prompt="x")
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny-chat", prompt=[5] * 600)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny-chat", prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        client.completions.create(model="tiny-chat", prompt=[10**6])
    with pytest.raises(openai.BadRequestError, match="vocabulary"):  # refused before the stream starts
        client.completions.create(model="tiny-chat", prompt=[10**6], stream=True)


# ---------------------------------------------------------------------- RL endpoints


def test_abort_frees_the_engine_and_returns_the_partial_choice(server):
    with httpx.Client(base_url=server, timeout=60) as http:
        body = {"prompt": [5, 6, 7], "max_tokens": 450, "temperature": 1.0, "seed": 3, "stream": True,
                "request_id": "long", "return_token_ids": True}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"finish_reason": null' in first
            assert http.post("/rl/abort", json={"request_ids": ["long"]}, headers=CONTROL).json() == {"aborted": 1}
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        final = httpx.Response(200, content=rest[-2][6:]).json()["choices"][0]
        assert final["finish_reason"] == "abort"
        assert http.get("/health").json()["running"] == 0  # the slot was freed at once
        # a client that disconnects aborts its (non-streaming) request too
        before = http.get("/rl/metrics").json()["requests_aborted"]
        with pytest.raises(httpx.ReadTimeout):
            # 32 sampled choices: the request cannot end (every choice at its end token) before the
            # server's disconnect poll sees the closed connection
            http.post("/v1/completions", json={**body, "stream": False, "request_id": "gone", "n": 32}, timeout=0.3)
        deadline = time.monotonic() + 10
        while http.get("/rl/metrics").json()["requests_aborted"] == before:
            assert time.monotonic() < deadline, "the disconnected request was not aborted"
            time.sleep(0.05)
        assert http.post("/rl/invalidate_kv_cache", headers=CONTROL).json() == {"ok": True}
        assert http.get("/rl/metrics").json()["kv_invalidations"] >= 1


def test_update_weights_changes_the_served_version_and_outputs(server, model_dir, tmp_path):
    tokenizer = make_tokenizer()
    new = make_model(tokenizer, seed=1)
    sync = FilesystemWeightSync(tmp_path / "weights")
    sync.write(1, new.state_dict())
    v1 = version_dir(tmp_path / "weights", 1)
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    with httpx.Client(base_url=server, timeout=60, headers=CONTROL) as http:
        before = http.post("/v1/completions", json=body).json()["choices"][0]
        assert http.get("/rl/weight_version").json() == {"weight_version": 0}
        bad = http.post("/rl/update_weights", json={"version": 2, "path": str(v1)})
        assert bad.status_code == 400 and "v000000002" in bad.json()["error"]["message"]
        bad = http.post("/rl/update_weights", json={"version": 1, "path": str(model_dir)})
        assert bad.status_code == 400 and "not the directory of weight version 1" in bad.json()["error"]["message"]
        bad = http.post("/rl/update_weights", json={"version": 1, "path": str(tmp_path / "nope")})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "path"
        assert http.get("/rl/weight_version").json() == {"weight_version": 0}  # nothing changed
        ok = http.post("/rl/update_weights", json={"version": 1, "path": str(v1)})
        assert ok.status_code == 200 and ok.json()["weight_version"] == 1
        after = http.post("/v1/completions", json=body).json()["choices"][0]
        assert after["token_versions"] == [1] * 10 and after["start_version"] == 1
        ref = engine_run(model_dir, [GenerationRequest("r", body["prompt"], SamplingParams(greedy=True, max_tokens=10))],
                         state_dict=new.state_dict())["r"]
        assert after["token_ids"] == ref.token_ids != before["token_ids"]
        # back to the original weights (a plain HF directory, no marker) for the other tests
        ok = http.post("/rl/update_weights", json={"version": 0, "path": str(model_dir), "require_marker": False})
        assert ok.status_code == 200
        assert http.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == before["token_ids"]


# ---------------------------------------------------------------------- auth


def test_off_loopback_the_server_requires_its_token(model_dir, tmp_path):
    token = "s3cret-test-token"
    with running_server(model_dir, tmp_path, "--host", "0.0.0.0", *SERVER_ARGS, token=token) as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200  # health stays open
        for key in ("wrong-token", ""):
            bad = openai.OpenAI(base_url=f"{url}/v1", api_key=key or "x", max_retries=0)
            headers = {} if key else {"Authorization": ""}
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model="tiny-chat", prompt="x", max_tokens=2, extra_headers=headers)
        assert httpx.post(f"{url}/rl/abort", json={"all": True}).status_code == 401
        good = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0)
        assert good.completions.create(model="tiny-chat", prompt="x", max_tokens=2).choices[0].finish_reason


def test_off_loopback_without_a_token_it_refuses_to_start(model_dir, tmp_path):
    cmd = serve_command(model_dir, tmp_path / "ready.json", "--host", "0.0.0.0")
    env = {k: v for k, v in __import__("os").environ.items() if k != TOKEN_ENV}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert TOKEN_ENV in done.stderr and "0.0.0.0" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "ready.json").exists()


def test_concurrent_clients_are_batched(client):
    """Many concurrent requests through one server: all answered, and the engine batched them."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(client.completions.create, model="tiny-chat", prompt=[5, 6, i], max_tokens=30,
                               temperature=1.0, seed=i) for i in range(16)]
        results = [f.result() for f in futures]
    assert all(r.usage.completion_tokens == 30 for r in results)
    metrics = httpx.get(str(client.base_url).replace("/v1/", "") + "/rl/metrics").json()
    assert metrics["mean_batch_size"] > 1.0
