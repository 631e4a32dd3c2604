"""Learning, not only throughput: the same task, seed and budget in four modes, side by side.

    python -m laminar_mcore.bench.convergence [--modes sync,one_step,areal,laminar]
        [--steps N] [--target ACC] [--json PATH] [--plot PATH] [override ...]

Runs ``experiment=cpu_demo`` (the long-tailed reversal task; any further Hydra overrides apply
to every mode) once per mode with the same seed, prompts, warm-up checkpoint and number of
trainer steps, evaluating every ``trainer.eval_interval`` steps. For each mode it reports the
wall time and the consumed samples until the policy first reaches the target accuracy (default:
sync's final accuracy minus 0.02), the final accuracy and trainer-consumed tokens/s. Wall time
is counted from the trainer's first batch request to the end of the step whose weights reached
the target (start-up excluded in every mode); consumed samples are the batches of the steps
behind those weights (their version: an evaluation runs once an engine holds its step's version
or a newer one). The
ratios favour laminar above 1:

* ``laminar_time_speedup_vs_sync``: sync's wall time to target over laminar's (also ``_vs_areal``,
  ``_vs_one_step``);
* ``laminar_sample_efficiency_vs_sync``: sync's consumed samples to target over laminar's.

A mode that never reaches the target has no time to it: its ratios are null. The plot (accuracy
against wall time, one curve per mode) goes to ``--plot``.
"""

from __future__ import annotations

import argparse
from typing import Dict, Optional

from .common import plot_accuracy, report, time_to_target

MODES = ("sync", "one_step", "areal", "laminar")


def _steps(evaluation: dict) -> int:
    """Trainer steps behind the weights an evaluation measured (their version; an evaluation
    scheduled at step s runs on the first engine holding version s or newer)."""
    version = evaluation.get("version")
    return int(version if version is not None else evaluation["step"])


def figures_from(results: Dict[str, dict], batch_samples: int,
                 target: Optional[float] = None) -> Dict[str, object]:
    """The flat JSON of the benchmark from each mode's ``summary.json``."""
    if target is None:
        target = results["sync"]["final_accuracy"] - 0.02
    figures: Dict[str, object] = {"target_accuracy": target}
    reached = {}
    for mode, s in results.items():
        hit = time_to_target(s["evals"], target)
        reached[mode] = hit
        figures[f"{mode}_time_to_target_s"] = hit["wall_s"] if hit else None
        figures[f"{mode}_samples_to_target"] = _steps(hit) * batch_samples if hit else None
        figures[f"{mode}_final_accuracy"] = s["final_accuracy"]
        figures[f"{mode}_final_accuracy_greedy"] = s.get("final_accuracy_greedy")
        figures[f"{mode}_tokens_per_s"] = s["trainer_tokens_per_s"]
        figures[f"{mode}_engine_idle_fraction"] = s["engine_idle_fraction"]
        figures[f"{mode}_train_wall_s"] = max((e["wall_s"] for e in s["evals"]
                                               if e.get("wall_s") is not None), default=None)
        figures[f"{mode}_max_staleness"] = s["max_staleness_observed"]
    lam = reached.get("laminar")
    for other in ("sync", "areal", "one_step"):
        if other not in results or "laminar" not in results:
            continue
        hit = reached[other]
        figures[f"laminar_time_speedup_vs_{other}"] = (
            hit["wall_s"] / lam["wall_s"] if hit and lam and lam["wall_s"] > 0 else None)
    if "sync" in results and "laminar" in results:
        hit = reached["sync"]
        figures["laminar_sample_efficiency_vs_sync"] = (
            _steps(hit) / _steps(lam) if hit and lam and _steps(lam) > 0 else None)
    return figures


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=None, help="trainer steps (default: the demo's)")
    ap.add_argument("--target", type=float, default=None,
                    help="target accuracy (default: sync's final accuracy minus 0.02)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--output-dir", default="outputs",
                    help="runs go to OUTPUT_DIR/convergence/<mode> (the warm-up cache is shared "
                         "with the demo's, OUTPUT_DIR/.cache)")
    ap.add_argument("--plot", default="outputs/convergence/convergence.png")
    ap.add_argument("--save-reference", action="store_true",
                    help="store the result as the figure make demo compares with "
                         "(laminar_mcore/bench/cpu_demo_reference.json)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides applied to every mode")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    if args.target is None and "sync" not in modes:
        ap.error("without sync in --modes give --target")

    from hydra import compose, initialize_config_dir

    from ..config import register_configs, validate_config
    from ..config.paths import conf_dir
    from ..launch.train import run_train

    register_configs()
    results: Dict[str, dict] = {}
    for mode in modes:
        overrides = ["experiment=cpu_demo", f"mode={mode}", f"output_dir={args.output_dir}",
                     f"run_name=convergence/{mode}", *args.overrides]
        if args.steps is not None:
            overrides.append(f"trainer.total_steps={args.steps}")
        with initialize_config_dir(config_dir=conf_dir(), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        validate_config(cfg)
        print(f"[convergence] {mode}: {cfg.trainer.total_steps} steps", flush=True)
        results[mode] = run_train(cfg)
    batch_samples = cfg.trainer.train_batch_prompts * cfg.algo.n_samples_per_prompt
    figures = figures_from(results, batch_samples, args.target)
    figures["steps"] = cfg.trainer.total_steps
    target = figures["target_accuracy"]
    path = plot_accuracy(results, target, args.plot) if args.plot else None
    lines = {"target": f"accuracy {target:.3f}"
                       f"{' (sync final - 0.02)' if args.target is None else ''}"}
    for mode in modes:
        t = figures[f"{mode}_time_to_target_s"]
        n = figures[f"{mode}_samples_to_target"]
        lines[mode] = (f"{'not reached' if t is None else f'{t:.0f} s, {n} samples'} to target; "
                       f"final accuracy {figures[f'{mode}_final_accuracy']:.3f}, "
                       f"{figures[f'{mode}_tokens_per_s']:.0f} tokens/s, engines idle "
                       f"{figures[f'{mode}_engine_idle_fraction']:.0%}")
    for key in ("laminar_time_speedup_vs_sync", "laminar_time_speedup_vs_one_step",
                "laminar_time_speedup_vs_areal", "laminar_sample_efficiency_vs_sync"):
        if key in figures:
            lines[key] = "n/a" if figures[key] is None else f"{figures[key]:.2f}x"
    if path:
        lines["plot"] = path
    if args.save_reference:
        from .reference import save

        lines["reference"] = save(cfg, results, figures)
    report(figures, args.json, lines)
    return figures


if __name__ == "__main__":
    main()
