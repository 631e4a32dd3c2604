"""bench.gpu's ``loop`` check: the demo's train job end to end on this machine -- the trainer on
the GPU in bf16, a relay, two CPU engines and the real controller, each a process of its own as
``python -m laminar_mcore.launch`` starts them -- saved, killed after its last step's save (the
newest checkpoint removed, as if the run had died before it) and resumed from the one before.

The job runs in child processes, so this check alone needs Hydra, OmegaConf and aiohttp (the
launcher's); the bench process itself still imports none of them. Nothing is forced: the
trainer -> relay channel is what ``weight_sync.publish_backend=auto`` decides from both ends
(on one host, shared memory; never NCCL with both ends on one GPU)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

from .common import Bench

STEPS_GPU, STEPS_CPU = 10, 4


def _launch(out_dir: str, overrides: List[str], timeout: float) -> Tuple[int, str, float]:
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run([sys.executable, "-m", "laminar_mcore.launch", *overrides],
                              cwd=out_dir, capture_output=True, text=True, timeout=timeout,
                              env=env)
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, text + f"\n(timed out after {timeout:.0f} s)", time.perf_counter() - t0
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0


def _train_records(run_dir: str) -> List[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("kind") == "train"]


def check_loop(b: Bench) -> Tuple[bool, str]:
    steps = STEPS_GPU if b.cuda else STEPS_CPU
    every = steps // 2
    work = tempfile.mkdtemp(prefix="laminar-gpu-loop-")
    run_dir = os.path.join(work, "out", "loop")
    common = ["experiment=cpu_demo", "output_dir=out", "run_name=loop", "model.dtype=bf16",
              "rollout.num_engines=2", f"trainer.total_steps={steps}",
              f"trainer.save_interval={every}", f"trainer.eval_interval={steps}",
              "trainer.lr_warmup_steps=1", "data.warmup_steps=20", "data.num_eval=32"]
    timeout = 240.0 if b.cuda else 420.0
    logs: Dict[str, str] = {}
    try:
        rc, logs["first"], first_s = _launch(work, common, timeout)
        if rc != 0:
            b.figures["loop_log_tail"] = logs["first"][-3000:]
            return False, f"the first run exited {rc}: {logs['first'][-600:]}"
        first = _train_records(run_dir)
        ckpts = os.path.join(run_dir, "checkpoints")
        saved = sorted(d for d in os.listdir(ckpts) if d.startswith("step_"))
        shutil.rmtree(os.path.join(ckpts, f"step_{steps:08d}"))  # as if it died after the save
        rc, logs["resumed"], resumed_s = _launch(work, common + ["trainer.resume=auto"], timeout)
        if rc != 0:
            b.figures["loop_log_tail"] = logs["resumed"][-3000:]
            return False, f"the resumed run exited {rc}: {logs['resumed'][-600:]}"
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        resumed = _train_records(run_dir)[len(first):]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    resumed_steps = [r["step"] for r in resumed]
    trainer = next((line.split("[trainer] ", 1)[1] for line in logs["first"].splitlines()
                    if "[trainer] model on " in line), "")
    on_gpu = "model on cuda" in trainer and "bfloat16" in trainer
    channel = next((line.split("channel ", 1)[1].split()[0] for line in logs["first"].splitlines()
                    if "[publish] stage 0: channel " in line), "")
    mismatch = [r["mismatch_mean"] for r in first + resumed if r.get("mismatch_tokens")]
    p99 = [r["mismatch_p99"] for r in first + resumed if r.get("mismatch_tokens")]
    blocked = [r["publish_blocked_s"] for r in first + resumed if "publish_blocked_s" in r]
    sent = [r["weights_sent_bytes"] for r in first + resumed if "weights_sent_bytes" in r]
    engines = summary.get("final_engine_versions") or {}
    b.figures.update({
        "loop_trainer": trainer, "loop_publish_channel": channel, "loop_steps": steps, "loop_saved": saved, "loop_resumed_steps": resumed_steps,
        "loop_final_version": summary.get("final_version"),
        "loop_final_engine_versions": engines, "loop_engines_agree": summary.get("engines_agree"),
        "loop_books_balance": summary.get("books_balance"),
        "loop_trainer_tokens_per_s": summary.get("trainer_tokens_per_s"),
        "loop_mismatch_mean": sum(mismatch) / len(mismatch) if mismatch else None,
        "loop_mismatch_p99_max": max(p99) if p99 else None,
        "loop_publish_blocked_s_mean": sum(blocked) / len(blocked) if blocked else None,
        "loop_weights_sent_bytes_max": max(sent) if sent else None,
        "loop_first_run_s": first_s, "loop_resumed_run_s": resumed_s})
    ok = ("bfloat16" in trainer and on_gpu == b.cuda and channel == "shm"
          and summary.get("books_balance") is True and summary.get("final_version") == steps
          and resumed_steps == list(range(every + 1, steps + 1))
          and len(engines) == 2 and set(engines.values()) == {steps}
          and bool(mismatch) and max(p99) < 0.5)
    b.exercised("train_job", f"python -m laminar_mcore.launch: trainer {trainer}; a relay, 2 "
                f"CPU engines, the controller; {steps} steps")
    b.exercised("checkpoint_resume", f"saved every {every} steps, the last removed, resumed "
                f"from step {every}: steps {resumed_steps}")
    b.exercised("engines_at_trained_version", f"engines at {sorted(set(engines.values()))}")
    b.exercised("publish_channel", f"{channel or 'none found'} (publish_backend=auto, the "
                "relay on the trainer's host)")
    b.not_exercised("nccl_publish_channel", "one host: auto publishes through shared memory "
                    "(NCCL is for a relay on another host)")
    if not on_gpu:
        b.not_exercised("trainer_on_gpu", "no GPU (CPU rehearsal)")
    return ok, (f"{steps} steps, resumed at {every}: books "
                f"{'balanced' if summary.get('books_balance') else 'NOT balanced'}, engines at "
                f"{sorted(set(engines.values()))}, trainer "
                f"{summary.get('trainer_tokens_per_s') or 0:.0f} tokens/s, mismatch mean "
                f"{b.figures['loop_mismatch_mean'] or 0:.1e}, p99 max "
                f"{b.figures['loop_mismatch_p99_max'] or 0:.1e}, runs {first_s:.0f} + "
                f"{resumed_s:.0f} s")
