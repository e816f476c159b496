"""Supervised warm-up: teach a fresh tiny model the task's format until it is *sometimes* right.

Owns: packing examples into right-padded tensors with a completion-only loss mask
(`encode_sft_examples`); the loop (AdamW at `warmup.lr`, `warmup.batch_size` examples a step
from seeded shuffled epochs, a check every `warmup.eval_every_steps`); the check (a batched
greedy decode, `greedy_decode`, of the first `warmup.num_eval_prompts` held-out examples,
correct when the completion cut at the first end token is the reference answer and the end
token was produced); and the stop rule (the first check at `model.warmup.target_accuracy`,
else a `RecipeError` naming `model.warmup.max_steps`). Reproducible given the same initial
weights, seed and thread count; on a GPU (`device`) bf16 autocast and KV-cached checks.

Does not own: building the model or tokenizer, the prompt format or the answer (the
environment), or saving. Read more: docs/model.md, "The warm-up" (why a low target).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from rl_core.errors import RecipeError


@dataclass
class SFTTensors:
    """Right-padded supervised examples."""

    input_ids: torch.Tensor  # [N, T] long
    attention_mask: torch.Tensor  # [N, T] long, 1 = real token
    loss_mask: torch.Tensor  # [N, T] float, 1 = completion token (predicted from the one before)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def encode_sft_examples(prompts: Sequence[list[int]], completions: Sequence[list[int]], pad_id: int) -> SFTTensors:
    """Pack `prompt + completion` sequences; only completion positions carry loss."""
    assert len(prompts) == len(completions) and prompts, "need matching, non-empty prompts and completions"
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    n = len(prompts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, : len(p) + len(c)] = torch.tensor(list(p) + list(c), dtype=torch.long)
        attention[i, : len(p) + len(c)] = 1
        loss_mask[i, len(p): len(p) + len(c)] = 1.0
    return SFTTensors(input_ids, attention, loss_mask)


def sft_loss(model: torch.nn.Module, batch: SFTTensors) -> torch.Tensor:
    """Mean next-token cross-entropy over the completion tokens of the batch."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    targets = batch.input_ids[:, 1:]
    mask = batch.loss_mask[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                          reduction="none").view_as(mask)
    return (nll * mask).sum() / mask.sum().clamp_min(1.0)


@torch.no_grad()
def greedy_decode(model: torch.nn.Module, prompts: Sequence[list[int]], max_new_tokens: int, pad_id: int,
                  batch_size: int = 256, stop_ids: Sequence[int] = (), use_cache: bool = False) -> list[list[int]]:
    """Arg-max continuation of each prompt, exactly `max_new_tokens` tokens (cut at the end token yourself).

    Prompts of different lengths are left-padded, with position ids counted from each
    prompt's first real token. The model is put in eval mode and restored afterwards. It runs
    on the model's device (bf16 autocast on CUDA). `stop_ids`: a batch stops once every row
    has produced one of them, the rest filled with `pad_id`. `use_cache`: decode with the KV
    cache (one new token per forward) instead of re-running the whole sequence.
    """
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    device = next(model.parameters()).device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device) if stop_ids else None
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attention = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
                attention[i, width - len(p):] = 1
            ids, attention = ids.to(device), attention.to(device)
            done = torch.zeros((len(chunk), 1), dtype=torch.bool, device=device)
            past, step_ids, step_mask = None, ids, attention
            for _ in range(max_new_tokens):
                positions = (attention.cumsum(dim=1) - 1).clamp_min(0)
                if past is not None:
                    positions = positions[:, -1:]
                with autocast:
                    res = model(input_ids=step_ids, attention_mask=step_mask, position_ids=positions,
                                use_cache=use_cache, past_key_values=past)
                if use_cache:
                    past = res.past_key_values
                nxt = res.logits[:, -1].argmax(dim=-1, keepdim=True)
                nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
                ids = torch.cat([ids, nxt], dim=1)
                attention = torch.cat([attention, torch.ones_like(nxt)], dim=1)
                step_ids, step_mask = (nxt, attention) if use_cache else (ids, attention)
                if stops is not None:
                    done |= torch.isin(nxt, stops)
                    if bool(done.all()):
                        break
            gen = ids[:, width:]
            if gen.shape[1] < max_new_tokens:
                gen = torch.cat([gen, gen.new_full((len(chunk), max_new_tokens - gen.shape[1]), pad_id)], dim=1)
            out.extend(gen.tolist())
    finally:
        model.train(was_training)
    return out


def greedy_accuracy(model: torch.nn.Module, env: Any, examples: Sequence[dict[str, Any]],
                    use_cache: bool = False) -> tuple[float, int]:
    """(accuracy, number correct) of greedy completions under the environment's reference answers
    (decoding stops once every completion has ended)."""
    prompts = [env.prompt_ids(ex) for ex in examples]
    max_new = max(len(env.reference_completion_ids(ex)) for ex in examples)
    pad_id = env.tokenizer.pad_token_id if env.tokenizer.pad_token_id is not None else env.end_token_ids[0]
    generated = greedy_decode(model, prompts, max_new, pad_id, stop_ids=env.end_token_ids, use_cache=use_cache)
    end_ids = set(env.end_token_ids)
    correct = 0
    for ex, gen in zip(examples, generated):
        cut = next((k for k, tok in enumerate(gen) if tok in end_ids), None)
        if cut is None:
            continue
        if env.tokenizer.decode(gen[:cut]) == env.reference_text(ex):
            correct += 1
    return correct / len(examples), correct


def warmup(model: torch.nn.Module, env: Any, train_examples: Sequence[dict[str, Any]],
           val_examples: Sequence[dict[str, Any]], cfg: Any, seed: int,
           log: Callable[[str], None] | None = print, device: str = "cpu") -> dict[str, Any]:
    """Train until the greedy held-out accuracy reaches `cfg.target_accuracy` (a `WarmupConfig`).

    Returns stats: steps, accuracy, loss, seconds, target_accuracy, num_eval_prompts and
    the history of checks. Raises `RecipeError` (field `model.warmup.max_steps`) when
    `cfg.max_steps` steps never reach the target. On `device` "cuda" the model trains there
    (fp32 weights, bf16 autocast, each batch cut to its longest example, KV-cached checks)
    and is moved back to the CPU before this returns or raises.
    """
    if not train_examples or not val_examples:
        raise ValueError("the warm-up needs training and validation examples")
    if torch.device(device).type != "cuda":
        return _warmup(model, env, train_examples, val_examples, cfg, seed, log, None)
    model.to(device)
    try:
        return _warmup(model, env, train_examples, val_examples, cfg, seed, log, torch.device(device))
    finally:
        model.to("cpu")


def _on_gpu(batch: SFTTensors, device: torch.device) -> SFTTensors:
    """The batch on `device`, cut after its longest example (right padding: the cut columns
    are padding that no kept position attends to, so the loss is the same)."""
    width = int(batch.attention_mask.sum(dim=1).max())
    return SFTTensors(*(t[:, :width].to(device, non_blocking=True)
                        for t in (batch.input_ids, batch.attention_mask, batch.loss_mask)))


def _warmup(model: torch.nn.Module, env: Any, train_examples: Sequence[dict[str, Any]],
            val_examples: Sequence[dict[str, Any]], cfg: Any, seed: int,
            log: Callable[[str], None] | None, gpu: torch.device | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    pad_id = env.tokenizer.pad_token_id if env.tokenizer.pad_token_id is not None else env.end_token_ids[0]
    data = encode_sft_examples([env.prompt_ids(ex) for ex in train_examples],
                               [env.reference_completion_ids(ex) for ex in train_examples], pad_id)
    eval_examples = list(val_examples[: cfg.num_eval_prompts])
    batch_size = min(cfg.batch_size, len(data))
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    model.train()

    order = torch.randperm(len(data), generator=gen)
    cursor = 0
    history: list[dict[str, Any]] = []
    losses: list[float] = []
    for step in range(1, cfg.max_steps + 1):
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(data), generator=gen), 0
        idx = order[cursor:cursor + batch_size]
        cursor += batch_size
        batch = SFTTensors(data.input_ids[idx], data.attention_mask[idx], data.loss_mask[idx])
        if gpu is None:
            loss = sft_loss(model, batch)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = sft_loss(model, _on_gpu(batch, gpu))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))

        if step % cfg.eval_every_steps and step != cfg.max_steps:
            continue
        accuracy, num_correct = greedy_accuracy(model, env, eval_examples, use_cache=gpu is not None)
        mean_loss = sum(losses) / len(losses)
        losses.clear()
        record = {"step": step, "loss": round(mean_loss, 6), "accuracy": accuracy,
                  "num_correct": num_correct, "seconds": round(time.perf_counter() - t0, 3)}
        history.append(record)
        if log is not None:
            log(f"warmup step {step}/{cfg.max_steps}  loss {mean_loss:.4f}  held-out greedy accuracy "
                f"{accuracy:.1%} ({num_correct}/{len(eval_examples)})  {record['seconds']:.1f}s")
        if accuracy >= cfg.target_accuracy:
            return {
                "steps": step,
                "accuracy": accuracy,
                "loss": mean_loss,
                "seconds": time.perf_counter() - t0,
                "target_accuracy": cfg.target_accuracy,
                "num_eval_prompts": len(eval_examples),
                "history": history,
            }

    best = max(history, key=lambda r: r["accuracy"])
    raise RecipeError.single(
        "model.warmup.max_steps", cfg.max_steps,
        f"enough steps for the greedy held-out accuracy to reach model.warmup.target_accuracy "
        f"({cfg.target_accuracy:.1%}); the best check was {best['accuracy']:.1%} at step {best['step']}",
        "raise model.warmup.max_steps, lower model.warmup.target_accuracy, or change model.warmup.lr.")
