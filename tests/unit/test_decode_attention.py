"""The fused decode-attention kernel (generation/native/decode_attention.py) against the torch
decode layer (a cache in the model dtype and an FP8 cache, whose bytes it writes as
`quantize_fp8` does), and the fused sampling kernels (fused_sampling.py) against `sample_plain`, in
Triton's CPU interpreter (skipped where triton is not installed: CPU builds
of torch ship none; the same comparisons run on CUDA in tests/gpu/test_decode_attention_gpu.py),
and the option's errors, which need no triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_core.config import validate_dict
from rl_core.errors import EngineOptionsError, RecipeError
from rl_core.generation import EngineOptions
from rl_core.generation.native import decode_attention

from tests.helpers.decode_attention_check import check_engine_fp8, check_fp8_gaps, check_fp8_kernel, check_gaps
from tests.helpers.fused_mlp_check import check as check_mlp
from tests.helpers.fused_sampling_check import check as check_sampling
from tests.helpers.engine_models import make_engine, tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreted(module: str) -> list[dict]:
    """The JSON lines a check module prints when run on the CPU under Triton's interpreter (a
    subprocess: TRITON_INTERPRET is read when the kernels are defined)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-m", module, "cpu"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.skipif(not _triton_importable(), reason="triton is not installed (CPU torch ships none)")
def test_fused_decode_layer_equals_the_torch_layer_in_the_interpreter():
    lines = _interpreted("tests.helpers.decode_attention_check")
    assert len(lines) == 10, lines
    check_gaps(lines[:2])  # the kernel at TILE_SMALL (few rows)
    check_gaps(lines[2:4])  # at TILE, the tile of larger steps
    check_fp8_gaps(lines[4:6])  # an FP8 cache: the layers against each other
    check_fp8_kernel(lines[6:9])  # the kernel's FP8 bytes against quantize_fp8 (fp32, bf16, fp16)
    check_engine_fp8(lines[9]["engine_fp8"])  # greedy engines on an FP8 cache, fused against torch attention


def test_the_kernel_refuses_a_cache_and_scales_that_do_not_match():
    import torch

    from rl_core.generation.native.decode_attention import rope_store_attend

    qkv, cos, pos = torch.zeros(2, 6, 16), torch.ones(2, 16), torch.zeros(2, dtype=torch.long)
    fp8 = torch.zeros(3, 1, 8, 16, dtype=torch.float8_e4m3fn)
    scale = torch.ones(1)
    with pytest.raises(ValueError, match="float8_e4m3fn key cache.*k_scale None.*expected both caches float8"):
        rope_store_attend(qkv, cos, cos, pos, fp8, fp8.clone(), 4, 1)
    with pytest.raises(ValueError, match="float32 key cache.*k_scale given.*or both in qkv's dtype"):
        rope_store_attend(qkv, cos, cos, pos, torch.zeros(3, 1, 8, 16), torch.zeros(3, 1, 8, 16), 4, 1,
                          k_scale=scale, v_scale=scale)
    with pytest.raises(ValueError, match=r"k_scale / v_scale are torch.float32 \(2,\).*expected contiguous float32 \[1\]"):
        rope_store_attend(qkv, cos, cos, pos, fp8, fp8.clone(), 4, 1, k_scale=torch.ones(2), v_scale=scale)
    with pytest.raises(ValueError, match="the cache is torch.bfloat16 and qkv torch.float32"):
        rope_store_attend(qkv, cos, cos, pos, fp8.to(torch.bfloat16), fp8.to(torch.bfloat16), 4, 1)


@pytest.mark.skipif(not _triton_importable(), reason="triton is not installed (CPU torch ships none)")
def test_kernel_arguments_avoid_the_launchers_own_names():
    """Triton's launcher (not its interpreter) binds a kernel's arguments in generated code whose locals
    are `params`, `specialization`, `options`, `backend`, `specialize_impl`: an argument with one of
    those names reaches the launch as the wrong object ("failed to specialize argument of type: dict")."""
    import importlib
    import inspect

    reserved = {"params", "specialization", "options", "backend", "specialize_impl"}
    seen = 0
    for name in ("decode_attention", "fused_mlp", "fused_sampling", "split_k"):
        module = importlib.import_module(f"rl_core.generation.native.{name}")
        for attr, obj in vars(module).items():
            if not type(obj).__module__.startswith("triton"):
                continue
            while hasattr(obj, "fn"):  # autotuner -> jit function (or the interpreter's) -> the Python function
                obj = obj.fn
            args = set(inspect.signature(obj).parameters)
            seen += 1
            assert not reserved & args, (name, attr, sorted(reserved & args))
    assert seen >= 10, seen


@pytest.mark.skipif(not _triton_importable(), reason="triton is not installed (CPU torch ships none)")
def test_fused_sampling_equals_sample_plain_in_the_interpreter():
    check_sampling(_interpreted("tests.helpers.fused_sampling_check"))


@pytest.mark.skipif(not _triton_importable(), reason="triton is not installed (CPU torch ships none)")
def test_fused_gate_up_silu_equals_the_eager_mlp_in_the_interpreter():
    import torch

    lines = _interpreted("tests.helpers.fused_mlp_check")
    for line in lines[:-1]:
        check_mlp(getattr(torch, line["dtype"]), tuple(line["gaps"]))
    engines = lines[-1]["engine"]  # float32 engines through the fused stack against the torch attention's
    assert len(lines) == 10 and len(engines) == 3 and sum("tma" in line for line in lines) == 3, lines
    assert all(e["same_tokens"] and e["logprob_gap"] < 1e-4 for e in engines.values()), lines


@pytest.mark.skipif(not _triton_importable(), reason="triton is not installed (CPU torch ships none)")
def test_split_k_projection_and_add_norm_equal_torch_in_the_interpreter():
    import torch

    from tests.helpers.split_k_check import check as check_split_k

    lines = _interpreted("tests.helpers.split_k_check")
    assert len(lines) == 12 and {line["gaps"]["splits"] for line in lines} >= {1, 3, 4}, lines
    assert sum(line.get("tma", False) for line in lines) == 4, lines
    for line in lines:
        check_split_k(getattr(torch, line["dtype"]), line["gaps"])


def test_split_k_tma_tiles_launch_with_pointer_loads_where_tma_is_not_usable():
    from rl_core.generation.native import split_k

    assert any(tile[6] for tile in split_k.TILES.values())
    for tile in split_k.TILES.values():
        assert split_k.launch_tile(tile, True) == tile
        bm, bn, bk, splits, warps, stages, tma = split_k.launch_tile(tile, False)
        assert not tma and (bm, bn, splits, warps) == (tile[0], tile[1], tile[3], tile[4])
        assert bk <= split_k.POINTER_BLOCK_K and stages <= split_k.POINTER_STAGES
        assert (bm * bk + bk * bn) * 2 * stages <= 96 * 1024  # fits GPUs of ~100 KB of shared memory a block
    pointer = (64, 64, 128, 2, 4, 5, False)  # a pointer tile is launched as given
    assert split_k.launch_tile(pointer, False) == pointer


def test_decode_mlp_option_errors_name_the_field_and_the_fix():
    with pytest.raises(EngineOptionsError, match="`decode_mlp` got 'triton'.*one of torch, fused"):
        EngineOptions(decode_mlp="triton")
    with pytest.raises(EngineOptionsError, match="`decode_mlp`.*unless decode_attention is 'fused'"):
        EngineOptions(decode_mlp="fused", decode_path="static")
    assert EngineOptions(decode_attention="fused", decode_mlp="fused", decode_path="static").decode_mlp == "fused"


def test_decode_attention_option_errors_name_the_field_and_the_fix():
    with pytest.raises(EngineOptionsError, match="`decode_attention` got 'flash'.*one of torch, fused"):
        EngineOptions(decode_attention="flash")
    with pytest.raises(EngineOptionsError, match="`decode_attention`.*decode_path 'eager'"):
        EngineOptions(decode_attention="fused", decode_path="eager")
    assert EngineOptions(decode_attention="fused", decode_path="static").decode_attention == "fused"
    # the kernel writes and reads an FP8 cache (the device's limit is the engine's check, check_supported)
    assert EngineOptions(decode_attention="fused", decode_path="graph", kv_cache_dtype="fp8_e4m3").decode_attention \
        == "fused"


def test_the_engine_refuses_the_fused_kernel_where_it_cannot_run():
    model = tiny_model("qwen2", 0, 0.1, max_positions=64)
    why = "triton package is not installed" if decode_attention.triton is None else "runs on a CUDA device"
    if decode_attention.triton is not None and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter runs the kernel on the CPU")
    with pytest.raises(EngineOptionsError, match=f"`decode_attention` got 'fused'.*{why}.*use decode_attention"):
        make_engine(model, decode_path="static", decode_attention="fused")


@pytest.mark.parametrize("native, device, match", [
    ({"decode_attention": "fused"}, "cpu", "a CUDA runtime.device"),
    ({"decode_attention": "fused", "decode_path": "eager"}, "cuda", "decode_path is 'eager'"),
    ({"decode_attention": "fast"}, "cuda", "decode_attention"),
])
def test_recipe_errors_of_decode_attention(native, device, match):
    with pytest.raises(RecipeError, match=f"generation.native.decode_attention.*{match}"):
        validate_dict({"runtime": {"device": device}, "generation": {"native": native}})


def test_recipe_takes_the_fused_kernel_with_an_fp8_cache():
    cfg = validate_dict({"runtime": {"device": "cuda"},
                         "generation": {"native": {"decode_attention": "fused", "kv_cache_dtype": "fp8_e4m3"}}})
    opts = EngineOptions.from_recipe(cfg, device="cpu")
    assert (opts.decode_attention, opts.kv_cache_dtype) == ("fused", "fp8_e4m3")


def test_recipe_and_flags_of_decode_mlp():
    with pytest.raises(RecipeError, match="generation.native.decode_mlp.*decode_attention 'fused'.*it is 'torch'"):
        validate_dict({"runtime": {"device": "cuda"}, "generation": {"native": {"decode_mlp": "fused"}}})
    cfg = validate_dict({"runtime": {"device": "cuda"},
                         "generation": {"native": {"decode_mlp": "fused", "decode_attention": "fused"}}})
    assert EngineOptions.from_recipe(cfg, device="cpu").decode_mlp == "fused"
    from rl_core.generation.http.servers import EngineArgs
    from tests.unit.test_engine_options import serve_args

    opts = EngineOptions(device="cpu", decode_path="static", decode_attention="fused", decode_mlp="fused")
    args = serve_args(*EngineArgs(opts).flags())
    assert EngineOptions.from_serve_args(args, device=args.device, dtype=args.dtype) == opts
