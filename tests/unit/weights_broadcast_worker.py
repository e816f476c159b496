"""One side of test_weights_broadcast.py: `python weights_broadcast_worker.py RANK PORT OUT`.

Rank 0 (the trainer side) sends three syncs over a 2-process gloo group with ~10 KB
buckets: odd-sized tensors of mixed dtypes (version 1), then the weights of two tiny
Qwen2 models with tied embeddings (versions 2 and 3). Rank 1 (a generation process)
receives the first with `recv` and loads the others into a real NativeEngine with
`receive_into`, checking its logits against each model's. Each writes a JSON report.
"""

from __future__ import annotations

import json
import sys

import torch


def misc() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a.bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16), "b.f32": torch.randn(5, generator=g),
            "c.i64": torch.arange(3), "d.scalar": torch.tensor(2.5), "e.f16": torch.randn(1, 1, generator=g).half()}


def model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=50, intermediate_size=64, max_position_embeddings=32, tie_word_embeddings=True,
                      initializer_range=0.3)
    return Qwen2ForCausalLM(cfg).eval()


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    from rl_core.weights import BroadcastGroup, WeightBroadcaster, WeightReceiver

    group = BroadcastGroup.create("127.0.0.1", port, rank, 2, device="cpu", timeout_s=120)
    result: dict = {}
    if rank == 0:
        sender = WeightBroadcaster(group, bucket_size_mb=0.01)
        reports = [sender.send(1, misc()), sender.send(2, model(1).state_dict()), sender.send(3, model(2).state_dict())]
        result["reports"] = [r.as_metrics() | {"version": r.version} for r in reports]
    else:
        from rl_core.generation import EngineOptions, NativeEngine

        receiver = WeightReceiver(group, bucket_size_mb=0.01)
        version, state, report = receiver.recv()
        want = misc()
        result["misc_version"] = version
        result["misc_equal"] = sorted(state) == sorted(want) and all(
            state[k].dtype == want[k].dtype and torch.equal(state[k], want[k]) for k in want)
        base = model(0)
        engine = NativeEngine(base.config, base.state_dict(), EngineOptions(max_batch_size=4))
        ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
        result["reports"], result["logit_diffs"], result["versions"] = [report.as_metrics()], [], []
        for seed in (1, 2):
            r = receiver.receive_into(engine)
            with torch.no_grad():
                diff = (engine.model.sequence_logits(ids) - model(seed)(ids).logits).abs().max().item()
            result["reports"].append(r.as_metrics())
            result["logit_diffs"].append(diff)
            result["versions"].append(engine.version)
    with open(out, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
