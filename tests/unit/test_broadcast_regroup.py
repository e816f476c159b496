"""The broadcast refit when a generation server dies (fault (a) of docs/cluster.md, on one
machine): two real `rl-core serve` processes join the trainer's broadcast group and serve
version 1; one is SIGKILLed; the backend's health check relaunches it, and the transport
forms a new group with it and sends it the newest version (kept from the last push) before
it takes a request; the next push reaches both servers without a new group. Every answer
equals the in-process engine at the weights it claims."""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from rl_core.generation import EngineOptions, HttpBackend
from rl_core.generation.http.servers import EngineArgs
from rl_core.types import GenerationRequest, SamplingParams
from rl_core.weights import BroadcastWeightSync
from tests.helpers.serving import make_model, make_model_dir, make_tokenizer
from tests.unit.test_http_backend import _alive, reference, run, wait_until

pytestmark = pytest.mark.timeout(600)


def test_a_restarted_server_rejoins_the_broadcast_group_at_the_newest_version(tmp_path):
    model_dir = make_model_dir(tmp_path / "tiny")
    tok = make_tokenizer()
    new1, new2 = make_model(tok, seed=1), make_model(tok, seed=2)
    req = GenerationRequest("g", [5, 6, 7, 8], SamplingParams(greedy=True, max_tokens=10))
    want1 = reference(model_dir, [req], state_dict=new1.state_dict())["g"].token_ids
    want2 = reference(model_dir, [req], state_dict=new2.state_dict())["g"].token_ids
    assert want1 != want2

    async def generate_all(backend, tag):
        return [(await backend.generate(GenerationRequest(f"{tag}{i}", req.prompt_ids, req.params))).token_ids
                for i in range(4)]

    async def main():
        backend = HttpBackend(model_dir=model_dir, num_local_servers=2,
                              engine_args=EngineArgs(EngineOptions(max_batch_size=8), torch_num_threads=1),
                              log_dir=tmp_path / "logs", health_check_interval_s=0.3)
        sync = BroadcastWeightSync("cpu", bucket_size_mb=0.05, timeout_s=120)
        await backend.start()
        first = await sync.push(1, new1.state_dict(), [backend])
        served1 = await generate_all(backend, "a")
        ep0 = backend.endpoints[0]
        killed = ep0.local.proc.pid
        os.kill(killed, signal.SIGKILL)
        await wait_until(lambda: backend.counters["server_restarts"] == 1 and ep0.routable, timeout_s=240)
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {backend.api_key}"}) as http:
            restarted = (await http.get(f"{ep0.url}/rl/weight_version")).json()["weight_version"]
        caught_up = await generate_all(backend, "b")
        second = await sync.push(2, new2.state_dict(), [backend])
        served2 = await generate_all(backend, "c")
        metrics = backend.metrics()
        pids = [ep.local.proc.pid for ep in backend.endpoints]
        await backend.shutdown()
        return first, served1, restarted, caught_up, second, served2, metrics, [p for p in [killed, *pids] if _alive(p)]

    first, served1, restarted, caught_up, second, served2, metrics, alive = run(main(), timeout_s=500)
    assert first.parts["groups_formed"] == 1 and first.parts["servers"] == 2 and first.bytes > 0
    assert served1 == [want1] * 4
    # relaunched from the initial weights, then a new group brought it to version 1 before any request
    assert restarted == 1 and metrics["stale_servers_caught_up"] >= 1 and caught_up == [want1] * 4
    assert second.parts["groups_formed"] == 2 and second.parts["servers"] == 2 and second.bytes == first.bytes
    assert second.parts["group_init_s"] == 0.0  # the same members: the group of the catch-up carries on
    assert served2 == [want2] * 4 and metrics["weight_version"] == 2 and not alive
