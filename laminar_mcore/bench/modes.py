"""The three modes side by side: trainer-consumed tokens/s and idle fractions, one run.

    python -m laminar_mcore.bench.modes [--steps 20] [--json PATH]

Same model (the demo's warm-up checkpoint), same prompts, same machine, and the same
long-tailed response lengths in every mode (replayed deterministically per trajectory: most
are short, a few are 20x longer, p99 > 10x p50 as in Laminar's traces). ``sync`` generates a
batch, trains, then syncs every engine; ``one_step`` overlaps one batch of generation with
training behind a global barrier; ``laminar`` lets each engine pull new weights between
trajectories and the trainer consume groups as soon as they are complete. Throughput and idle
fractions are the steady state's: from the end of the first training step (process start-up and
the first model build excluded, in every mode) to the end of the last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=160)
    ap.add_argument("--long-fraction", type=float, default=0.05)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--modes", default="sync,one_step,laminar")
    ap.add_argument("--max-staleness", default="null",
                    help="laminar's admission bound eta (null: unbounded, Laminar's default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from hydra import compose, initialize_config_dir

    from ..config import register_configs, validate_config
    from ..config.paths import conf_dir
    from ..controller.server import length_fn_from_config
    from ..launch.train import run_train
    from .common import report

    register_configs()
    results, steps_s, first_s = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="laminar-bench-modes-") as tmp:
        for mode in args.modes.split(","):
            overrides = ["experiment=cpu_reverse", f"mode={mode}", f"output_dir={tmp}",
                         f"run_name={mode}",
                         f"trainer.total_steps={args.steps}",
                         f"trainer.train_batch_prompts={args.batch_prompts}",
                         f"algo.n_samples_per_prompt={args.samples}",
                         f"algo.max_staleness={args.max_staleness}",
                         f"rollout.num_engines={args.engines}", "data.num_eval=8",
                         f"rollout.forced_short_length={args.short}",
                         f"rollout.forced_long_length={args.long}",
                         f"rollout.forced_long_fraction={args.long_fraction}",
                         "rollout.kv_capacity_tokens=65536",
                         f"rollout.sampling.max_new_tokens={args.long}"]
            with initialize_config_dir(config_dir=conf_dir(), version_base=None):
                cfg = compose(config_name="config", overrides=overrides)
            validate_config(cfg)
            results[mode] = run_train(cfg)
            steps_s[mode] = _step_seconds(os.path.join(tmp, mode, "metrics.jsonl"))
            first_s[mode] = _step_seconds(os.path.join(tmp, mode, "metrics.jsonl"), first=True)
        fn = length_fn_from_config(cfg.rollout)
        lengths = sorted(fn(f"g{i}", k) for i in range(500) for k in range(args.samples))
    p50, p99 = statistics.median(lengths), lengths[math.ceil(0.99 * len(lengths)) - 1]
    figures = {"length_p50": p50, "length_p99": p99, "steps": args.steps}
    for mode, summary in results.items():
        figures[f"{mode}_tokens_per_s"] = summary["trainer_tokens_per_s"]
        figures[f"{mode}_engine_idle_fraction"] = summary["engine_idle_fraction"]
        figures[f"{mode}_trainer_idle_fraction"] = summary["trainer_idle_fraction"]
        figures[f"{mode}_max_staleness"] = summary["max_staleness_observed"]
        figures[f"{mode}_repacked"] = summary.get("repacked", 0)
        figures[f"{mode}_span_s"] = summary["span_s"]  # the steady state's seconds
        # the median trainer step (steady state): in laminar, where the trainer never waits,
        # the trainer's own seconds per step (sim.calibrate's measured trainer cost)
        figures[f"{mode}_step_s_median"] = steps_s[mode]
        # the first step: from the controller's start (engines generate meanwhile)
        figures[f"{mode}_first_step_s"] = first_s[mode]
    lines = {}
    base = figures.get("laminar_tokens_per_s")
    for other in ("sync", "one_step"):
        if base and f"{other}_tokens_per_s" in figures:
            figures[f"laminar_vs_{other}"] = base / figures[f"{other}_tokens_per_s"]
    for mode in results:
        ratio = f" ({figures[f'laminar_vs_{mode}']:.2f}x slower than laminar)" if mode != "laminar" and f"laminar_vs_{mode}" in figures else ""
        lines[f"{mode}_tokens_per_s"] = (
            f"{figures[f'{mode}_tokens_per_s']:.1f} tokens/s{ratio}; engines idle "
            f"{figures[f'{mode}_engine_idle_fraction']:.0%}, trainer idle "
            f"{figures[f'{mode}_trainer_idle_fraction']:.0%}, max staleness "
            f"{figures[f'{mode}_max_staleness']}")
    for other in ("sync", "one_step"):
        if f"laminar_vs_{other}" in figures:
            lines[f"laminar_vs_{other}"] = f"{figures[f'laminar_vs_{other}']:.2f}x"
    lines["lengths"] = f"response length p50 {p50}, p99 {p99}"
    report(figures, args.json, lines)
    return figures


def _step_seconds(metrics_path: str, first: bool = False) -> float:
    """The median steady-state step (or the first step's seconds)."""
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    seconds = [r["step_seconds"] for r in records
               if r.get("kind") == "train" and (r["step"] == 1 if first else r["step"] > 1)]
    return statistics.median(seconds) if seconds else float("nan")


if __name__ == "__main__":
    main()
