"""The agent demo's task (``experiment=cpu_agent``): sums of long numbers with a calculator.

A tiny model cannot add two 6-digit numbers, but it can copy: the operands into a tool call
(``<tool_call>{"name": "calculator", "arguments": {"expression": "123456+654321"}}</tool_call>``,
whose boilerplate is one token each side in the demo tokenizer, data/chat.py), then the tool's
answer into its final answer. Its supervised warm-up imitates noisy demonstrations: some answer
directly (a sum the model cannot compute), some call the tool with a miscopied operand or
miscopy its answer. RL with the calculator (agents/builtin.py) then makes the policy use the
tool and copy exactly.

Each demonstration is the token sequence an agent episode produces through the gateway (the
chat template's prompt, the sampled turns ending with the end-of-turn token, the template's
tokens for the tool message between them) with the mask of the tokens the policy writes.
"""

from __future__ import annotations

import random
from typing import Dict, List, Tuple

from .chat import DEMO_TOOL_CLOSE, DEMO_TOOL_OPEN, ChatFormat

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
TOOLS = [CALCULATOR_TOOL]


def _miscopy(rng: random.Random, text: str) -> str:
    """``text`` with one digit changed."""
    digits = [i for i, c in enumerate(text) if c.isdigit()]
    i = rng.choice(digits)
    return text[:i] + str((int(text[i]) + rng.randrange(1, 10)) % 10) + text[i + 1:]


def user_messages(row: Dict[str, str]) -> List[dict]:
    return [{"role": "user", "content": row["prompt"]}]


def tool_demonstrations(problems: List[Dict[str, str]], chat: ChatFormat, *,
                        wrong_fraction: float = 0.5, direct_fraction: float = 0.4,
                        seed: int = 0) -> List[Tuple[List[int], List[int]]]:
    """(tokens, mask) per problem: ``direct_fraction`` answer at once with the true sum (which a
    tiny model only imitates in form), the others call the calculator; of those,
    ``wrong_fraction`` miscopy an operand or the tool's answer."""
    rng = random.Random(seed)
    eos = chat.eos_id
    out = []
    for p in problems:
        messages = user_messages(p)
        tokens = chat.prompt(messages, TOOLS)
        mask = [0] * len(tokens)

        def sampled(ids):
            tokens.extend(ids)
            mask.extend([1] * len(ids))

        if rng.random() < direct_fraction:
            sampled(chat.encode(p["answer"]) + [eos])
            out.append((tokens, mask))
            continue
        expr = p["prompt"]
        wrong = rng.random() < wrong_fraction
        call_wrong = wrong and rng.random() < 0.5
        if call_wrong:
            expr = _miscopy(rng, expr)
        sampled(chat.encode(f"{DEMO_TOOL_OPEN}{expr}{DEMO_TOOL_CLOSE}") + [eos])
        a, b = expr.split("+")
        result = str(int(a) + int(b))
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calculator", "arguments": f'{{"expression": "{expr}"}}'}}
        history = messages + [{"role": "assistant", "content": "", "tool_calls": [call]}]
        env = chat.continuation(history, [{"role": "tool", "tool_call_id": "call_0",
                                           "content": result}], TOOLS)
        tokens.extend(env)
        mask.extend([0] * len(env))
        answer = _miscopy(rng, result) if wrong and not call_wrong else result
        sampled(chat.encode(answer) + [eos])
        out.append((tokens, mask))
    return out
