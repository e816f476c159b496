"""EngineOptions (the native engine's settings, validated once) and the generation-backend registry.

Covers: each invalid option raises `EngineOptionsError` naming the option; `from_recipe` and
`from_serve_args` re-raise it naming the recipe field or the `rl-core serve` flag; a local
server's flags (`EngineArgs`) parse back into the same options; the registry builds the
recipe's native backend from a model directory, turns the engine's model checks into recipe
errors, and `import rl_core.generation` imports neither vLLM nor torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import typing
from types import SimpleNamespace

import pytest

from rl_core.config.generation_sections import GenerationConfig
from rl_core.errors import ArgumentError, EngineOptionsError, RecipeError
from rl_core.generation import GENERATION_BACKENDS, make_generation_backend
from rl_core.generation.http.servers import EngineArgs
from rl_core.generation.native.options import EngineOptions
from rl_core.launch.serve import add_serve_args
from tests.helpers.paths import ROOT
from tests.helpers.recipes import recipe


@pytest.mark.parametrize("field, value", [
    ("max_batch_size", 0), ("max_seq_len", 1), ("max_num_kv_tokens", 1), ("kv_cache_dtype", "fp16"),
    ("kv_scale_margin", 0.0), ("decode_path", "fast"), ("weight_version", -1), ("dtype", "int8"),
    ("eos_token_ids", (-1,)), ("decode_compile", "yes"), ("seed", 1.5),
])
def test_each_invalid_option_is_named(field, value):
    with pytest.raises(EngineOptionsError, match=f"`{field}` got") as info:
        EngineOptions(**{field: value})
    assert info.value.field == field and isinstance(info.value, ValueError)
    assert "expected" in str(info.value) and "Fix:" in str(info.value) and "\n" not in str(info.value)


def test_rules_between_options():
    with pytest.raises(EngineOptionsError, match="`max_step_tokens`.*max_batch_size \\(16\\)"):
        EngineOptions(max_batch_size=16, max_step_tokens=8)
    for flag in ("decode_compile", "overlap_steps"):
        with pytest.raises(EngineOptionsError, match=f"`{flag}`.*'eager'"):
            EngineOptions(decode_path="eager", **{flag: True})
    ok = EngineOptions(decode_path="static", decode_compile=True, overlap_steps=True, eos_token_ids=[2, 3])
    assert ok.eos_token_ids == (2, 3)  # stored as a tuple: the record is frozen
    with pytest.raises(dataclasses.FrozenInstanceError):
        ok.max_batch_size = 1  # type: ignore[misc]
    with pytest.raises(EngineOptionsError, match="max_step_tokens"):
        ok.replace(max_step_tokens=4, max_batch_size=8)  # a copy is checked again


def test_from_recipe_reads_the_generation_section_and_names_recipe_fields():
    cfg = recipe(generation={"max_batch_size": 12, "native": {"max_seq_len": 64, "kv_cache_dtype": "fp8_e4m3",
                                                               "decode_path": "static", "overlap_steps": True}},
                 grpo={"seed": 7})
    opts = EngineOptions.from_recipe(cfg, device="cpu", weight_version=3)
    assert (opts.max_batch_size, opts.max_seq_len, opts.kv_cache_dtype, opts.decode_path, opts.overlap_steps,
            opts.seed, opts.weight_version, opts.dtype) == (12, 64, "fp8_e4m3", "static", True, 7, 3, cfg.model.dtype)
    bad = SimpleNamespace(model=cfg.model, grpo=cfg.grpo, generation=SimpleNamespace(
        max_batch_size=4, native=cfg.generation.native.model_copy(update={"decode_path": "fast"})))
    with pytest.raises(RecipeError, match="field `generation.native.decode_path` got 'fast'"):
        EngineOptions.from_recipe(bad, device="cpu")


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(["MODEL_DIR", *flags])


def test_from_serve_args_names_the_flag():
    opts = EngineOptions.from_serve_args(serve_args("--max-batch-size", "5", "--decode-path", "static"),
                                         device="cpu", dtype="float32", eos_token_ids=[4, 2])
    assert (opts.max_batch_size, opts.decode_path, opts.eos_token_ids) == (5, "static", (4, 2))
    with pytest.raises(ArgumentError, match="option `--kv-scale-margin` got -1.0"):
        EngineOptions.from_serve_args(serve_args("--max-batch-size", "5", "--kv-scale-margin", "-1"),
                                      device="cpu", dtype="float32")
    with pytest.raises(ArgumentError, match="option `--overlap-steps`"):
        EngineOptions.from_serve_args(serve_args("--max-batch-size", "5", "--decode-path", "eager",
                                                 "--overlap-steps"), device="cpu", dtype="float32")


def test_a_local_servers_flags_parse_back_into_the_same_options():
    opts = EngineOptions(device="cpu", dtype="bfloat16", max_batch_size=6, max_seq_len=40, max_num_kv_tokens=100,
                         kv_cache_dtype="fp8_e4m3", kv_scale_margin=1.5, decode_path="static", decode_compile=True,
                         overlap_steps=True, seed=11)
    args = serve_args(*EngineArgs(opts, torch_num_threads=2).flags())
    assert EngineOptions.from_serve_args(args, device=args.device, dtype=args.dtype) == opts
    assert args.torch_num_threads == 2
    with pytest.raises(EngineOptionsError, match="`eos_token_ids`.*local server"):
        EngineArgs(EngineOptions(eos_token_ids=[1]))


def test_the_registry_covers_every_backend_of_the_schema():
    names = typing.get_args(GenerationConfig.model_fields["backend"].annotation)
    assert set(GENERATION_BACKENDS) == set(names) == {"native", "http", "vllm"}
    cfg = SimpleNamespace(generation=SimpleNamespace(backend="tensorrt"))
    with pytest.raises(RecipeError, match="field `generation.backend` got 'tensorrt'; expected one of native"):
        make_generation_backend(cfg, "unused", tokenizer=None, device="cpu")


def test_the_registry_builds_the_native_backend_and_names_recipe_fields(tmp_path):
    from rl_core.generation import NativeBackend
    from tests.helpers.engine_models import tiny_model

    tiny_model().save_pretrained(tmp_path)
    cfg = recipe(generation={"max_batch_size": 3, "native": {"max_seq_len": 32}})
    backend = make_generation_backend(cfg, tmp_path, tokenizer=None, device="cpu", weight_version=2)
    engine = backend.engine
    assert isinstance(backend, NativeBackend) and backend.lockstep == cfg.async_rl.reproducible
    assert (engine.max_batch_size, engine.max_seq_len, engine.version) == (3, 32, 2)
    tiny_model(max_positions=16).save_pretrained(tmp_path / "short")  # a context shorter than max_seq_len
    with pytest.raises(RecipeError, match="field `generation.native.max_seq_len` got 32; expected an integer in "
                                          "\\[2, 16\\]"):
        make_generation_backend(cfg, tmp_path / "short", tokenizer=None, device="cpu")


def test_importing_generation_imports_neither_vllm_nor_torch():
    code = ("import sys, rl_core.generation, rl_core.generation.vllm, rl_core.generation.native, "
            "rl_core.generation.http, rl_core.generation.native.options; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_spawned_vllm_server_gets_the_directory_holding_rl_core_on_its_path():
    """The vLLM server process imports rl_core's worker extension through PYTHONPATH=ROOT: ROOT
    must hold rl_core/ (after the move into generation/vllm/ it pointed at rl_core/ itself, and
    rl_core/types.py then shadowed the standard library's `types`: the server died at start)."""
    from rl_core.generation.vllm import server

    assert (server.ROOT / "rl_core" / "__init__.py").is_file()
    assert not (server.ROOT / "types.py").exists()
