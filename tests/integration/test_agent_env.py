"""`env.type: agent` on the real loop: an agent that imports only `openai` (examples/agents/
chain_agent.py) drives two-turn episodes through its session endpoint; the trainer sees,
id for id, the tokens the engine generated in each turn, with the engine's logprobs. Counted in
RL steps. (Whether the agent's reward rises is not asserted: over the 40 steps a test affords it
moves with the sampling seeds, see the test.)"""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest

from tests.helpers.net import free_port
from tests.helpers.paths import ROOT, TINY_RECIPE as RECIPE
from rl_core.metrics.logger import read_jsonl

AGENT = ["env.type=agent", "env.target=examples.agents.chain_agent:chain_agent", "generation.max_tokens=6"]
STEPS, PROMPTS, SAMPLES = 40, 8, 8  # RL steps; prompts per step; samples per prompt (the recipe's)


@pytest.fixture(scope="module")
def agent_policy(tmp_path_factory):
    """The initial policy for the agent task: warmed up on the chat-templated first turn, to 30%
    greedy accuracy (the warm-up's accuracy jumps: 11% at its step 340, 46% at 370, ~5 s more)
    so that sampled answers are often nearly right and RL has a strong signal to follow."""
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import ensure_policy, setup_process

    out = tmp_path_factory.mktemp("agent_policy") / "init_policy"
    cfg = load_recipe(RECIPE, [*AGENT, "model.warmup.target_accuracy=0.3"])
    setup_process(cfg)
    ensure_policy(cfg, out)
    return out


def _run(tmp_path, policy, monkeypatch, steps, *overrides, name="agent"):
    """The controller on the agent recipe; returns (summary, run dir), the spool under <run dir>/spool."""
    from rl_core.launch.preflight import load_recipe
    from rl_core.controller.controller import Controller
    from rl_core.launch.train import build_parts

    monkeypatch.chdir(ROOT)
    cfg = load_recipe(RECIPE, [f"output_dir={tmp_path}", f"run_name={name}", "logging.tensorboard=false", *AGENT,
                               f"grpo.max_num_steps={steps}", *overrides])
    run_dir = tmp_path / name
    ctl = Controller(cfg, build_parts(cfg, policy), run_dir, total_steps=steps, spool_dir=run_dir / "spool")
    return asyncio.run(ctl.run()), run_dir


def _engine_results(monkeypatch):
    """Record every result the native backend returns, by prompt ids (the samples of a group
    share their first prompt: each prompt maps to the completions generated for it)."""
    from rl_core.generation.native.backend import NativeBackend

    seen: dict[tuple[int, ...], list[list[int]]] = {}
    original = NativeBackend.generate

    async def generate(self, request):
        res = await original(self, request)
        seen.setdefault(tuple(res.prompt_ids), []).append(list(res.token_ids))
        return res

    monkeypatch.setattr(NativeBackend, "generate", generate)
    return seen


@pytest.mark.slow
def test_agent_episodes_train_on_exactly_the_generated_tokens(tmp_path, agent_policy, monkeypatch):
    seen = _engine_results(monkeypatch)
    # synchronous (lookahead 0): the trainer's weights are the generator's, so the logprob error
    # measures only the two implementations' numerical agreement over the spliced turns
    # partial credit (share of digits right), lr 3e-4 and 8 prompts a step (steps twice as fast as 16):
    # a dense signal that rises within the steps a test affords (lr 5e-4 and 1e-3 made it fall)
    summary, run_dir = _run(tmp_path, agent_policy, monkeypatch, STEPS, "validation.val_at_start=false",
                            "validation.val_at_end=false", "async_rl.sampler.max_lookahead_versions=0",
                            "env.kwargs={partial_credit: true}", "trainer.lr=3e-4",
                            f"grpo.num_prompts_per_step={PROMPTS}", f"grpo.num_generations_per_prompt={SAMPLES}")
    assert summary["rl_steps"] == STEPS
    train = read_jsonl(run_dir / "metrics.jsonl", kind="train")
    rewards = [r["train/reward_mean"] for r in train]
    k = STEPS // 3
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    print(f"[agent] mean train reward of the first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    # Not asserted: a rise of the reward. It rose 0.380 -> 0.439 with the per-sample seeds before
    # groups got consecutive seeds (grpo.seed 0), but fell 0.442 -> 0.433 with those seeds and
    # grpo.seed 1; with consecutive seeds: 0.450 -> 0.403, 0.452 -> 0.428, 0.447 -> 0.436 and
    # 0.426 -> 0.445 (seeds 0-3); with 16 prompts a step 0.456 -> 0.470 and 0.455 -> 0.468. Over
    # 40 steps the agent task's reward moves with the samples drawn, so the rise was luck;
    # tests/integration/test_learning.py and test_algorithms_learn.py show learning.
    assert 0.0 < first < 1.0 and 0.0 < last < 1.0
    assert max(r["train/gen_logprob_abs_error"] for r in train if "train/gen_logprob_abs_error" in r) < 1e-3
    # a turn that ends on eos instead of <|im_end|> is rendered differently by the template: a new segment
    episodes = STEPS * PROMPTS * SAMPLES
    assert sum(r["rollout/agent_segment_breaks"] for r in train) < 0.05 * episodes
    # every model turn of every trained sample is, id for id, what the engine generated for that prompt
    checked = two_turn = 0
    for path in sorted((run_dir / "spool").glob("step_*.json"))[-5:]:
        for g in json.loads(path.read_text())["groups"]:
            for s in g["samples"]:
                comp, mask, starts = s["completion_ids"], s["completion_mask"], s["turn_starts"]
                two_turn += len(starts) == 2
                for k, start in enumerate(starts):
                    end = starts[k + 1] if k + 1 < len(starts) else len(comp)
                    end = next((i for i in range(start, end) if mask[i] == 0), end)
                    assert comp[start:end] in seen[tuple(s["prompt_ids"] + comp[:start])]
                    checked += 1
    assert checked > 0 and two_turn > 0


def test_stale_agent_episodes_are_cancelled_with_their_model_calls(tmp_path, warm_policy, monkeypatch):
    # as test_loop_knobs' stale abort, on the agent path: the held model calls belong to agent
    # episodes; when their groups leave the window (windowed sampler, window 0) the episodes are
    # cancelled and so are their in-flight model calls (the held calls see the cancellation)
    from tests.integration.test_loop_knobs import run_knobs

    ctl, backend, recs, cfg = run_knobs(tmp_path, warm_policy, monkeypatch, *AGENT, "async_rl.sampler.type=windowed",
                                        "async_rl.sampler.max_staleness_versions=0",
                                        hold=lambda d, a: d in (1, 6) and a == 0, name="agent-stale")
    assert backend.held == {1, 6} and backend.held_cancelled == {1, 6}
    assert any(rid.endswith("/c0") for rid, _ in backend.requests)  # the calls came through episode sessions
    aborted = [r["rollout/aborted_stale_inflight_groups"] for r in recs]
    assert aborted[-1] >= 2 and ctl.train.stale_aborted_groups == aborted[-1]
    trained_d = {int(g.rsplit("-d", 1)[1]) for g in ctl.train.trained_group_ids}
    assert not trained_d & {1, 6}


def _start_service(port: int):
    import subprocess
    import sys
    import time
    import urllib.request

    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "agents" / "env_service.py"), "--port",
                             str(port)], stdout=subprocess.DEVNULL, start_new_session=True)
    for _ in range(300):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the env service did not start")


def test_http_env_service_killed_and_restarted_mid_run(tmp_path, warm_policy, monkeypatch):
    import os
    import signal
    import threading
    import time

    from tests.integration.test_loop_knobs import run_knobs

    port = free_port()
    procs = [_start_service(port)]
    run_dir = tmp_path / "http-env"
    killed = threading.Event()

    def chaos():  # after the second RL step: kill the service, restart it 1.5 s later on the same port
        metrics = run_dir / "metrics.jsonl"
        while not killed.is_set():
            if metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 2:
                os.kill(procs[0].pid, signal.SIGKILL)
                procs[0].wait()
                killed.set()
                time.sleep(1.5)
                procs.append(_start_service(port))
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=chaos, daemon=True)
    watcher.start()
    try:
        ctl, backend, recs, cfg = run_knobs(
            tmp_path, warm_policy, monkeypatch, "env.type=http", f"env.url=http://127.0.0.1:{port}",
            "env.reward_names=[turn1,turn2]", "generation.max_tokens=6",
            "async_rl.failure.max_infra_attempts_per_group=50", "async_rl.failure.backoff_base_s=0.2",
            "async_rl.failure.max_backoff_s=0.5", steps=6, name="http-env")
    finally:
        killed.set()
        for p in procs:  # stop what this test started, by PID
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
    assert len(procs) == 2, "the service was never killed (the run ended before its second step?)"
    ids = ctl.train.trained_group_ids
    assert len(ids) == len(set(ids)) == 6 * 4  # no prompt group lost or trained twice
    assert ctl.rollout.stats.dropped_groups == 0
    assert recs[-1]["rollout/infra_retries"] > 0  # the failures were counted
    assert recs[-1]["train/reward_mean"] >= 0.0 and "rollout/agent_segment_breaks" in recs[-1]


def test_stale_http_env_episodes_are_cancelled_with_their_model_calls(tmp_path, warm_policy, monkeypatch):
    # the stale abort above, with env.type: http: the episodes run in an environment service (another
    # process). When a held group leaves the window its POSTs are abandoned and its in-flight model
    # calls aborted; the service's held calls are answered 404 (the session ended), nothing of that
    # group is trained, and the service goes on serving the other episodes. One group is held (the
    # first after the first): how far dispatch gets past it before the run ends depends on the
    # service's pace, so a second held index would make the test depend on timing.
    import os
    import signal

    from tests.integration.test_loop_knobs import run_knobs

    port = free_port()
    proc = _start_service(port)
    try:
        ctl, backend, recs, cfg = run_knobs(
            tmp_path, warm_policy, monkeypatch, "env.type=http", f"env.url=http://127.0.0.1:{port}",
            "env.reward_names=[turn1,turn2]", "generation.max_tokens=6", "async_rl.sampler.type=windowed",
            "async_rl.sampler.max_staleness_versions=0", hold=lambda d, a: d == 1 and a == 0,
            name="http-stale")
    finally:
        alive = proc.poll() is None
        if alive:  # stop what this test started, by PID
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
    assert alive, "the environment service died during the run"
    assert backend.held == {1} and backend.held_cancelled == {1}
    assert any(rid.endswith("/c0") for rid, _ in backend.requests)  # the calls came through episode sessions
    aborted = [r["rollout/aborted_stale_inflight_groups"] for r in recs]
    assert aborted[-1] >= 1 and ctl.train.stale_aborted_groups == aborted[-1]
    trained_d = {int(g.rsplit("-d", 1)[1]) for g in ctl.train.trained_group_ids}
    assert 1 not in trained_d and len(trained_d) == 3 * 4  # the other groups trained, through the service
    assert ctl.sessions.counters["client_errors"] >= 1  # the held calls were refused once their episodes ended
    assert len(ctl.sessions.registry) == 0  # no session outlives its episode
