"""Learning, not only throughput: the same task, seed and budget in four modes, side by side.

    python -m laminar_mcore.bench.convergence [--modes sync,one_step,areal,laminar]
        [--steps N] [--target ACC | --target-fraction F] [--seeds N] [--seed S]
        [--json PATH] [--plot PATH] [override ...]

Runs ``experiment=cpu_demo`` (the long-tailed reversal task; any further Hydra overrides apply
to every mode) once per mode with the same seed, prompts, warm-up checkpoint and number of
trainer steps, evaluating every ``trainer.eval_interval`` steps. For each mode it reports the
wall time and the consumed samples until the policy first reaches the target accuracy (default:
80% of sync's gain, ``--target-fraction``: on the rising part of the curve, where the
crossing is not decided by an evaluation's noise), the final accuracy and trainer-consumed
tokens/s. Wall time is counted from the trainer's first batch request to the end of the step
whose weights reached the target (start-up excluded in every mode); consumed samples are the
batches of the steps behind those weights (their version: a live evaluation runs once an engine
holds its step's version or a newer one). The ratios favour laminar above 1:

* ``laminar_time_speedup_vs_sync``: sync's wall time to target over laminar's (also ``_vs_areal``,
  ``_vs_one_step``);
* ``laminar_sample_efficiency_vs_sync``: sync's consumed samples to target over laminar's;
* ``laminar_time_speedup_vs_sync_at_<pct>`` for pct in 30, 50, 70, 90 and 100: the same speedup
  with the target at that share of sync's gain (100: sync's final accuracy), the curve the
  headline is one point of (``--curve-plot`` draws it);
* ``final_accuracy_gap_vs_sync``: laminar's final accuracy minus sync's (parity: within the
  seeds' spread of 0).

A run's final accuracy is the mean of its last quarter's evaluations (``final_accuracy``; one
evaluation is noisy), and the benchmark says whether every mode ran to its plateau
(``<mode>_plateaued``, ``all_modes_plateaued``: the convergence criterion below) and whether
laminar's final accuracy lies within sync's range over the seeds
(``laminar_final_within_sync_spread``).

Where the time goes, per mode (steady state, from the first step to the last):
``<mode>_generation_fraction`` (the share of wall time with generation under way on any
engine; ``sync_generation_fraction`` is the share of a synchronous run spent generating, 83%
in Laminar's workloads) and ``<mode>_trainer_wait_fraction`` (the trainer's share waiting for
a batch). The demo evaluates after training (``trainer.eval_offline``), so evaluations are in
neither. ``<mode>_loss_tokens_cv``: how much the loss tokens of a step (``global_tokens``, the
zero-advantage trajectories' included) vary from step to step, their standard deviation over
their mean: a mode whose batches fill in completion order gets the long tail in clumps, and a
loss normalised by those tokens (``algo.loss_agg_mode=token-mean``) then scales each step's
update by what else shared its batch (docs/modes.md, "Parity").

Times and samples to target are where the accuracy crossed it, interpolated linearly between
the evaluations on either side (not rounded up to the next ``trainer.eval_interval``).
``--seeds N`` (default 3) runs every mode with seeds S, S+1, ... (each its own prompts, warm-up
and sampling): every key is the median over the seeds, and the ratios above and each mode's
time to target also come as ``_median``, ``_min``, ``_max`` and ``_seeds`` (how many reached the
target; the generation fractions get the same spread). ``load_avg_start``, ``load_avg_end``
and ``busy_cores`` (other processes' mean CPU use meanwhile) say how quiet the machine was;
above 0.25 busy cores the run warns. ``bench_wall_s``: the whole benchmark's wall time.

A mode that never reaches the target has no time to it: its ratios are null. The plot (accuracy
against wall time, one curve per mode) goes to ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Dict, List, Optional

from .common import CURVE, crossing, plot_accuracy, report

MODES = ("sync", "one_step", "areal", "laminar")


def _steps(evaluation: dict) -> int:
    """Trainer steps behind the weights an evaluation measured (their version; an evaluation
    scheduled at step s runs on the first engine holding version s or newer)."""
    version = evaluation.get("version")
    return int(version if version is not None else evaluation["step"])


# The default target: this share of sync's gain (its final accuracy over the starting one).
# On the rising part of the curve, not its plateau, where an evaluation's noise of +-0.02
# would move the crossing by a quarter of the run.
TARGET_FRACTION = 0.8


# The convergence criterion. A run's final accuracy is the mean of the evaluations in its last
# quarter (at least PLATEAU_EVALS of them): one evaluation of 256 prompts is noisy (+-0.025 at
# 80%). A mode has plateaued when those evaluations rise by less than PLATEAU_RISE along their
# least-squares line across the quarter, judged on its curve averaged over the seeds.
PLATEAU_EVALS = 3
PLATEAU_RISE = 0.03


def _last_quarter(evals: List[dict]) -> List[dict]:
    ordered = sorted(evals, key=lambda e: e["step"])
    if not ordered:
        return []
    last = ordered[-1]["step"]
    quarter = [e for e in ordered if e["step"] >= 0.75 * last and e["step"] > 0]
    return quarter if len(quarter) >= PLATEAU_EVALS else ordered[-PLATEAU_EVALS:]


def final_accuracy(summary: dict) -> float:
    """The mean accuracy of the run's last quarter of evaluations (``PLATEAU_EVALS`` at least;
    the run's own final figure where it has no evaluations)."""
    tail = _last_quarter(summary.get("evals") or [])
    if not tail:
        return float(summary["final_accuracy"])
    return sum(e["accuracy"] for e in tail) / len(tail)


def plateau_rise(evals: List[dict]) -> Optional[float]:
    """How much the last quarter's evaluations rise across the quarter along their
    least-squares line (accuracy; None with fewer than 2 evaluations)."""
    tail = _last_quarter(evals)
    if len(tail) < 2:
        return None
    xs, ys = [float(e["step"]) for e in tail], [float(e["accuracy"]) for e in tail]
    if len(set(xs)) < 2:
        return None
    slope = statistics.linear_regression(xs, ys).slope
    return slope * max(0.25 * max(xs), xs[-1] - xs[0])


def mean_curve(runs: List[dict]) -> List[dict]:
    """One mode's evaluations averaged over seeds, step by step (steps every seed has)."""
    by_step: Dict[int, List[float]] = {}
    for run in runs:
        for e in run.get("evals") or []:
            by_step.setdefault(int(e["step"]), []).append(float(e["accuracy"]))
    return [{"step": step, "accuracy": sum(v) / len(v)} for step, v in sorted(by_step.items())
            if len(v) == len(runs)]


def default_target(sync: dict, fraction: float = TARGET_FRACTION) -> float:
    """``fraction`` of the way from sync's starting accuracy (its step-0 evaluation) to its
    final one (``final_accuracy``: its last quarter's mean)."""
    start = min(sync["evals"], key=lambda e: e["step"])["accuracy"] if sync.get("evals") \
        else sync["initial_accuracy"]
    return start + fraction * (final_accuracy(sync) - start)


def loss_tokens_cv(metrics_path: str, since: float) -> Optional[float]:
    """Standard deviation over mean of the loss tokens per step (``global_tokens`` of the
    ``train`` records in ``metrics_path`` logged at or after ``since``: one run's steps)."""
    tokens = []
    with open(metrics_path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("kind") == "train" and row.get("time", 0) >= since and \
                    isinstance(row.get("global_tokens"), (int, float)):
                tokens.append(float(row["global_tokens"]))
    if len(tokens) < 2 or not statistics.fmean(tokens) > 0:
        return None
    return statistics.pstdev(tokens) / statistics.fmean(tokens)


def figures_from(results: Dict[str, dict], batch_samples: int,
                 target: Optional[float] = None,
                 fraction: float = TARGET_FRACTION) -> Dict[str, object]:
    """The flat JSON of the benchmark from each mode's ``summary.json`` (one seed). Times and
    samples to target are where the accuracy crossed it, interpolated between evaluations
    (``common.crossing``); the target is ``default_target`` of sync unless given."""
    if target is None:
        target = default_target(results["sync"], fraction)
    figures: Dict[str, object] = {"target_accuracy": target}
    reached = {}
    for mode, s in results.items():
        hit = crossing(s["evals"], target, steps_of=_steps)
        reached[mode] = hit
        figures[f"{mode}_time_to_target_s"] = hit["wall_s"] if hit else None
        figures[f"{mode}_samples_to_target"] = (round(hit["steps"] * batch_samples) if hit
                                                else None)
        figures[f"{mode}_final_accuracy"] = final_accuracy(s)
        figures[f"{mode}_last_accuracy"] = s["final_accuracy"]
        figures[f"{mode}_plateau_rise"] = plateau_rise(s.get("evals") or [])
        figures[f"{mode}_final_accuracy_greedy"] = s.get("final_accuracy_greedy")
        figures[f"{mode}_tokens_per_s"] = s["trainer_tokens_per_s"]
        figures[f"{mode}_engine_idle_fraction"] = s["engine_idle_fraction"]
        # where the wall time went (steady state, after the first step): the share with
        # generation in progress (any engine), the trainer's share waiting for a batch
        figures[f"{mode}_generation_fraction"] = s.get("generation_fraction",
                                                       1.0 - s["engine_idle_fraction"])
        figures[f"{mode}_trainer_wait_fraction"] = s["trainer_idle_fraction"]
        figures[f"{mode}_train_wall_s"] = max((e["wall_s"] for e in s["evals"]
                                               if e.get("wall_s") is not None), default=None)
        figures[f"{mode}_max_staleness"] = s["max_staleness_observed"]
        figures[f"{mode}_loss_tokens_cv"] = s.get("loss_tokens_cv")
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
            hit["steps"] / lam["steps"] if hit and lam and lam["steps"] > 0 else None)
        figures["final_accuracy_gap_vs_sync"] = (figures["laminar_final_accuracy"]
                                                 - figures["sync_final_accuracy"])
        # the speedup as a curve over targets (each a share of sync's gain), not one point
        for pct in CURVE:
            target_at = default_target(results["sync"], pct / 100)
            sync_hit = crossing(results["sync"]["evals"], target_at, steps_of=_steps)
            lam_hit = crossing(results["laminar"]["evals"], target_at, steps_of=_steps)
            figures[f"laminar_time_speedup_vs_sync_at_{pct}"] = (
                sync_hit["wall_s"] / lam_hit["wall_s"]
                if sync_hit and lam_hit and lam_hit["wall_s"] > 0 else None)
    return figures


# the figures reported with their spread over seeds (<key>_median, _min, _max; <key> is the
# median)
SPREAD = ("laminar_time_speedup_vs_sync", "laminar_time_speedup_vs_one_step",
          "laminar_time_speedup_vs_areal", "laminar_sample_efficiency_vs_sync",
          "final_accuracy_gap_vs_sync",
          *(f"laminar_time_speedup_vs_sync_at_{pct}" for pct in CURVE))


def over_seeds(per_seed: List[Dict[str, object]]) -> Dict[str, object]:
    """One flat object from each seed's ``figures_from``: every numeric key is the median over
    the seeds that have it (null where none does), and the keys of ``SPREAD`` and each mode's
    time to target also get ``_median``, ``_min`` and ``_max``. A seed in which a mode never
    reached the target counts as null for its ratios: the spread is over the seeds that did,
    and ``<key>_seeds`` says how many."""
    out: Dict[str, object] = {"seeds": len(per_seed)}
    keys = [k for k in per_seed[0]]
    for key in keys:
        values = [f.get(key) for f in per_seed]
        numbers = [float(v) for v in values if isinstance(v, (int, float))
                   and not isinstance(v, bool)]
        if not numbers:
            out[key] = values[0] if all(v == values[0] for v in values) else None
            continue
        out[key] = statistics.median(numbers)
        if key in SPREAD or key.endswith(("_time_to_target_s", "_generation_fraction",
                                          "_final_accuracy")):
            out[f"{key}_median"] = out[key]
            out[f"{key}_min"], out[f"{key}_max"] = min(numbers), max(numbers)
            out[f"{key}_seeds"] = len(numbers)
    return out


def plot_curve(figures: Dict[str, object], path: str) -> Optional[str]:
    """laminar's time-to-target speedup over sync against the target (its share of sync's
    gain): the median with the seeds' range; None without matplotlib or figures."""
    points = [(pct, figures.get(f"laminar_time_speedup_vs_sync_at_{pct}"),
               figures.get(f"laminar_time_speedup_vs_sync_at_{pct}_min"),
               figures.get(f"laminar_time_speedup_vs_sync_at_{pct}_max")) for pct in CURVE]
    points = [p for p in points if p[1] is not None]
    if not points:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = [p[0] for p in points]
    ax.plot(xs, [p[1] for p in points], "o-", label="median over seeds")
    if all(p[2] is not None and p[3] is not None for p in points):
        ax.fill_between(xs, [p[2] for p in points], [p[3] for p in points], alpha=0.2,
                        label="range over seeds")
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set_xlabel("target (% of sync's gain in accuracy)")
    ax.set_ylabel("laminar's time-to-target speedup vs sync")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plateau_figures(all_runs: Dict[str, List[dict]]) -> Dict[str, object]:
    """Per mode, on its curve averaged over the seeds: ``<mode>_plateau_rise_mean_curve`` and
    ``<mode>_plateaued`` (the criterion above); ``all_modes_plateaued``."""
    out: Dict[str, object] = {}
    for mode, runs in all_runs.items():
        rise = plateau_rise(mean_curve(runs)) if runs else None
        out[f"{mode}_plateau_rise_mean_curve"] = rise
        out[f"{mode}_plateaued"] = rise is not None and rise < PLATEAU_RISE
    out["all_modes_plateaued"] = all(out[f"{m}_plateaued"] for m in all_runs)
    out["plateau_rise_criterion"] = PLATEAU_RISE
    return out


class BusyWatch:
    """Whether something else used the machine while the benchmark ran: the CPU time that
    processes outside this one's tree spent meanwhile (psutil; one that exited meanwhile is
    missed), as ``busy_cores`` (their mean use in cores), with the load average at the start
    and the end."""

    def __init__(self):
        import psutil

        self.psutil = psutil
        self.load_start = os.getloadavg()[0]
        self._cpu, self._t0 = self._others(), time.time()

    def _others(self) -> float:
        ps = self.psutil
        me = ps.Process()
        mine = {me.pid} | {c.pid for c in me.children(recursive=True)}
        total = 0.0
        for proc in ps.process_iter(["pid"]):
            if proc.info["pid"] in mine:
                continue
            try:
                t = proc.cpu_times()
                total += t.user + t.system
            except (ps.NoSuchProcess, ps.AccessDenied, ps.ZombieProcess):
                pass
        return total

    def result(self) -> Dict[str, float]:
        elapsed = max(time.time() - self._t0, 1e-9)
        busy = max(self._others() - self._cpu, 0.0) / elapsed
        return {"load_avg_start": round(self.load_start, 2),
                "load_avg_end": round(os.getloadavg()[0], 2), "busy_cores": round(busy, 2)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=None, help="trainer steps (default: the demo's)")
    ap.add_argument("--target", type=float, default=None,
                    help="target accuracy (default: --target-fraction of sync's gain)")
    ap.add_argument("--target-fraction", type=float, default=TARGET_FRACTION,
                    help="the default target: this share of the way from sync's starting "
                         f"accuracy to its final one (default {TARGET_FRACTION})")
    ap.add_argument("--json", default=None)
    ap.add_argument("--output-dir", default="outputs",
                    help="runs go to OUTPUT_DIR/convergence/<mode> (the warm-up cache is shared "
                         "with the demo's, OUTPUT_DIR/.cache, or $LAMINAR_CACHE_DIR)")
    ap.add_argument("--plot", default="outputs/convergence/convergence.png")
    ap.add_argument("--curve-plot", default="outputs/convergence/speedup_curve.png",
                    help="laminar's speedup vs sync against the target's share of sync's gain")
    ap.add_argument("--save-reference", action="store_true",
                    help="store the result as the figure make demo compares with "
                         "(laminar_mcore/bench/cpu_demo_reference.json)")
    ap.add_argument("--seeds", type=int, default=3,
                    help="runs of every mode, seeds SEED, SEED+1, ... (default 3): the figures "
                         "are medians, with _min and _max")
    ap.add_argument("--seed", type=int, default=None, help="the first seed (default: the "
                                                           "experiment's)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides applied to every mode")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}: choose from {', '.join(MODES)}")
    if args.target is None and "sync" not in modes:
        ap.error("without sync in --modes give --target")
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    if not 0 < args.target_fraction <= 1:
        ap.error(f"--target-fraction {args.target_fraction} must be in (0, 1]: the share of "
                 "sync's gain the target sits at")

    from hydra import compose, initialize_config_dir

    from ..config import register_configs, validate_config
    from ..config.paths import conf_dir
    from ..launch.train import run_train

    register_configs()
    watch = BusyWatch()
    started = time.time()
    per_seed: List[Dict[str, object]] = []
    all_runs: Dict[str, List[dict]] = {m: [] for m in modes}  # every seed's summaries
    first = None
    for i in range(args.seeds):
        results: Dict[str, dict] = {}
        for mode in modes:
            overrides = ["experiment=cpu_demo", f"mode={mode}", f"output_dir={args.output_dir}",
                         f"run_name=convergence/{mode}", *args.overrides]
            if args.steps is not None:
                overrides.append(f"trainer.total_steps={args.steps}")
            with initialize_config_dir(config_dir=conf_dir(), version_base=None):
                cfg = compose(config_name="config", overrides=overrides)
            if first is None:
                first = args.seed if args.seed is not None else int(cfg.seed)
            cfg.seed = first + i
            validate_config(cfg)
            print(f"[convergence] seed {cfg.seed}, {mode}: {cfg.trainer.total_steps} steps",
                  flush=True)
            since = time.time()
            results[mode] = run_train(cfg)
            results[mode]["loss_tokens_cv"] = loss_tokens_cv(
                os.path.join(cfg.output_dir, cfg.run_name, "metrics.jsonl"), since)
            all_runs[mode].append(results[mode])
        batch_samples = cfg.trainer.train_batch_prompts * cfg.algo.n_samples_per_prompt
        per_seed.append(figures_from(results, batch_samples, args.target,
                                     args.target_fraction))
        if args.target is None and "sync" in results and \
                default_target(results["sync"], 1.0) <= default_target(results["sync"], 0.0):
            print(f"[convergence] warning: seed {cfg.seed}: sync did not improve on its starting "
                  "accuracy, so the default target is reached at once and the ratios say "
                  "nothing; give --target or more --steps", flush=True)
    first_runs = {m: runs[0] for m, runs in all_runs.items()}  # the plot, the stored reference
    figures = over_seeds(per_seed)
    figures.update(plateau_figures(all_runs))
    if "sync" in modes and "laminar" in modes:
        figures["laminar_final_within_sync_spread"] = (
            figures["sync_final_accuracy_min"] <= figures["laminar_final_accuracy"]
            <= figures["sync_final_accuracy_max"]) if args.seeds > 1 else None
    figures["steps"] = cfg.trainer.total_steps
    figures["first_seed"] = first
    figures.update(watch.result())
    figures["bench_wall_s"] = round(time.time() - started, 1)  # warm-ups and evaluations too
    if figures["busy_cores"] > 0.25:
        print(f"[convergence] warning: other processes used {figures['busy_cores']:.2f} cores "
              "on average while this ran (load average "
              f"{figures['load_avg_start']} -> {figures['load_avg_end']}): the timings are not "
              "of a quiet machine", flush=True)
    # the plot and the stored reference show the first seed's runs with that seed's own target
    # (each seed has its own, from its sync run; the key is their median)
    target = per_seed[0]["target_accuracy"]
    figures["target_accuracy_first_seed"] = target
    path = plot_accuracy(first_runs, target, args.plot) if args.plot else None
    how = "" if args.target is not None else f" ({args.target_fraction:.0%} of sync's gain)"
    lines = {"target": f"accuracy {figures['target_accuracy']:.3f}{how}"
                       f"{'; the median of the seeds' if args.seeds > 1 else ''}"}
    for mode in modes:
        t = figures[f"{mode}_time_to_target_s"]
        n = figures[f"{mode}_samples_to_target"]
        lines[mode] = (f"{'not reached' if t is None else f'{t:.0f} s, {n} samples'} to target; "
                       f"final accuracy {figures[f'{mode}_final_accuracy']:.3f} ("
                       f"{'plateaued' if figures[f'{mode}_plateaued'] else 'still rising'}: "
                       f"{figures[f'{mode}_plateau_rise_mean_curve']:+.3f} over the last "
                       "quarter), "
                       f"{figures[f'{mode}_tokens_per_s']:.0f} tokens/s, engines generating "
                       f"{figures[f'{mode}_generation_fraction']:.0%} of the time, trainer "
                       f"waiting {figures[f'{mode}_trainer_wait_fraction']:.0%}"
                       + ("" if figures.get(f"{mode}_loss_tokens_cv") is None else
                          f", loss tokens per step vary {figures[f'{mode}_loss_tokens_cv']:.2f}"
                          " (sd/mean)"))
    for key in SPREAD:
        if key in figures:
            fmt = "{:+.3f}" if key == "final_accuracy_gap_vs_sync" else "{:.2f}x"
            lines[key] = "n/a" if figures[key] is None else (
                fmt.format(figures[key]) + (
                    f" (median of {figures[key + '_seeds']} seeds; "
                    f"{fmt.format(figures[key + '_min'])} to {fmt.format(figures[key + '_max'])})"
                    if args.seeds > 1 and key + "_min" in figures else ""))
    within = figures.get("laminar_final_within_sync_spread")
    lines["plateau"] = (
        f"{'every' if figures['all_modes_plateaued'] else 'not every'} mode plateaued "
        "(criterion: the last quarter's evaluations, averaged over the seeds, rise by less "
        f"than {PLATEAU_RISE} along their least-squares line)" + (
            f"; laminar's final accuracy is {'' if within else 'not '}within sync's range "
            "over the seeds" if within is not None else ""))
    curve = plot_curve(figures, args.curve_plot) if args.curve_plot and "sync" in modes \
        and "laminar" in modes else None
    if path:
        lines["plot"] = path
    if curve:
        lines["curve"] = curve
    if args.save_reference:
        from .reference import save

        cfg.seed = first  # the stored runs are the first seed's: the demo's own seed

        lines["reference"] = save(cfg, first_runs, dict(figures, target_accuracy=target))
    report(figures, args.json, lines)
    return figures


if __name__ == "__main__":
    main()
