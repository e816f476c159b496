"""Generated tokens/s of the native multi-turn path against the agent path, side by side.

The same model, examples, sampling, seeds and token counts through both paths of
rl_core.rollout.group: native: `generate_sample` with a two-turn chat environment (turn 1 the example's prompt, turn 2
the user turn "+c="); agent: `generate_episode` with `env.type: agent` and `two_turn_agent`
below (the same turns, through `openai` and the run's session server). Turns end at the run's
stop tokens or `--tokens`; `--episodes` episodes, `--concurrency` in flight. Rounds alternate
the paths; each prints its process CPU and engine steps (do agent calls share engine steps?);
the last line gives the medians, agent/native, and native/agent of the process CPU a generated
token (what the ratio tends to when other work holds the cores). The collector is set as the
controller sets it (metrics.gc_pauses). `--profile FILE`: a cProfile of one agent round (the
controller's thread). Models: the tiny recipe's (warmed up) and SmolLM2-135M-Instruct (docs/model.md).

Run: OMP_WAIT_POLICY=PASSIVE nice -n 10 .venv/bin/python bench/agent_path.py [--models tiny,smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPES = {"tiny": ROOT / "recipes" / "tiny-addition.yaml", "smollm2": ROOT / "recipes" / "smollm2-arithmetic.yaml"}


def build(model: str, workdir: Path, max_seq_len: int):
    """(cfg, tokenizer, backend) for `model`: the recipe's policy (tiny: random init, no warm-up)."""
    from transformers import AutoTokenizer

    from rl_core.launch.placement import make_generation_backend
    from rl_core.launch.preflight import load_recipe
    from rl_core.launch.train import setup_process
    from rl_core.model.init_policy import init_policy

    overrides = [f"output_dir={workdir}", "env.type=agent", "env.target=bench.agent_path:two_turn_agent",
                 f"generation.native.max_seq_len={max_seq_len}"]
    if model == "tiny":  # warmed up (on the chat-templated first turn) so that replies end on <|im_end|>
        overrides += ["model.warmup.target_accuracy=0.1", f"model.tiny.max_position_embeddings={max_seq_len}"]
    cfg = load_recipe(str(RECIPES[model]), overrides)
    setup_process(cfg)
    policy = workdir / f"{model}-policy"
    if not (policy / "config.json").is_file():
        init_policy(cfg, policy)
    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    backend = make_generation_backend(cfg, policy, tokenizer=tokenizer, device="cpu", weight_version=0)
    return cfg, tokenizer, backend


async def two_turn_agent(client, example: dict) -> float:
    """The native loop's episode as an agent (it imports nothing): turn 2, the user turn "+c=",
    follows a turn 1 that ended on a stop token (rl_core.rollout.group.generate_sample's rule)."""
    messages = [{"role": "user", "content": example["prompt"]}]
    for turn in range(2):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        choice = reply.choices[0]
        if choice.finish_reason != "stop" or turn == 1:
            break
        c = (int(example["id"]) * 37 + 11) % 100  # rl_core.envs.chain.third_operand
        messages += [{"role": "assistant", "content": choice.message.content},
                     {"role": "user", "content": f"+{c:02d}="}]
    return 0.0


def examples(n: int) -> list[dict]:
    """Two-operand additions in the shape of data/addition (id, a, b, prompt)."""
    out = []
    for i in range(n):
        a, b = (i * 7 + 3) % 100, (i * 13 + 5) % 100
        out.append({"id": i, "a": a, "b": b, "prompt": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}"[::-1]})
    return out


def native_env(tokenizer):
    """The native two-turn environment: chained addition through the chat template, the agent's turns."""
    from types import SimpleNamespace

    from rl_core.envs.chain import ChainAdditionEnv

    class ChatChain(ChainAdditionEnv):
        use_chat_template = True

    return ChatChain(SimpleNamespace(max_turns=2), tokenizer)


async def run_round(path: str, backend, env, tokenizer, exs, params, concurrency: int, tag: str, sessions=None,
                    seed: int = 0):
    from rl_core.rollout.group import GroupOptions, generate_sample

    opts = GroupOptions(sessions=sessions)
    sem = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(i, ex):
        nonlocal tokens
        async with sem:
            prompt = env.prompt_ids(ex) if path == "native" else []
            p = replace(params, seed=seed + i)
            s = await generate_sample(backend, env, tokenizer, ex, prompt, p, f"{tag}-{i}", opts)
            tokens += sum(s.completion_mask) if s.completion_mask is not None else len(s.completion_ids)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, ex) for i, ex in enumerate(exs)))
    return tokens, time.perf_counter() - t0


async def bench_model(model: str, args, workdir: Path) -> tuple[float, float]:
    from rl_core.envs import make_env
    from rl_core.metrics.gc_pauses import freeze_setup_objects, run_thresholds, unfreeze
    from rl_core.rollout.session_server import SessionServer
    from rl_core.rollout.sessions import SessionRegistry
    from rl_core.types import SamplingParams

    cfg, tokenizer, backend = build(model, workdir, args.max_seq_len)
    await backend.start()
    agent_env = make_env(cfg.env, tokenizer)
    chain_env = native_env(tokenizer)
    sessions = SessionServer(SessionRegistry(), tokenizer, backend=backend)
    # the run's stop tokens (<|im_end|>, eos); a seed per episode: both paths draw the same tokens
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, stop_token_ids=chain_env.end_token_ids, seed=0)
    exs = examples(args.episodes)
    envs = {"native": chain_env, "agent": agent_env}
    rates: dict[str, list[float]] = {"native": [], "agent": []}
    counts: dict[str, list[int]] = {"native": [], "agent": []}
    cpus: dict[str, list[float]] = {"native": [], "agent": []}  # process CPU s per generated token
    thresholds = None
    try:
        for path in rates:  # warm-up (the session server starts at its first episode)
            await run_round(path, backend, envs[path], tokenizer, exs[: args.concurrency], params,
                            args.concurrency, f"w-{path}", sessions)
        # as the controller runs its pumps: setup objects frozen, raised collection thresholds
        freeze_setup_objects()
        thresholds = run_thresholds(cfg.async_rl.max_inflight_groups)
        for rnd in range(args.rounds):
            for path in rates:
                prof = cProfile.Profile() if (args.profile and path == "agent" and rnd == 0) else None
                if prof:
                    prof.enable()
                m0, c0 = backend.metrics(), os.times()
                tokens, dt = await run_round(path, backend, envs[path], tokenizer, exs, params, args.concurrency,
                                             f"r{rnd}-{path}", sessions, seed=1000 * rnd)
                if prof:
                    prof.disable()
                    prof.dump_stats(args.profile)
                c1 = os.times()
                m1, cpu, sys_cpu = backend.metrics(), c1.user + c1.system - c0.user - c0.system, c1.system - c0.system
                counts[path].append(tokens)
                rates[path].append(tokens / dt)
                cpus[path].append(cpu / tokens)
                steps = m1["steps"] - m0["steps"]
                busy = m1["busy_s"] - m0["busy_s"]
                print(f"[{model}] round {rnd + 1}: {path:6s} {tokens} tokens in {dt:.2f} s = "
                      f"{tokens / dt:,.0f} generated tokens/s, process CPU {cpu:.2f} s ({sys_cpu:.2f} s system); {steps:.0f} engine steps, "
                      f"{(m1['tokens_generated'] - m0['tokens_generated']) / max(steps, 1):.1f} tokens a step, "
                      f"engine busy {busy:.2f} s", flush=True)
    finally:
        if thresholds is not None:
            gc.set_threshold(*thresholds)
        unfreeze()
        await sessions.stop()
        await agent_env.aclose()
        await backend.shutdown()
    same = counts["native"] == counts["agent"]
    print(f"[{model}] generated tokens per round, native {counts['native']}, agent {counts['agent']}"
          f"{' (the same)' if same else ' (they differ: the paths drew different tokens)'}")
    nat, agt = statistics.median(rates["native"]), statistics.median(rates["agent"])
    paired = statistics.median(a / n for a, n in zip(rates["agent"], rates["native"]))  # round by round
    print(f"[{model}] median of {args.rounds} rounds, {args.episodes} two-turn episodes x {args.tokens} tokens a "
          f"turn, {args.concurrency} in flight: native {nat:,.0f} tok/s, agent {agt:,.0f} tok/s, "
          f"agent/native {agt / nat:.2f} (median of the rounds' ratios {paired:.2f}); process CPU a generated "
          f"token, native/agent {statistics.median(cpus['native']) / statistics.median(cpus['agent']):.2f}", flush=True)
    return nat, agt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8, help="generated tokens per turn (2 turns an episode)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=128)
    ap.add_argument("--profile", default=None, help="write a cProfile of the first agent round here")
    ap.add_argument("--workdir", default=None, help="keep the policies here (reused when there; default: a temporary "
                                                    "directory)")
    args = ap.parse_args()
    from rl_core.model.gguf import find_smollm2_gguf

    with tempfile.TemporaryDirectory(prefix="agent_path_") as tmp:
        tmp = args.workdir or tmp
        for model in args.models.split(","):
            if model == "smollm2":
                try:
                    find_smollm2_gguf()
                except Exception as exc:  # noqa: BLE001 - the optional model is not there: say so, go on
                    print(f"[smollm2] skipped: {exc}")
                    continue
            a = argparse.Namespace(**vars(args))
            if model == "smollm2":  # ~100x the tiny model's cost a token on a CPU
                a.episodes, a.concurrency = min(args.episodes, 32), min(args.concurrency, 16)
            asyncio.run(bench_model(model, a, Path(tmp)))


if __name__ == "__main__":
    main()
