"""The demo's synthetic verifiable task: multi-digit addition with a character vocabulary.

``123+456=`` -> ``579`` then end-of-sequence. Small enough for a tiny model on 2 CPU cores, hard
enough that exact-match reward has room to improve on an imperfect warm-up. The tokenizer is a
fixed character map (no files, nothing downloaded).
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


def make_problem(rng: random.Random, digits: int) -> Dict[str, str]:
    a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
    return {"prompt": f"{a:0{digits}d}+{b:0{digits}d}=", "answer": str(a + b)}


def write_dataset(path: str, n: int, digits: int = 3, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(make_problem(rng, digits)) + "\n")


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


def tiny_demo_config(hidden: int = 128, layers: int = 3):
    from ..models.hf import build_hf_config

    return build_hf_config("qwen2", hidden_size=hidden, intermediate_size=hidden * 3,
                           num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB_SIZE,
                           max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                           tie_word_embeddings=False, hidden_act="silu",
                           eos_token_id=EOS, pad_token_id=PAD, bos_token_id=None)


def load_jsonl(path: str, prompt_key: str = "prompt", answer_key: str = "answer",
               limit: Optional[int] = None) -> List[Dict[str, str]]:
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not JSON: {exc}") from None
            if prompt_key not in row:
                raise ValueError(f"{path}:{line_no}: no {prompt_key!r} field (data.prompt_key)")
            rows.append(row)
            if limit and len(rows) >= limit:
                break
    return rows
