"""LoRA against full weights, side by side in one run: refit bytes and seconds, the native engine's
merged adapters against a low-rank path in its forward, and (CUDA) the trainer's peak memory.

Run (prints tables; writes $OUT/lora_refit.json when OUT is set, or --json PATH):

    python bench/lora_refit.py                               # CPU: SmolLM2-135M (make setup), 2 threads
    python bench/lora_refit.py --device cuda --shape 0.5b    # GPU: the Qwen2.5-0.5B shape, + peak memory
    python bench/lora_refit.py --smoke                       # CPU, tiny shape: the code paths only

On a GPU: `--device cuda --shape 0.5b` builds a random-init Qwen2.5-0.5B-shaped model (nothing is
downloaded), runs every part in bf16 on one GPU and adds part 3. LoRA
needs PEFT beside torch and transformers: install the wheels peft==0.21.2 and accelerate==1.15.0
(`pip install --no-deps` both: their other requirements, huggingface_hub, numpy, packaging,
psutil, pyyaml, safetensors and tqdm, come with transformers). This file imports without PEFT;
without it, the run stops before any work and names the wheels.

Adapters: rank 16, alpha 32, every linear layer of the decoder (`trainer.lora` defaults), B set to
random values (a trained adapter's cost; B = 0 would merge nothing). Parts:
1. refit: what one refit moves and how long it takes, three ways: a full-weight trainer's weights, a
   LoRA trainer's adapters (`trainer.lora.refit: adapters`) and its merged weights (`merged`); each
   through the in-process transport (export + the engine's `update_weights`) and through a versioned
   safetensors directory (`filesystem`: export + write + the engine's load). Median of --repeats.
2. engine (skipped with --no-engine): the same adapters merged into the engine's weights (rl_core's
   path, rl_core.generation.native.lora) against a low-rank path that adds x A^T B^T to each adapted
   projection in the forward (the fused QKV and gate/up projections take one stacked A and one
   block-diagonal B: two extra products per projection). Both run the eager forward through the same
   `F.linear` wrapper (no adapters for the merged path), so only the extra products differ: the
   prefill of --batch prompts of 30 tokens, then the mean of --decode-steps decode steps of the batch;
   the refit (merge vs. re-stacking the adapters) and the memory each path adds.
3. memory (CUDA only): peak allocated memory of building the trainer and one split step (16 x 512
   tokens, microbatches of 8, bf16 weights and AdamW state), LoRA against full weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_step_gpu import SHAPE, build_model, chunk, write_json  # noqa: E402  (the 0.5B shape and its batch)

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
            intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=True)
LORA = {"enabled": True, "rank": 16, "alpha": 32.0}


def model_dir(args, root: Path) -> Path:
    if args.smoke:
        return build_model(root / "tiny", TINY, "cpu")
    if args.shape == "0.5b":
        return build_model(root / "qwen0.5b", SHAPE, "cpu")
    from rl_core.model.gguf import smollm2_hf_dir

    return Path(smollm2_hf_dir("float32"))


def trainer(path: Path, device: str, dtype: str, lora: dict | None):
    import torch

    from rl_core.config.schema import TrainerConfig
    from rl_core.train.torch_trainer import TorchTrainer

    t = TorchTrainer(path, TrainerConfig(lora=lora or {}, microbatch_size=8), device=device, dtype=dtype)
    if lora:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in t.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g).to(p) * 0.01)
    return t


def median_s(fn, repeats: int, device: str) -> float:
    import torch

    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def refit_rows(args, path: Path, root: Path) -> list[dict]:
    """Part 1: bytes and seconds of a refit into a native engine, in process and through files."""
    from rl_core.generation.native.engine import NativeEngine
    from rl_core.generation.native.options import EngineOptions
    from rl_core.weights import FilesystemWeightSync, state_dict_bytes

    rows = []
    engine = NativeEngine.from_pretrained(path, EngineOptions(device=args.device, dtype=args.dtype, max_batch_size=4,
                                                              max_seq_len=64))
    for name, lora in (("full weights", None), ("LoRA adapters", dict(LORA, refit="adapters")),
                       ("LoRA merged", dict(LORA, refit="merged"))):
        t = trainer(path, args.device, args.dtype, lora)
        weights = t.export_weights()
        nbytes = state_dict_bytes(weights)
        sync = FilesystemWeightSync(root / f"weights-{len(rows)}", keep_last_versions=1)
        version = iter(range(1, 10_000))
        in_s = median_s(lambda: engine.update_weights(next(version), t.export_weights()), args.repeats, args.device)

        def through_files():
            v = next(version)
            sync.write(v, t.export_weights())
            from rl_core.generation.native.model import load_safetensors_dir
            from rl_core.weights.filesystem import version_dir

            engine.update_weights(v, load_safetensors_dir(version_dir(sync.root, v)))

        fs_s = median_s(through_files, args.repeats, args.device)
        rows.append({"refit": name, "tensors": len(weights), "bytes": nbytes, "in_process_s": in_s,
                     "in_process_bytes_per_s": nbytes / in_s, "filesystem_s": fs_s,
                     "filesystem_bytes_per_s": nbytes / fs_s})
        del t, weights
    return rows


class LowRankF:
    """`torch.nn.functional` whose `linear` adds (x A^T) B^T for the weights in `adapters` (by id):
    the low-rank path, as the native model's forward would run it."""

    def __init__(self, adapters: dict):
        import torch.nn.functional as F

        self.adapters, self.F = adapters, F

    def linear(self, x, weight, bias=None):
        y = self.F.linear(x, weight, bias)
        ab = self.adapters.get(id(weight))
        return y if ab is None else y + self.F.linear(self.F.linear(x, ab[0]), ab[1])

    def __getattr__(self, name):
        return getattr(self.F, name)


def low_rank_stacks(model, adapters: dict) -> dict:
    """{id(fused weight): (A stacked [k r, in], B block-diagonal [out, k r])} of the engine's projections."""
    import torch

    from rl_core.adapters import adapter_pairs

    pairs = adapter_pairs(adapters)
    out = {}
    for i, layer in enumerate(model.model.layers):
        pre = f"model.layers.{i}."
        for weight, parts in ((layer.self_attn.qkv_weight, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              (layer.self_attn.o_proj.weight, ("self_attn.o_proj",)),
                              (layer.mlp.gate_up_weight, ("mlp.gate_proj", "mlp.up_proj")),
                              (layer.mlp.down_proj.weight, ("mlp.down_proj",))):
            ab = [pairs[pre + p] for p in parts]
            a = torch.cat([x[0] for x in ab]).to(weight)
            b = torch.block_diag(*[x[1] for x in ab]).to(weight)
            out[id(weight)] = (a, b)
    return out


def engine_rows(args, path: Path) -> list[dict]:
    """Part 2: merged adapters against the low-rank path in the engine's eager forward."""
    import torch

    import rl_core.generation.native.model as native_model
    from rl_core.generation.native.engine import NativeEngine
    from rl_core.generation.native.options import EngineOptions
    from rl_core.types import GenerationRequest, SamplingParams

    adapters = trainer(path, "cpu", "float32", dict(LORA, refit="adapters")).export_weights()
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (30,), generator=g).tolist() for _ in range(args.batch)]
    rows = []
    plain_f = native_model.F
    try:
        for name in ("merged", "low-rank", "merged", "low-rank"):  # twice, interleaved: load drifts
            engine = NativeEngine.from_pretrained(path, EngineOptions(device=args.device, dtype=args.dtype,
                                                                      max_batch_size=args.batch, max_seq_len=128,
                                                                      decode_path="eager"))
            t0 = time.perf_counter()
            if name == "merged":
                engine.update_weights(1, adapters)
                stacks, extra = {}, engine.adapters.base_bytes
            else:
                stacks = low_rank_stacks(engine.model, adapters)
                extra = sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in stacks.values())
            refit_s = time.perf_counter() - t0
            native_model.F = LowRankF(stacks)
            for i, p in enumerate(prompts):
                engine.add_request(GenerationRequest(f"r{i}", p, SamplingParams(greedy=True, max_tokens=64)))
            t0 = time.perf_counter()
            engine.step()
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(args.decode_steps):
                engine.step()
            decode_s = (time.perf_counter() - t0) / args.decode_steps
            native_model.F = plain_f
            rows.append({"path": name, "refit_s": refit_s, "prefill_s": prefill_s, "decode_step_s": decode_s,
                         "extra_bytes": extra})
    finally:
        native_model.F = plain_f
    return rows


def memory_rows(args, path: Path) -> list[dict]:
    """Part 3: peak allocated CUDA memory of building the trainer and one split step."""
    import gc

    import torch

    from rl_core.algorithms.losses import make_loss
    from rl_core.config.schema import LossConfig

    rows = []
    for name, lora in (("LoRA", LORA), ("full weights", None)):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t = trainer(path, "cuda", "bfloat16", lora)
        resident = torch.cuda.memory_allocated()
        c = chunk(json.loads((path / "config.json").read_text())["vocab_size"], 16, 512)
        step_s = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t.begin(make_loss(LossConfig()))
            t.train_microbatches(c)
            t.finish()
            torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t0)
        rows.append({"trainer": name, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                     "after_build_gib": resident / 2**30, "step_s": statistics.median(step_s[1:]),
                     "trainable_params": sum(p.numel() for p in t.model.parameters() if p.requires_grad)})
        del t, c
    return rows


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = [" | ".join(keys), " | ".join("---" for _ in keys)]
    lines += [" | ".join(fmt(r[k]) for k in keys) for r in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--shape", default="smollm2", choices=("smollm2", "0.5b"))
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: code paths only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=48, help="sequences of the engine comparison")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--no-engine", action="store_true", help="skip part 2")
    ap.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    ap.add_argument("--json", default=None, help="where to write the results (default $OUT/lora_refit.json)")
    args = ap.parse_args()
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        print("bench/lora_refit.py needs PEFT (the LoRA trainer's library): pip install --no-deps peft==0.21.2 "
              "accelerate==1.15.0 (or the wheels of those versions)", file=sys.stderr)
        return 2
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = model_dir(args, root)
        result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else f"cpu x{args.threads}",
                  "model": "tiny" if args.smoke else args.shape, "dtype": args.dtype, "lora": LORA,
                  "refit": refit_rows(args, path, root)}
        print(f"## refit ({result['device']}, {result['model']}, {args.dtype})\n{table(result['refit'])}\n")
        if not args.no_engine:
            result["engine"] = engine_rows(args, path)
            print(f"## native engine: merged adapters vs low-rank path (batch {args.batch})\n"
                  f"{table(result['engine'])}\n")
        if args.device == "cuda":
            result["memory"] = memory_rows(args, path)
            print(f"## trainer peak memory (16 x 512 tokens, bf16)\n{table(result['memory'])}\n")
    write_json(result, args.json, "lora_refit.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
