"""HttpBackend against real `rl-core serve` subprocesses: results equal the in-process engine,
least-outstanding routing spreads load, weight updates fan out through versioned
directories, abort and cancellation free the servers, infrastructure failures (a server
killed mid-generation) are retried elsewhere while data errors are not, health checks
take a dead server out, and a dead local server is restarted and caught up."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from tests.helpers.serving import SECRET, engine_results, make_model, make_model_dir, make_tokenizer, running_server

from rl_core.columns import GroupResults
from rl_core.generation import EngineOptions, GenerationError, GenerationRequestError, HttpBackend
from rl_core.generation.http.fleet import FleetPolicy
from rl_core.generation.http.servers import EngineArgs
from rl_core.protocols import GenerationBackend
from rl_core.rollout.group import GroupOptions, group_call_ok
from rl_core.types import GenerationRequest, SamplingParams, group_requests
from rl_core.weights.filesystem import READY, version_dir

pytestmark = pytest.mark.timeout(600)
SERVER_ARGS = ("--max-batch-size", "16")
SINGLE_TURN = SimpleNamespace(runs_episodes=False, max_turns=1)  # what group_call_ok asks of an environment


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("servers")
    with running_server(model_dir, work, *SERVER_ARGS, managed=True) as (a, _), \
            running_server(model_dir, work, *SERVER_ARGS, managed=True) as (b, _):
        yield [a, b]


def run(coro, timeout_s: float = 300.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def reference(model_dir, requests, state_dict=None) -> dict:
    return engine_results(model_dir, requests, 16, state_dict)  # the servers' --max-batch-size


def sampled(n: int, max_tokens: int = 12, prefix: str = "r") -> list[GenerationRequest]:
    return [GenerationRequest(f"{prefix}{i}", [5, 6, 7 + i % 50, 9], SamplingParams(temperature=1.0, top_p=0.95,
                                                                                     max_tokens=max_tokens, seed=i))
            for i in range(n)]


async def wait_until(predicate, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_results_equal_the_engine_and_load_is_spread(servers, model_dir):
    reqs = sampled(32)
    want = reference(model_dir, reqs)

    async def main():
        backend = HttpBackend(servers, health_check_interval_s=0.5)
        assert isinstance(backend, GenerationBackend)
        await backend.start()
        assert backend.capacity() == 32 and backend.weight_version == 0
        results = await asyncio.gather(*(backend.generate(r) for r in reqs))
        per_server = [ep.requests for ep in backend.endpoints]
        await asyncio.sleep(0.7)  # one health round: server metrics are polled
        metrics = backend.metrics()
        await backend.shutdown()
        return results, per_server, metrics

    results, per_server, metrics = run(main())
    for r in results:
        ref = want[r.request_id]
        assert r.token_ids == ref.token_ids and r.finish_reason == ref.finish_reason
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(ref.logprobs), atol=1e-4)
        assert r.token_versions == [0] * len(r.token_ids) and (r.start_version, r.end_version) == (0, 0)
    assert min(per_server) >= 8 and sum(per_server) == 32  # least outstanding: both servers busy
    assert metrics["healthy_servers"] == 2 and metrics["requests"] == 32 and metrics["infra_errors"] == 0
    assert metrics["servers_tokens_generated"] >= 32 * 12


def test_each_result_names_the_server_that_generated_it(servers):
    # the rollout metrics count generated tokens per worker (rollout/worker_gen_tokens/<url>) from this
    reqs = sampled(16, prefix="w")

    async def main():
        backend = HttpBackend(servers, health_check_interval_s=0.5)
        await backend.start()
        results = await asyncio.gather(*(backend.generate(r) for r in reqs))
        per_server = {ep.url: ep.requests for ep in backend.endpoints}
        await backend.shutdown()
        return results, per_server

    results, per_server = run(main())
    assert set(per_server) == set(servers)
    by_worker = {url: sum(1 for r in results if r.worker == url) for url in servers}
    assert by_worker == per_server and sum(by_worker.values()) == len(reqs)


def test_a_group_in_one_request_equals_its_samples_generated_one_by_one(servers, model_dir):
    # generate_group: one completions request (n choices, the `seeds` extension) per group; sample i
    # is what generate of f"{key}/{i}" with seeds[i] gives, and the engine's reference
    seeds = [(1 << 62) + 7 * i for i in range(6)]
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12)
    prompt = [5, 6, 11, 9]
    singles = group_requests("g0", prompt, params, seeds)
    want = reference(model_dir, singles)

    async def main():
        backend = HttpBackend(servers, health_check_interval_s=0.5)
        await backend.start()
        assert group_call_ok(backend, SINGLE_TURN, GroupOptions())  # the rollout sends groups in one call
        group = await backend.generate_group("g0", prompt, params, seeds)
        outstanding = [ep.outstanding for ep in backend.endpoints]
        one_by_one = await asyncio.gather(*(backend.generate(r) for r in singles))
        metrics = backend.metrics()
        await backend.shutdown()
        return group, one_by_one, outstanding, metrics

    group, one_by_one, outstanding, metrics = run(main())
    assert type(group) is GroupResults and len(group) == len(seeds) and outstanding == [0, 0]
    assert group.worker in servers and group.workers is None
    for i, single in enumerate(one_by_one):
        ref = want[f"g0/{i}"]
        assert list(group.token_ids[i]) == single.token_ids == ref.token_ids
        assert group.token_ids[i].dtype == np.int64 and group.logprobs[i].dtype == np.float32
        assert np.allclose(group.logprobs[i], ref.logprobs, atol=1e-4)
        assert group.finish_reasons[i] == single.finish_reason == ref.finish_reason
        assert group.token_versions[i] == [0] * len(ref.token_ids) and group.start_versions[i] == 0
    assert len({tuple(t) for t in group.token_ids}) > 1  # the seeds differ, so do the samples
    assert metrics["requests"] == 1 + len(seeds) and metrics["group_requests"] == 1  # the group was one request
    assert metrics["samples"] == 2 * len(seeds)


def test_a_group_larger_than_a_request_may_ask_goes_a_request_a_sample(servers, monkeypatch):
    import rl_core.generation.http.backend as backend_mod

    monkeypatch.setattr(backend_mod, "MAX_N", 4)  # rl-core serve takes n <= 128; a group of 6 against 4
    params, seeds = SamplingParams(temperature=1.0, max_tokens=6), [11, 12, 13, 14, 15, 16]

    async def main():
        backend = HttpBackend(servers, health_check_interval_s=0.5)
        await backend.start()
        group = await backend.generate_group("big", [5, 6, 7], params, seeds)
        singles = await asyncio.gather(*(backend.generate(r) for r in group_requests("one", [5, 6, 7], params, seeds)))
        counters = dict(backend.counters)
        await backend.shutdown()
        return group, singles, counters

    group, singles, counters = run(main())
    assert counters["group_requests"] == 0 and counters["requests"] == 12
    assert [list(t) for t in group.token_ids] == [r.token_ids for r in singles]


def test_aborting_one_sample_of_a_group_leaves_the_others_and_cancel_frees_all(servers):
    async def main():
        backend = HttpBackend(servers[:1], health_check_interval_s=0.5, control_secret=SECRET)
        await backend.start()
        params = SamplingParams(temperature=1.0, max_tokens=450)
        task = asyncio.create_task(backend.generate_group("ga", [5, 6, 7], params, [1, 2, 3]))
        await wait_until(lambda: "ga/1" in backend._inflight)
        await asyncio.sleep(0.1)
        await backend.abort("ga/1")
        group = await task
        async with httpx.AsyncClient() as http:
            cancelled = asyncio.create_task(backend.generate_group("gc", [5, 6], params, [4, 5]))
            await wait_until(lambda: "gc/0" in backend._inflight)
            await asyncio.sleep(0.1)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            deadline = time.monotonic() + 10
            while (await http.get(f"{servers[0]}/health")).json()["running"]:
                assert time.monotonic() < deadline, "the cancelled group still runs on the server"
                await asyncio.sleep(0.05)
        await backend.shutdown()
        return group

    group = run(main())
    assert group.finish_reasons[1] == "abort" and 0 < len(group.token_ids[1]) < 450
    assert len(group.logprobs[1]) == len(group.token_ids[1])
    assert group.finish_reasons[0] != "abort" and group.finish_reasons[2] != "abort"


def test_least_outstanding_picks_the_idlest_routable_server():
    async def main():
        fleet = HttpBackend(["http://a:1", "http://b:1", "http://c:1"]).fleet
        fleet.wake = asyncio.Event()
        a, b, c = fleet.endpoints
        for ep, load in ((a, 3), (b, 1), (c, 0)):
            ep.healthy, ep.outstanding = True, load
        c.stale = True  # missed a weight update: never routed to
        assert {(await fleet.pick()).url for _ in range(4)} == {"http://b:1"}
        b.outstanding = 3
        assert {(await fleet.pick()).url for _ in range(6)} == {"http://a:1", "http://b:1"}  # ties rotate
        fleet.policy.routing = "round_robin"
        a.healthy = False
        assert {(await fleet.pick()).url for _ in range(3)} == {"http://b:1"}
        b.healthy = False
        fleet.policy.startup_timeout_s = 0.2
        with pytest.raises(GenerationError, match="no generation server is healthy"):
            await fleet.pick()

    run(main())
    assert FleetPolicy(retry_backoff_s=0.5, retry_max_backoff_s=3).backoff(0) == 0.5
    assert [FleetPolicy(retry_backoff_s=0.5, retry_max_backoff_s=3).backoff(k) for k in (1, 2, 3)] == [1.0, 2.0, 3]
    with pytest.raises(ValueError, match="exactly one"):
        HttpBackend(["http://a:1"], model_dir="x", num_local_servers=1)


def test_abort_and_cancel_free_the_servers(servers):
    async def main():
        backend = HttpBackend(servers[:1], health_check_interval_s=0.5, control_secret=SECRET)
        await backend.start()
        long = GenerationRequest("long", [5, 6, 7], SamplingParams(temperature=1.0, max_tokens=450, seed=1))
        task = asyncio.create_task(backend.generate(long))
        await wait_until(lambda: "long" in backend._inflight)
        await asyncio.sleep(0.1)
        await backend.abort("long")
        aborted = await task
        async with httpx.AsyncClient() as http:
            running = (await http.get(f"{servers[0]}/health")).json()["running"]
            cancelled = asyncio.create_task(backend.generate(GenerationRequest("c", [5, 6], long.params)))
            await wait_until(lambda: "c" in backend._inflight)
            await asyncio.sleep(0.1)
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            await wait_until(lambda: True)
            deadline = time.monotonic() + 10
            while (await http.get(f"{servers[0]}/health")).json()["running"]:
                assert time.monotonic() < deadline, "the cancelled request still runs on the server"
                await asyncio.sleep(0.05)
        metrics = backend.metrics()
        await backend.shutdown()
        return aborted, running, metrics

    aborted, running, metrics = run(main())
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 450
    assert len(aborted.logprobs) == len(aborted.token_ids) and running == 0
    assert metrics["aborts"] == 1


def test_server_killed_mid_generation_is_retried_elsewhere_and_data_errors_are_not(servers, model_dir, tmp_path):
    """The victim is frozen (SIGSTOP) before the requests go out, so the ones routed to it are held
    there, sent but unanswered, until it is killed: the kill always lands while it holds them, with
    no timing assumption (before, a kill after a sleep could land after they had finished)."""
    reqs = sampled(12, max_tokens=200, prefix="k")
    want = reference(model_dir, reqs)

    async def main():
        with running_server(model_dir, tmp_path, *SERVER_ARGS) as (victim_url, victim):
            # no periodic health check while the victim is frozen: only the failures take it out
            backend = HttpBackend([servers[0], victim_url], health_check_interval_s=3600, retry_backoff_s=0.05,
                                  max_retries=3)
            await backend.start()
            victim_ep = backend.endpoints[1]
            os.kill(victim.pid, signal.SIGSTOP)  # the gate: the kernel still accepts, the server answers nothing
            try:
                tasks = [asyncio.create_task(backend.generate(r)) for r in reqs]
                await wait_until(lambda: victim_ep.outstanding == len(reqs) // 2)  # least outstanding: half each
                held = victim_ep.outstanding
            finally:
                os.kill(victim.pid, signal.SIGKILL)  # infrastructure failure while it holds requests
            results = await asyncio.gather(*tasks)
            await wait_until(lambda: not victim_ep.healthy)
            healthy = backend.metrics()["healthy_servers"]
            with pytest.raises(GenerationRequestError, match="400"):
                await backend.generate(GenerationRequest("bad", [10**6], SamplingParams(max_tokens=2)))
            metrics = backend.metrics()
            await backend.shutdown()
            return results, healthy, metrics, held

    results, healthy, metrics, held = run(main())
    for r in results:  # seeds travel with the request: a retried sample is the same sample
        assert r.token_ids == want[r.request_id].token_ids and r.finish_reason == "length"
    assert held == 6 and healthy == 1
    assert metrics["infra_errors"] == held and metrics["retries"] == held  # each held request retried once
    assert metrics["data_errors"] == 1 and metrics["retries"] == metrics["infra_errors"]  # the 400 was not retried


def test_plain_openai_server_kind_generates_but_cannot_load_weights(servers, model_dir):
    req = sampled(1)[0]

    async def main():
        backend = HttpBackend(servers[:1], server_kind="openai")
        await backend.start()
        assert not group_call_ok(backend, SINGLE_TURN, GroupOptions())  # its seeds per choice are its own
        result = await backend.generate(req)
        with pytest.raises(GenerationError, match="cannot load new weights"):
            await backend.update_weights(1, str(model_dir))
        await backend.shutdown()
        return result

    result = run(main())
    assert result.token_ids == reference(model_dir, [req])[req.request_id].token_ids


def test_local_servers_weight_fan_out_restart_and_catch_up(model_dir, tmp_path):
    """Two local servers: a state-dict update is published as a READY version directory and
    every server serves it; a killed server is restarted and brought to that version."""
    new = make_model(make_tokenizer(), seed=1)
    req = GenerationRequest("g", [5, 6, 7, 8], SamplingParams(greedy=True, max_tokens=10))
    want_new = reference(model_dir, [req], state_dict=new.state_dict())["g"].token_ids
    want_old = reference(model_dir, [req])["g"].token_ids
    assert want_new != want_old

    async def main():
        backend = HttpBackend(model_dir=model_dir, num_local_servers=2, engine_args=EngineArgs(EngineOptions(max_batch_size=8),
                              torch_num_threads=1), weight_root=tmp_path / "weights", keep_weight_versions=1,
                              log_dir=tmp_path / "logs", health_check_interval_s=0.3)
        await backend.start()
        pids = [ep.local.proc.pid for ep in backend.endpoints]
        before = await backend.generate(req)
        await backend.update_weights(1, new.state_dict())
        assert (version_dir(tmp_path / "weights", 1) / READY).is_file()
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {backend.api_key}"}) as http:
            served = [(await http.get(f"{ep.url}/rl/weight_version")).json()["weight_version"]
                      for ep in backend.endpoints]
            after = [await backend.generate(GenerationRequest(f"g{i}", req.prompt_ids, req.params)) for i in range(4)]
            os.kill(pids[0], signal.SIGKILL)
            ep0 = backend.endpoints[0]
            await wait_until(lambda: backend.counters["server_restarts"] == 1 and ep0.routable, timeout_s=180)
            restarted = (await http.get(f"{ep0.url}/rl/weight_version")).json()["weight_version"]
            again = await backend.generate(GenerationRequest("again", req.prompt_ids, req.params))
        metrics = backend.metrics()
        await backend.shutdown()
        alive = [p for p in pids + [ep0.local.proc.pid] if _alive(p)]
        return before, served, after, restarted, again, metrics, alive

    before, served, after, restarted, again, metrics, alive = run(main())
    assert before.token_ids == want_old and served == [1, 1]
    assert all(r.token_ids == want_new and r.token_versions == [1] * 10 for r in after)
    assert restarted == 1 and metrics["stale_servers_caught_up"] == 1 and again.token_ids == want_new
    assert metrics["weight_version"] == 1 and not alive  # shutdown stopped every local server


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
