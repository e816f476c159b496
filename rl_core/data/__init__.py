"""Prompt data: the toy task's generator (`addition`) and reading/ordering examples (`dataset`).

Owns files on disk and the order prompts are drawn in; never tokens, rewards or models.
"""

from rl_core.data.addition import format_answer, format_prompt, make_addition_data, parse_answer
from rl_core.data.dataset import PromptDraw, PromptSource, load_jsonl, load_task_data

__all__ = [
    "PromptDraw", "PromptSource", "format_answer", "format_prompt", "load_jsonl", "load_task_data",
    "make_addition_data", "parse_answer",
]
