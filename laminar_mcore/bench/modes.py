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
import math
import statistics
import tempfile

from ..run_shape import add_run_args, run_overrides


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap)
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
    results = {}
    with tempfile.TemporaryDirectory(prefix="laminar-bench-modes-") as tmp:
        for mode in args.modes.split(","):
            overrides = run_overrides(args) + [
                f"mode={mode}", f"output_dir={tmp}", f"run_name={mode}",
                f"algo.max_staleness={args.max_staleness}"]
            with initialize_config_dir(config_dir=conf_dir(), version_base=None):
                cfg = compose(config_name="config", overrides=overrides)
            validate_config(cfg)
            results[mode] = run_train(cfg)
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


if __name__ == "__main__":
    main()
