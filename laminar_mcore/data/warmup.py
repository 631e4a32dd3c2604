"""Supervised warm-up that builds the demo's starting checkpoint (cached on disk).

A short next-token training run of a freshly initialised tiny model on noisy demonstrations of
the task; the result is saved as a Hugging Face checkpoint that the trainer and the engines
load. Plain torch and transformers on one process: it is a data-preparation step, not the RL
trainer, and the controller runs it without the trainer's code (or Megatron).

Measured on 2 CPU cores (hidden 128, 3 layers, batch 64, AdamW 2e-3, answer-only loss): plain
3-digit addition stays near 0% exact match for 2000 steps (91 s); with the sum's digits
reversed it reaches ~10-15% at 1750-2000 steps after a long plateau, and 2-digit reaches ~11%
at 1200 steps. The end-to-end demo needs a task/model pair that reaches ~50% in about a minute.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from typing import Dict, List, Optional, Tuple

import torch


def warmup_checkpoint(out_dir: str, *, problems: List[Dict[str, str]], steps: int = 300,
                      batch_size: int = 64, lr: float = 3e-3, wrong_fraction: float = 0.4,
                      hidden: int = 128, layers: int = 3, seed: int = 0, max_positions: int = 64,
                      moe: Optional[dict] = None, log=print,
                      demonstrations: Optional[List[Tuple[List[int], List[int]]]] = None,
                      tokenizer=None) -> str:
    """Train (or reuse) the warm-up checkpoint; returns its directory. ``moe``: Qwen3-MoE
    fields (num_experts, ...) for a mixture-of-experts demo model; empty or None: Qwen2.
    ``demonstrations``: (tokens, mask) sequences to imitate where the mask is 1 (the agent
    demo's episodes, data/agent_task.py) instead of the character tasks' noisy answers;
    ``tokenizer``: theirs (saved with the checkpoint, its size and ids the model's)."""
    from transformers import AutoModelForCausalLM

    from ..models.hf import save_hf_checkpoint
    from .tasks import PAD, noisy_demonstrations, tiny_demo_config

    recipe = {"steps": steps, "batch_size": batch_size, "lr": lr, "wrong": wrong_fraction,
              "hidden": hidden, "layers": layers, "seed": seed, "n": len(problems),
              "first": problems[0] if problems else None, "version": 2}
    # the whole problem set, not only its first row: a long tail of other lengths (data.
    # long_digits, long_fraction) is another warm-up
    recipe["problems"] = hashlib.sha256(
        json.dumps(problems, sort_keys=True).encode()).hexdigest()
    if max_positions != 64:  # (the recipes cached before it was a parameter keep their key)
        recipe["max_positions"] = max_positions
    if moe:
        recipe["moe"] = moe
    if demonstrations is not None:
        recipe["demonstrations"] = hashlib.sha256(
            json.dumps(demonstrations).encode()).hexdigest()
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    path = os.path.join(out_dir, f"warmup-{key}")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        log(f"[warm-up] reusing cached checkpoint {path}")
        return path
    torch.manual_seed(seed)
    vocab = None
    if tokenizer is not None:
        from .chat import tokenizer_vocab_size

        vocab = dict(vocab_size=tokenizer_vocab_size(tokenizer),
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        pad = tokenizer.pad_token_id
    else:
        pad = PAD
    cfg = tiny_demo_config(hidden, layers, max_positions, moe=moe, vocab=vocab)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if demonstrations is not None:
        data = [list(ids) for ids, _ in demonstrations]
        masks = [list(m) for _, m in demonstrations]
    else:  # learn the answer, not the random operands
        data = noisy_demonstrations(problems, wrong_fraction, seed)
        masks = [[0] * len(p["prompt"]) + [1] * (len(d) - len(p["prompt"]))
                 for p, d in zip(problems, data)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    start = time.perf_counter()
    for step in range(steps):
        picks = [rng.randrange(len(data)) for _ in range(batch_size)]
        loss = _step_loss(model, data, masks, picks, pad)
        opt.zero_grad()
        if loss.requires_grad:
            loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"[warm-up] step {step + 1}/{steps} loss {loss.item():.3f} "
                f"({time.perf_counter() - start:.0f}s)")
    tmp = f"{path}.tmp-{os.getpid()}"  # runs sharing a cache may warm the same recipe at once
    from ..models import get_adapter

    # checkpoint layout (transformers keeps an MoE layer's experts fused in memory)
    save_hf_checkpoint(tmp, cfg, get_adapter(cfg).from_transformers_state(cfg, model.state_dict()))
    if tokenizer is not None:  # engines' OpenAI routes and the gateway's chat template
        tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, path)  # never leave a half-written cache entry
    except OSError:
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another run wrote the same recipe first
    return path


def warmup_cache_dir(output_dir: str) -> str:
    """Where warm-up checkpoints are cached: ``$LAMINAR_CACHE_DIR`` if set (runs with other
    output directories share it; the test suite does), else ``<output_dir>/.cache``."""
    return os.environ.get("LAMINAR_CACHE_DIR") or os.path.join(output_dir, ".cache")


# padded tokens of one warm-up forward pass; a batch whose padded size is over it (long-tailed
# tasks: one 300-token demonstration would pad 63 short ones to its length) goes in
# length-sorted chunks, the losses summed over the answer tokens of all of them
CHUNK_TOKENS = 4096


def _step_loss(model, data, masks, picks, pad: int):
    """The mean answer-token loss of one warm-up batch (the same objective in one pass or in
    chunks; a batch that fits ``CHUNK_TOKENS`` runs as one pass, as before)."""
    width = max(len(data[j]) for j in picks)
    if width * len(picks) <= CHUNK_TOKENS:
        chunks = [picks]
    else:
        chunks, cur = [], []
        for j in sorted(picks, key=lambda j: len(data[j])):
            if cur and (len(cur) + 1) * len(data[j]) > CHUNK_TOKENS:
                chunks.append(cur)
                cur = []
            cur.append(j)
        chunks.append(cur)
    parts = []
    for chunk in chunks:
        w = max(len(data[j]) for j in chunk)
        ids = torch.full((len(chunk), w), pad)
        labels = torch.full((len(chunk), w), -100)
        for i, j in enumerate(chunk):
            ids[i, :len(data[j])] = torch.tensor(data[j])
            trained = torch.tensor(masks[j], dtype=torch.bool)
            labels[i, :len(data[j])][trained] = ids[i, :len(data[j])][trained]
        if len(chunks) == 1:
            return model(input_ids=ids, labels=labels).loss
        n = int((labels[:, 1:] != -100).sum())  # the answer tokens this chunk's mean is over
        if n:
            parts.append((model(input_ids=ids, labels=labels).loss, n))
    count = sum(n for _, n in parts)
    return sum(loss * (n / count) for loss, n in parts) if parts else torch.zeros(())
