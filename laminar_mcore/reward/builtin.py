"""Built-in reward functions. Signature: ``fn(response_text, answer, **row) -> float``."""

from __future__ import annotations


def exact_match(response_text: str, answer: str, **_) -> float:
    return 1.0 if response_text.strip() == str(answer).strip() else 0.0


def math_verify_reward(response_text: str, answer: str, **_) -> float:
    """1.0 when math-verify finds the response's final answer equal to the reference."""
    from math_verify import parse, verify

    gold = parse(str(answer) if "$" in str(answer) or "\\boxed" in str(answer) else f"${answer}$")
    pred = parse(response_text)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0
