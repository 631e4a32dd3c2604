"""The stored side of ``make demo``'s comparison: a ``bench.convergence`` run kept in the package.

``python -m laminar_mcore.bench.convergence --save-reference`` writes ``cpu_demo_reference.json``
beside this module: the configuration that matters for the comparison (task, seed, steps,
batch, samples, engines, staleness bound), and per mode the evaluation curve, the final accuracy
and the time to the target, with the benchmark's figures (medians and ranges over its seeds).
After a train job whose configuration matches it, ``compare`` prints the run's result beside the
stored sync run (saying that it is stored, when and where it was measured), draws both curves
and prints the stored speedup as the benchmark measured it: its median and range over seeds and
the machine, never a ratio of this one run to a stored one; a run that does not match is told
how to measure its own.
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Dict, Optional

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_demo_reference.json")


def fingerprint(cfg) -> Dict[str, object]:
    """What must be equal for two runs' learning curves to be comparable."""
    d, t, a, r = cfg.data, cfg.trainer, cfg.algo, cfg.rollout
    return {"task": d.task, "digits": d.digits, "long_digits": d.long_digits,
            "long_fraction": d.long_fraction, "num_train": d.num_train, "num_eval": d.num_eval,
            "warmup_steps": d.warmup_steps, "seed": cfg.seed, "total_steps": t.total_steps,
            "train_batch_prompts": t.train_batch_prompts, "lr": t.lr,
            "min_lr": t.min_lr, "lr_decay_style": t.lr_decay_style,
            "lr_warmup_steps": t.lr_warmup_steps,
            "eval_interval": t.eval_interval, "n_samples_per_prompt": a.n_samples_per_prompt,
            "max_staleness": a.max_staleness, "policy_loss": a.policy_loss,
            "loss_agg_mode": a.loss_agg_mode, "loss_scale_factor": a.loss_scale_factor,
            "num_engines": r.num_engines,
            "skip_zero_advantage": t.skip_zero_advantage, "eval_offline": t.eval_offline,
            "generate_before_trainer": r.generate_before_trainer,
            "max_new_tokens": r.sampling.max_new_tokens, "model": cfg.model.name,
            "model_path": cfg.model.path}


def save(cfg, results: Dict[str, dict], figures: Dict[str, object], path: str = PATH) -> str:
    keep = ("final_accuracy", "final_accuracy_greedy", "trainer_tokens_per_s",
            "engine_idle_fraction", "generation_fraction", "max_staleness_observed", "evals")
    data = {"measured": time.strftime("%Y-%m-%d"),
            "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}, Python "
                       f"{platform.python_version()}",
            "config": fingerprint(cfg), "figures": figures,
            "modes": {m: {k: s.get(k) for k in keep} for m, s in results.items()}}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def load(path: str = PATH) -> Optional[dict]:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def compare(cfg, summary: dict, out_dir: str, log=print, path: str = PATH) -> Optional[dict]:
    """Print this run beside the stored sync run of the same configuration and plot both."""
    from .common import CURVE, crossing, plot_accuracy

    ref = load(path)
    if ref is None or ref["config"] != fingerprint(cfg) or "sync" not in ref["modes"]:
        if cfg.mode == "laminar" and not cfg.data.get("agent"):
            log("[demo] no stored sync run of this configuration to compare with; measure one: "
                "python -m laminar_mcore.bench.convergence")
        return None
    target = ref["figures"]["target_accuracy"]
    sync = ref["modes"]["sync"]
    mine = crossing(summary["evals"], target)  # interpolated between evaluations
    theirs = crossing(sync["evals"], target)
    results = {f"sync (stored, {ref['measured']})": sync, f"{cfg.mode} (this run)": summary}
    png = plot_accuracy(results, target, os.path.join(out_dir, "demo_vs_sync.png"))

    def reached(hit):
        return f"reached {target:.3f} after {hit['wall_s']:.0f} s" if hit else \
            f"did not reach {target:.3f}"

    log(f"[demo] {cfg.mode} (this run): accuracy {summary['initial_accuracy']:.3f} -> "
        f"{summary['final_accuracy']:.3f}, {reached(mine)} of training, "
        f"{summary['trainer_tokens_per_s']:.0f} trainer tokens/s")
    log(f"[demo] sync (stored figure, measured {ref['measured']} on {ref['machine']} by "
        f"bench.convergence with this configuration): accuracy -> {sync['final_accuracy']:.3f}, "
        f"{reached(theirs)}, {sync['trainer_tokens_per_s']:.0f} trainer tokens/s")
    out = {"target": target}
    if mine and theirs and mine["wall_s"] > 0:
        # one run against a stored one is not a measurement of the speedup (runs of either
        # mode vary by tens of percent): shown for orientation only
        out["time_speedup_vs_stored_sync"] = theirs["wall_s"] / mine["wall_s"]
        log(f"[demo] time to {target:.3f}: {cfg.mode} (this run) {mine['wall_s']:.0f} s, sync "
            f"(stored run) {theirs['wall_s']:.0f} s. Plot: {png}")
    elif png:
        log(f"[demo] plot: {png}")
    f = ref["figures"]
    key = f"{cfg.mode}_time_speedup_vs_sync"
    if f.get(key) is not None and f.get(key + "_min") is not None:
        out["stored_speedup_median"] = f[key]
        out["stored_speedup_min"], out["stored_speedup_max"] = f[key + "_min"], f[key + "_max"]
        log(f"[demo] measured by bench.convergence on {ref['machine']} ({ref['measured']}, "
            f"{f.get('seeds', 1)} seeds, each mode run side by side): {cfg.mode} reaches the "
            f"target {f[key]:.2f}x sooner than sync (median; range {f[key + '_min']:.2f}-"
            f"{f[key + '_max']:.2f}); sync spends {f.get('sync_generation_fraction', 0):.0%} "
            "of its time generating. Measure it on this machine: "
            "python -m laminar_mcore.bench.convergence")
        curve = [(pct, f.get(f"{key}_at_{pct}")) for pct in CURVE]
        curve = [(pct, v) for pct, v in curve if v is not None]
        if curve:  # the speedup over targets, not one chosen point (bench.convergence)
            out["stored_speedup_curve"] = dict(curve)
            log("[demo] the same at other targets (% of sync's gain: median speedup): "
                + ", ".join(f"{pct}%: {v:.2f}x" for pct, v in curve))
    return out
