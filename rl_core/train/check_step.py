"""A launch check for the trainer backends: a few RL steps on one fixed synthetic batch.

    python -m rl_core.train.check_step MODEL_DIR --backend fsdp2 --out result.json
    torchrun --nproc-per-node 2 -m rl_core.train.check_step MODEL_DIR --backend fsdp2 --out r.json
    srun -n 2 python -m rl_core.train.check_step MODEL_DIR --backend fsdp2 --out r.json

Owns: the synthetic batch (`synthetic_chunk`: seeded prompts, completions, advantages and
generation logprobs) and the check: every process runs this module, the trainer group forms
from the launcher's environment, rank 0 drives and writes a JSON result (per-step loss and
gradient norm, logprobs before and after, the world, the rendezvous source) and, with
`--save-weights`, the exported weights, so backends and world sizes compare number by number.

Does not own: the trainers. Read more: docs/distributed-training.md (check a launch before a
long run).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch


def synthetic_chunk(vocab_size: int, num_samples: int = 12, seed: int = 0, max_prompt: int = 6,
                    max_completion: int = 8, mask_every: int = 0):
    """A fixed batch of `num_samples` samples of mixed lengths (right padded), with advantages;
    `mask_every` k > 0 excludes every k-th sample from the loss (env_mask, sample_mask 0)."""
    from rl_core.packing import make_train_chunk
    from rl_core.types import Sample

    g = torch.Generator().manual_seed(seed)
    samples, advs = [], []
    for i in range(num_samples):
        p = int(torch.randint(2, max_prompt + 1, (1,), generator=g))
        c = int(torch.randint(1, max_completion + 1, (1,), generator=g))
        prompt = torch.randint(0, vocab_size, (p,), generator=g).tolist()
        comp = torch.randint(0, vocab_size, (c,), generator=g).tolist()
        gen_lp = (-torch.rand(c, generator=g) * 3 - 1).tolist()
        samples.append(Sample(prompt_ids=prompt, completion_ids=comp, gen_logprobs=gen_lp, reward=float(i % 2),
                              finish_reason="stop", start_version=0, end_version=0,
                              env_mask=mask_every > 0 and i % mask_every == 0))
        advs.append(float(torch.randn(1, generator=g)))
    return make_train_chunk(samples, advs, pad_id=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--backend", default="fsdp2", choices=("torch", "fsdp2", "megatron"))
    ap.add_argument("--out", required=True, help="JSON result (written by rank 0)")
    ap.add_argument("--save-weights", default=None, help="safetensors file of the exported weights after training")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--num-samples", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mask-every", type=int, default=0, help="exclude every k-th sample from the loss (0 = none)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="recipe override, e.g. trainer.microbatch_size=4 (repeatable)")
    args = ap.parse_args(argv)

    from rl_core.algorithms.losses import make_loss
    from rl_core.config.loader import apply_overrides, validate_dict
    from rl_core.distributed import detect_env
    from rl_core.train import close_trainer, make_trainer, start_trainer_group

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(args.seed)
    torch.set_num_threads(int(os.environ.get("RL_CORE_CHECK_THREADS", "1")))
    data = apply_overrides({"trainer": {"backend": args.backend}, "runtime": {"device": "cpu"}}, args.set)
    cfg = validate_dict(data)
    env = detect_env()
    if start_trainer_group(cfg):
        return 0  # a worker rank: served until rank 0 closed the group
    vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    chunk = synthetic_chunk(vocab, args.num_samples, args.seed, mask_every=args.mask_every)
    trainer = make_trainer(cfg, args.model_dir)
    loss = make_loss(cfg.loss)
    steps = []
    try:
        initial = trainer.logprobs(chunk).float().cpu()  # on the trainer's device (cuda for torch on GPU)
        half = chunk.num_samples // 2
        for _ in range(args.steps):
            trainer.begin(loss)
            trainer.train_microbatches(chunk.slice(0, half))  # two chunks: streaming into one step
            trainer.train_microbatches(chunk.slice(half, chunk.num_samples))
            m = trainer.finish()
            steps.append({"loss": m.get("loss"), "grad_norm": m.get("grad_norm"), "num_tokens": m["num_tokens"],
                          "flops_total": m.get("flops/total"), "flops_train": m.get("flops/train"),
                          "flops_per_s": m.get("flops/per_s"), "compute_s": m.get("compute_s"), "lr": m.get("lr")})
        lp = trainer.logprobs(chunk).float().cpu()
        weights = trainer.export_weights()
    finally:
        close_trainer(trainer)
    mask = chunk.loss_mask
    result = {"backend": args.backend, "world_size": env.world_size, "source": env.source,
              "host": socket.gethostname(), "steps": steps, "version": trainer.version,
              "logprob_sum": float((lp * mask).sum()), "logprobs": (lp * mask).tolist(),
              "logprobs_initial": (initial * mask).tolist()}
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.save_weights:
        from safetensors.torch import save_file

        save_file({k: v.detach().float().clone() for k, v in weights.items()}, args.save_weights)
    return 0


if __name__ == "__main__":
    sys.exit(main())
