"""The demo's synthetic verifiable tasks, with a character vocabulary.

* ``reverse`` (the demo default): ``48213=`` -> ``31284``. A tiny model imitates it within
  seconds; imitating *noisy* demonstrations leaves it right only about half the time when it
  samples, which is what RL against the exact-match verifier then fixes.
* ``addition``: ``123+456=`` -> ``579`` -- much harder for a tiny model (see data/warmup.py).
* ``reverse_longtail`` (the demo default): ``reverse`` with a long-tailed length. Most strings
  have 1 to ``digits`` digits; a fraction ``long_fraction`` has ``long_digits // 2`` to
  ``long_digits``. With the demo's 3 / 64 / 0.15 the response (digits and EOS) has a median of
  3 tokens and a p99 of about 60 (p99/p50 >= 10, the shape of Laminar's reasoning traces), and
  a batch of 16 prompts holds a long one 93% of the time, so a batch that waits for its longest
  member waits on a few long answers while the engines idle.

The tokenizer is a fixed character map (no files, nothing downloaded).
"""

from __future__ import annotations

import json
import random
from typing import Dict, Iterable, List, Optional

CHARS = "0123456789+="
PAD, EOS = 12, 13
VOCAB_SIZE = 16  # 12 characters, PAD, EOS, two spare ids (divisible by TP 2 and 4)


def encode(text: str) -> List[int]:
    return [CHARS.index(c) for c in text]


def decode(ids: Iterable[int]) -> str:
    out = []
    for i in ids:
        if i == EOS:
            break
        out.append(CHARS[i] if 0 <= i < len(CHARS) else "?")
    return "".join(out)


TASKS = ("reverse", "addition", "reverse_longtail", "tool_addition")


def longtail_digits(rng: random.Random, digits: int, long_digits: int,
                    long_fraction: float) -> int:
    """How many digits a ``reverse_longtail`` problem has (see the module docstring)."""
    if long_digits > digits and rng.random() < long_fraction:
        return rng.randint(max(digits + 1, long_digits // 2), long_digits)
    return rng.randint(1, digits)


def make_problem(rng: random.Random, digits: int, task: str = "addition", *,
                 long_digits: int = 0, long_fraction: float = 0.0) -> Dict[str, str]:
    if task == "reverse_longtail":
        n = longtail_digits(rng, digits, long_digits, long_fraction)
        x = "".join(str(rng.randrange(10)) for _ in range(n))
        return {"prompt": f"{x}=", "answer": x[::-1]}
    if task == "reverse":
        x = "".join(str(rng.randrange(10)) for _ in range(digits))
        return {"prompt": f"{x}=", "answer": x[::-1]}
    if task == "tool_addition":  # the agent demo's (data/agent_task.py): no leading zeros
        a, b = (rng.randrange(10 ** (digits - 1), 10 ** digits) for _ in range(2))
        return {"prompt": f"{a}+{b}", "answer": str(a + b)}
    if task != "addition":
        raise ValueError(f"LMC-E102: unknown task {task!r}: one of {', '.join(TASKS)}")
    a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
    return {"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "answer": str(a + b)}


def make_dataset(n: int, digits: int, task: str, seed: int, *, long_digits: int = 0,
                 long_fraction: float = 0.0) -> List[Dict[str, str]]:
    rng = random.Random(seed)
    return [make_problem(rng, digits, task, long_digits=long_digits, long_fraction=long_fraction)
            for _ in range(n)]


def max_sequence_length(digits: int, task: str, long_digits: int = 0) -> int:
    """The longest prompt + answer + EOS of a task (the model's position budget)."""
    n = max(digits, long_digits if task == "reverse_longtail" else 0)
    if task == "addition":
        return 2 * n + 2 + n + 1 + 1
    return 2 * n + 2


def position_budget(digits: int, task: str, long_digits: int = 0, max_new_tokens: int = 0,
                    slack: int = 32) -> int:
    """The demo model's ``max_position_embeddings``: the longest problem plus ``slack`` tokens
    of room, and the longest prompt plus ``max_new_tokens`` (engines refuse a request whose
    prompt and max_new_tokens exceed it), rounded up to a multiple of 64 (64 for the 5-digit
    tasks)."""
    longest = max_sequence_length(digits, task, long_digits)
    answer = max(digits, long_digits if task == "reverse_longtail" else 0) + 1
    need = max(longest + slack, longest - answer + max_new_tokens)
    return 64 * max(1, -(-need // 64))


def write_dataset(path: str, rows: List[Dict[str, str]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def addition_reward(response_text: str, answer: str, **_) -> float:
    """1.0 for exactly the right sum, else 0.0 (the verifier the demo trains against)."""
    return 1.0 if response_text.strip() == answer.strip() else 0.0


def noisy_demonstrations(problems: List[Dict[str, str]], wrong_fraction: float,
                         seed: int = 0) -> List[List[int]]:
    """Supervised warm-up sequences; ``wrong_fraction`` of them carry a corrupted answer (the
    imperfect imitation data that RL against the verifier then corrects)."""
    rng = random.Random(seed)
    out = []
    for p in problems:
        answer = p["answer"]
        if rng.random() < wrong_fraction:
            digits = list(answer)
            i = rng.randrange(len(digits))
            digits[i] = str((int(digits[i]) + rng.randrange(1, 10)) % 10)
            answer = "".join(digits)
        out.append(encode(p["prompt"] + answer) + [EOS])
    return out


def tiny_demo_config(hidden: int = 128, layers: int = 3, max_positions: int = 64,
                     moe: Optional[dict] = None, vocab: Optional[dict] = None):
    """The demo model: Qwen2, or Qwen3-MoE with the ``moe`` fields (num_experts, ...);
    ``vocab``: vocab_size, eos_token_id, pad_token_id of another tokenizer than the
    character map's (the agent demo's)."""
    from ..models.hf import build_hf_config

    return build_hf_config("qwen3_moe" if moe else "qwen2", **(moe or {}),
                           hidden_size=hidden, intermediate_size=hidden * 3,
                           num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=max_positions,
                           rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                           hidden_act="silu", bos_token_id=None,
                           **(vocab or dict(vocab_size=VOCAB_SIZE, eos_token_id=EOS,
                                            pad_token_id=PAD)))
