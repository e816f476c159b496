"""A calculator-tool agent, written only against the `openai` package.

The model gets an arithmetic question and may use a calculator: through the chat
completions `tools` parameter when the model's chat template renders tools (the reply then
carries `tool_calls`), or else through text: a reply `CALC(<expression>)` asks for a
calculation. The agent runs the calculator, sends the result back (a `tool` message, or a
user message "= <value>"), and the model answers. Reward: 1 when the final answer is the
right number, 0 otherwise; at most `max_tool_calls` calculations.

    env: {type: agent, target: "examples.agents.calculator_agent:calculator_agent"}

(with a pretrained chat model, e.g. SmolLM2; the tiny toy model has never seen a calculator)
"""

from __future__ import annotations

import ast
import json
import operator
import re

import openai

TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SYSTEM = ("You can use a calculator. To use it, reply with only CALC(<expression>), e.g. CALC(12*7); you will get "
          "the result. When you know the answer, reply with only the number.")
CALL = re.compile(r"CALC\(([^()]*(?:\([^()]*\)[^()]*)*)\)")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """A safe arithmetic evaluator (no eval): numbers, + - * /, unary minus, parentheses."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {expression!r}")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def final_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text or "")
    return numbers[-1] if numbers else None


async def calculator_agent(client, example: dict, max_tool_calls: int = 2) -> float:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": example["prompt"]}]
    use_tools = True
    for _ in range(max_tool_calls + 1):
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages,
                                                         **({"tools": [TOOL]} if use_tools else {}))
        except openai.BadRequestError as exc:  # the template does not render tools: use the text protocol
            if use_tools and "tools" in str(exc):
                use_tools = False
                continue
            raise
        msg = reply.choices[0].message
        if msg.tool_calls:  # the tools path
            messages.append({"role": "assistant", "content": msg.content or "",
                             "tool_calls": [c.model_dump() for c in msg.tool_calls]})
            for call in msg.tool_calls:
                args = json.loads(call.function.arguments or "{}")
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculate(str(args.get("expression", "")))})
            continue
        text = msg.content or ""
        m = CALL.search(text)
        if m is None:  # a final answer
            return float(final_number(text) == str(example["answer"]).strip())
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"= {calculate(m.group(1))}"}]
    return 0.0
