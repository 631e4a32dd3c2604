"""The shape of ``bench.modes``' runs (steps, batch, replayed lengths, engines), which
``sim.calibrate`` simulates: the flags, their values as a command line, and the Hydra overrides
every mode's run shares.

Neutral (every module may import it; it imports nothing of ours), so the simulator shares the
benchmark's run shape without importing ``bench.modes``, whose runs start the trainer: the
simulator models the trainer, it never imports it.
"""

from __future__ import annotations

import argparse


def add_run_args(ap: argparse.ArgumentParser) -> None:
    """The runs' shape (steps, batch, replayed lengths, engines): also sim.calibrate's."""
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=160)
    ap.add_argument("--long-fraction", type=float, default=0.05)
    ap.add_argument("--engines", type=int, default=2)


def run_args(args) -> list:
    """``add_run_args``' values as command-line flags (sim.calibrate runs this benchmark)."""
    return [f"--steps={args.steps}", f"--batch-prompts={args.batch_prompts}",
            f"--samples={args.samples}", f"--short={args.short}", f"--long={args.long}",
            f"--long-fraction={args.long_fraction}", f"--engines={args.engines}"]


def run_overrides(args) -> list:
    """The Hydra overrides every mode's run shares."""
    return ["experiment=cpu_reverse", f"trainer.total_steps={args.steps}",
            f"trainer.train_batch_prompts={args.batch_prompts}",
            f"algo.n_samples_per_prompt={args.samples}",
            f"rollout.num_engines={args.engines}", "data.num_eval=8",
            f"rollout.forced_short_length={args.short}",
            f"rollout.forced_long_length={args.long}",
            f"rollout.forced_long_fraction={args.long_fraction}",
            "rollout.kv_capacity_tokens=65536", f"rollout.sampling.max_new_tokens={args.long}"]
