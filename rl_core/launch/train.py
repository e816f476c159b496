"""Building a run's parts from a validated recipe, and running it in this process.

Owns: the order *validate -> write resolved config -> initial policy -> build parts ->
run the controller -> save the final policy*, process-level settings (torch threads,
seeds, device choice), and the wiring of recipe sections to implementations (native
engine, torch trainer, environment, sampler, loss).

Does not own: the controller's behaviour, or workflow stages (the Snakemake rules call
the same functions through `workflow/scripts`).
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
from pathlib import Path
from typing import Any, Coroutine, TypeVar

from rl_core.config import RecipeConfig, run_dir, write_resolved
from rl_core.train import trainer_device

T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on an event loop of its own and return its result.

    In a thread without a running loop (a script, the CLI) that is `asyncio.run`. Where a loop
    is already running in this thread (a Jupyter notebook, an async application), the new loop
    runs in a worker thread while this thread waits, so the caller sees an ordinary blocking
    call in both cases; an interrupt (Ctrl-C, the notebook's stop button) cancels the run and
    waits for it to wind down before it is raised here."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main)
    box: dict[str, Any] = {}
    started, done = threading.Event(), threading.Event()

    async def wrapped() -> T:
        box["task"], box["loop"] = asyncio.current_task(), asyncio.get_running_loop()
        started.set()
        return await main

    def worker() -> None:
        try:
            box["result"] = asyncio.run(wrapped())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        finally:
            started.set()
            done.set()

    # waited on with an Event, not Thread.join: a join interrupted by KeyboardInterrupt marks the
    # thread as ended while it still runs, and a second join returns at once
    threading.Thread(target=worker, name="rl_core-event-loop", daemon=True).start()
    try:
        done.wait()
    except KeyboardInterrupt:
        started.wait()
        try:
            box["loop"].call_soon_threadsafe(box["task"].cancel)
        except (KeyError, RuntimeError):  # it never started, or it has just ended (its loop closed)
            pass
        done.wait()
        raise
    if "error" in box:
        raise box["error"]
    return box["result"]


def headline(summary: dict) -> str | None:
    """The run's last line: held-out accuracy before and after RL (None without both validations)."""
    vs, ve = summary.get("val_start"), summary.get("val_end")
    if not (vs and ve):
        return None
    return (f"held-out accuracy: {vs['accuracy']:.3f} before RL -> {ve['accuracy']:.3f} after "
            f"{summary['rl_steps']} RL steps ({(ve['accuracy'] - vs['accuracy']) * 100:+.1f} points)")


def check_device(cfg: RecipeConfig) -> str:
    """The device this process trains on, with the recipe's device-dependent rules (model.dtype)
    checked against it; called before anything is built."""
    from rl_core.config.schema import check_device_dtype

    device = trainer_device(cfg)
    check_device_dtype(cfg, device)
    return device


def setup_process(cfg: RecipeConfig) -> None:
    import numpy as np
    import torch

    if cfg.runtime.torch_num_threads:
        torch.set_num_threads(cfg.runtime.torch_num_threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    random.seed(cfg.grpo.seed)
    np.random.seed(cfg.grpo.seed % (2**32))
    torch.manual_seed(cfg.grpo.seed)


def policy_is_complete(out: Path) -> bool:
    return out.is_dir() and (out / "config.json").is_file() and any(out.glob("*.safetensors"))


def ensure_policy(cfg: RecipeConfig, out_dir: str | Path, recipe: str = "RECIPE") -> Path:
    """The initial policy as an HF directory: reuse `out_dir` if complete (after checking that
    its model shape is the recipe's: `CheckpointError` otherwise), else build it (which
    refuses to replace a directory rl_core did not write)."""
    out = Path(out_dir)
    if policy_is_complete(out):
        from rl_core.checkpoint.resume import check_model_matches

        check_model_matches(cfg, out, what=f"the initial policy {out}",
                            fix=f"rebuild it for this recipe: `rl-core init-policy {recipe} --out {out} --force` "
                                f"(replaces that directory, which rl_core wrote), or move {out} away.")
        return out
    from rl_core.fsutil import check_replaceable

    check_replaceable(out, "initial policy directory")
    from rl_core.model.init_policy import init_policy

    init_policy(cfg, out)
    return out


def build_parts(cfg: RecipeConfig, policy_dir: str | Path, *, trainer_state: dict | None = None,
                weight_version: int = 0, critic_dir: str | Path | None = None):
    """Everything the controller drives, built from the recipe and an HF policy directory."""
    from transformers import AutoTokenizer

    from rl_core.algorithms.losses import make_loss
    from rl_core.controller.controller import Parts
    from rl_core.data.dataset import Fields, PromptSource, load_task_data
    from rl_core.envs import make_env
    from rl_core.launch.placement import build_overlapped
    from rl_core.samplers import make_sampler
    from rl_core.train import make_trainer as make_backend_trainer

    device = trainer_device(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    train_examples, val_examples = load_task_data(cfg.data.train_file, cfg.data.val_file,
                                                  fields=Fields.of(cfg.data))
    if cfg.data.max_train_examples is not None:
        train_examples = train_examples[: cfg.data.max_train_examples]
    env = make_env(cfg.env, tokenizer)
    from rl_core.algorithms.advantages import check_reward_weights

    check_reward_weights(cfg.advantage, getattr(env, "reward_names", ()))
    source = PromptSource(train_examples, cfg.grpo.num_prompts_per_step, shuffle=cfg.data.shuffle,
                          seed=cfg.grpo.seed, max_num_epochs=cfg.grpo.max_num_epochs)
    # a completion ends on the environment's end tokens (`<|im_end|>` too for chat environments) or eos
    stop_ids = tuple(dict.fromkeys(i for i in (*env.end_token_ids, tokenizer.eos_token_id) if i is not None))

    from rl_core.controller.train_pump import needs_prev_logprobs, needs_reference_logprobs

    def make_trainer():  # trainer.backend: torch | fsdp2 | megatron (rl_core.train registry)
        # the frozen reference is kept exactly when the train pump's gate says its logprobs are needed
        return make_backend_trainer(cfg, policy_dir, device=device, version=weight_version,
                                    trainer_state=trainer_state, keep_reference=needs_reference_logprobs(cfg))

    # generation (per generation.backend/placement) sets up in a thread while the trainer builds
    backend, trainer, setup = build_overlapped(cfg, policy_dir, tokenizer=tokenizer, device=device,
                                               weight_version=weight_version, make_trainer=make_trainer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    critic = None
    if cfg.critic.enabled:
        from rl_core.train.critic import Critic

        saved = Path(critic_dir) if critic_dir is not None else None
        critic = Critic(saved if saved is not None else (cfg.critic.model_path or policy_dir), cfg.critic,
                        device=device, dtype=cfg.model.dtype, version=weight_version, packing=cfg.trainer.packing,
                        max_tokens_per_microbatch=cfg.trainer.max_tokens_per_microbatch)
        if saved is not None:
            critic.load_state(saved)
    return Parts(tokenizer=tokenizer, env=env, source=source, backend=backend, trainer=trainer,
                 loss=make_loss(cfg.loss, multi_update=needs_prev_logprobs(cfg)), sampler=make_sampler(cfg),
                 val_examples=val_examples, stop_token_ids=stop_ids, pad_id=pad, setup=setup, critic=critic)


def save_policy(parts, out_dir: str | Path, card: str | None = None, lora: bool = False) -> Path:
    """The trained policy as an HF directory (weights + tokenizer + the model card `card`), written
    atomically. `lora` (`trainer.lora.enabled`): the adapters merged into the base's weights (a
    plain HF directory), and the adapters themselves in `adapter/` (PEFT's format, with the
    tokenizer and the base model's identity: `peft.AutoPeftModelForCausalLM` loads it)."""
    from rl_core.checkpoint.card import write_card
    from rl_core.fsutil import atomic_dir

    with atomic_dir(out_dir, "final-policy") as tmp:
        if lora:
            from rl_core.adapters import merge_adapter_dir

            parts.trainer.save_pretrained(tmp / "adapter")
            parts.tokenizer.save_pretrained(str(tmp / "adapter"))
            merge_adapter_dir(tmp / "adapter", tmp)
        else:
            parts.trainer.save_pretrained(tmp)
        parts.tokenizer.save_pretrained(str(tmp))
        if card is not None:
            write_card(tmp, card)
    return Path(out_dir)


def run_controller(cfg: RecipeConfig, run_dir: str | Path, *, policy_dir: str | Path, stop_step: int | None = None,
                   resume=None, checkpoint_dir: str | Path | None = None, spool_dir: str | Path | None = None,
                   val_at_start: bool | None = None, val_at_end: bool | None = None,
                   final_policy_dir: str | Path | None = None) -> dict:
    """Build the parts (from `policy_dir`, or from a `LoadedCheckpoint` to resume) and run the
    controller until RL step `stop_step`; step checkpoints go to `checkpoint_dir/step_NNNNNN`."""
    from rl_core.checkpoint import prune, save_run_checkpoint
    from rl_core.checkpoint.card import held_out_at, render_card
    from rl_core.controller.controller import Controller
    from rl_core.train import close_trainer

    from rl_core.launch.trainer_group import wrap
    from rl_core.train.recovery import RecoveringTrainer

    if resume is not None:
        critic_dir = resume.path / "critic" if (resume.path / "critic").is_dir() else None
        parts = build_parts(cfg, resume.model_dir, trainer_state=resume.trainer_state,
                            weight_version=int(resume.trainer_state["version"]), critic_dir=critic_dir)
        restore = resume.controller_state
    else:
        parts = build_parts(cfg, policy_dir)
        restore = None
    # trainer.recovery: a lost worker rank's group is replaced in the job, from the newest step checkpoint
    parts.trainer = wrap(cfg, parts.trainer, base=resume.path if resume is not None else Path(policy_dir),
                         base_version=parts.trainer.version, run_dir=run_dir)
    total = parts.source.total_steps(cfg.grpo.max_num_steps)
    resolved = cfg.model_dump(mode="json")
    checkpoint_fn = None
    if checkpoint_dir is not None:
        ckdir = Path(checkpoint_dir)

        def checkpoint_fn(version: int, state: dict) -> None:
            name = f"step_{version:06d}"
            if state.get("open_step") is not None:  # between the mini-steps of RL step `version`
                name += f"_opt{parts.trainer.optimizer_steps:06d}"
            save_run_checkpoint(ckdir / name, trainer=parts.trainer, tokenizer=parts.tokenizer,
                                controller_state=state, resolved_config=resolved, critic=parts.critic,
                                held_out=held_out_at(controller.validations, version))
            if isinstance(parts.trainer, RecoveringTrainer):  # a replacement group starts here now
                parts.trainer.rebase(ckdir / name, version)
            prune(ckdir, cfg.checkpoint.keep_last)

    controller = Controller(cfg, parts, run_dir, total, stop_step=stop_step, restore=restore,
                            checkpoint_fn=checkpoint_fn, checkpoint_every=cfg.checkpoint.save_every_steps,
                            spool_dir=spool_dir, val_at_start=val_at_start, val_at_end=val_at_end)
    try:
        summary = run_async(controller.run())
        if isinstance(parts.trainer, RecoveringTrainer):
            import dataclasses

            from rl_core.fsutil import atomic_write_json

            summary["trainer_recoveries"] = [dataclasses.asdict(r) for r in parts.trainer.recoveries]
            atomic_write_json(Path(run_dir) / "summary.json", summary)
        if final_policy_dir is not None:
            version = parts.trainer.version
            save_policy(parts, final_policy_dir, render_card(resolved, rl_step=version,
                                                             held_out=held_out_at(controller.validations, version)),
                        lora=cfg.trainer.lora.enabled)
    finally:
        close_trainer(parts.trainer)  # multi-process trainers: release the worker ranks
    return summary


def train_from_recipe(cfg: RecipeConfig, resume_from: str | Path | None = None, recipe: str = "RECIPE") -> dict:
    """`rl-core train`: the whole run in this process; returns the controller's summary. The
    trained rollouts go to <run dir>/rollouts.spool/ step by step, and at the end into
    <run dir>/rollouts.h5 (`rl-core inspect`), as in a workflow epoch.

    Also the Python API (examples/notebook.ipynb): it blocks until the run ends, also when
    called where an event loop is running (a Jupyter notebook), see `run_async`.

    Step checkpoints go to <run dir>/steps/; if the run dir already holds one (a killed
    run), training resumes from the newest *intact* one (damaged newer ones are moved to
    <run dir>/damaged_checkpoints/ and reported). `resume_from`: a checkpoint to continue
    from instead (`--resume-from`), validated before anything is written; the run's newer
    step checkpoints are moved to <run dir>/set_aside_checkpoints/. Either way the chosen
    checkpoint's model shape must be the recipe's (`CheckpointError` otherwise)."""
    from rl_core.checkpoint import (check_checkpoint_matches, choose_resume, load_run_checkpoint, peek_resume,
                                    set_aside_newer, validate_resume_from)

    from rl_core.train import start_trainer_group

    check_device(cfg)  # device-dependent recipe rules, before anything is written or built
    rd = run_dir(cfg)
    picked = None
    if resume_from is not None:  # validated up front: before the resolved config is written or anything built
        picked = validate_resume_from(resume_from)
        check_checkpoint_matches(cfg, picked[0], rd)
    else:  # a plain rerun: the checkpoint it will continue from must fit the recipe, said before anything is written
        ahead = peek_resume(rd / "steps")
        if ahead is not None:
            check_checkpoint_matches(cfg, ahead, rd)
    from rl_core.fsutil import check_replaceable

    check_replaceable(rd / "final_policy", "final policy directory")  # replaced at the end: say so now, not then
    if policy_is_complete(rd / "init_policy"):  # a stale initial policy (another model shape): say so now
        from rl_core.checkpoint import check_model_matches

        out = rd / "init_policy"
        check_model_matches(cfg, out, what=f"the initial policy {out}",
                            fix=f"rebuild it for this recipe: `rl-core init-policy {recipe} --force` (replaces that "
                                f"directory, which rl_core wrote), or move {out} away.")
    from rl_core.data.reasoning_gym import generate_recipe_data

    generate_recipe_data(cfg)  # `data.generate`: the task's files, unless already there (cheap, no model)
    write_resolved(cfg, rd)
    setup_process(cfg)
    if start_trainer_group(cfg):  # ranks > 0 of a multi-process trainer followed rank 0 until the end
        return {}
    if picked is not None:
        latest = picked[0]
        set_aside_newer(latest, picked[1], rd / "steps")
        how = "chosen with --resume-from"
    else:
        latest = choose_resume(rd / "steps")
        how = "newest intact checkpoint"
    resume = None
    if latest is not None:
        check_checkpoint_matches(cfg, latest, rd)
        resume = load_run_checkpoint(latest, verified=True)
        print(f"[resume] continuing from {latest} (RL step {resume.rl_step}; {how})", flush=True)
        truncate_metrics(rd / "metrics.jsonl", resume.rl_step)
    policy = ensure_policy(cfg, rd / "init_policy", recipe) if resume is None else None
    from rl_core.rollout.spool import RolloutSpool

    spool = RolloutSpool(rd / "rollouts.spool")  # the trained rollouts of each step, as a workflow epoch keeps
    spool.truncate_after(resume.rl_step if resume is not None else 0)
    summary = run_controller(cfg, rd, policy_dir=policy, resume=resume, checkpoint_dir=rd / "steps",
                             spool_dir=spool.dir, val_at_start=None if resume is None else False,
                             final_policy_dir=rd / "final_policy")
    if spool.steps():  # rollouts.h5 for `rl-core inspect`, as the workflow's archive_rollouts rule writes
        from rl_core.archive import compile_spool

        compile_spool(spool.dir, rd / "rollouts.h5", attrs={"run": cfg.run_name})
        summary["rollouts"] = str(rd / "rollouts.h5")
    return summary


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric records logged after `step` by a run that was killed after its last checkpoint."""
    from rl_core.fsutil import atomic_write_text
    from rl_core.metrics.logger import read_jsonl

    if not path.exists():
        return
    keep = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
    import json

    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))
