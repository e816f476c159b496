"""The policy model: tokenizer, tiny random-init model, supervised warm-up, initial policy.

`init_policy(cfg, out_dir)` is the entry point a run uses; the other names are its parts,
public so tests, benchmarks and other backends can build the same pieces.
"""

from rl_core.model.init_policy import INIT_REPORT, check_lengths, init_policy
from rl_core.model.tiny import (build_tiny_model, load_hf_dir, make_generation_config, num_parameters,
                                save_hf_dir, tiny_model_config, write_dir_atomically)
from rl_core.model.tokenizer import (CHAT_TEMPLATE, EOS_TOKEN, GENERIC_CORPUS, IM_END_TOKEN, IM_START_TOKEN,
                                     SPECIAL_TOKENS, build_tokenizer, digits_are_single_tokens, task_corpus,
                                     train_bpe, wrap_tokenizer)
from rl_core.model.warmup import (SFTTensors, encode_sft_examples, greedy_accuracy, greedy_decode, sft_loss,
                                  warmup)

__all__ = [
    "CHAT_TEMPLATE", "EOS_TOKEN", "GENERIC_CORPUS", "IM_END_TOKEN", "IM_START_TOKEN", "INIT_REPORT",
    "SFTTensors", "SPECIAL_TOKENS", "build_tiny_model", "build_tokenizer", "check_lengths",
    "digits_are_single_tokens", "encode_sft_examples", "greedy_accuracy", "greedy_decode", "init_policy",
    "load_hf_dir", "make_generation_config", "num_parameters", "save_hf_dir", "sft_loss", "task_corpus",
    "tiny_model_config", "train_bpe", "warmup", "wrap_tokenizer", "write_dir_atomically",
]
