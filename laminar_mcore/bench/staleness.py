"""How much staleness is safe: final accuracy against forced staleness, with and without the
decoupled loss.

    python -m laminar_mcore.bench.staleness [--etas 0,2,8,32] [--steps N] [--json PATH]
        [--plot PATH] [--output-dir outputs] [override ...]

Runs ``experiment=cpu_demo`` (the long-tailed reversal task; any further Hydra overrides apply
to every run) in Laminar mode with no admission bound (``algo.max_staleness=null``) once per
forced staleness eta and loss: ``weight_sync.publish_lag=eta`` makes the trainer publish, at
step v, the weights of step v - eta (the final weights after the last step), so every
trajectory is consumed at least min(v - 1, eta) versions stale; ``algo.use_decoupled_loss``
true (AReaL's decoupled PPO: the trust region is taken around the proximal policy, the current
weights before the step, and the behaviour policy only reweights) or false (plain PPO: the
behaviour policy's log-probs stand in for the proximal ones). Every run has the same seed,
prompts, warm-up checkpoint, trainer steps and batch, hence the same number of consumed
samples; only the final held-out accuracy (sampled, the demo's evaluation) of the final
weights is compared. Intermediate evaluations are off (``trainer.eval_interval=0``: an
evaluation occupies the engine, which would change the staleness it measures); an override
turns them back on.

Keys of the JSON (one flat object; ``<k>`` is each eta):

* ``accuracy_eta_<k>``, ``accuracy_eta_<k>_coupled``: final accuracy with the decoupled loss and
  without it (``accuracy_greedy_...``: the same, greedy);
* ``decoupled_gain_at_eta_<k>``: ``accuracy_eta_<k>`` - ``accuracy_eta_<k>_coupled``;
  ``decoupled_gain_at_eta_32`` is the headline (null when 32 is not among the etas);
* ``mean_staleness_eta_<k>[_coupled]``, ``max_staleness_eta_<k>[_coupled]``: the staleness of
  the consumed trajectories as observed (trainer version - generating version, from the run's
  trace), which the forced lag only bounds from below;
* ``initial_accuracy``: the warm-up checkpoint's accuracy (the first run's initial evaluation);
* ``steps``, ``consumed_samples``: trainer steps and trajectories consumed per run (equal);
* ``wall_s_eta_<k>[_coupled]``: each run's wall time, start-up included.

The plot (final accuracy against eta, one curve per loss) goes to ``--plot``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Dict, List, Optional, Sequence

from .common import report

ETAS = (0, 2, 8, 32)
HEADLINE_ETA = 32


def run_name(eta: int, decoupled: bool) -> str:
    """The key suffix and run directory of one run: ``eta<k>`` or ``eta<k>_coupled``."""
    return f"eta{eta}" if decoupled else f"eta{eta}_coupled"


def observed_staleness(out_dir: str) -> Dict[str, Optional[float]]:
    """Mean and max staleness of the trajectories a run consumed (its trace)."""
    from ..data.trace import read_trace

    stale = [r["staleness"] for r in read_trace(out_dir)
             if r.get("outcome") == "consumed" and r.get("staleness") is not None]
    return {"mean_staleness": sum(stale) / len(stale) if stale else None,
            "max_staleness": max(stale) if stale else None}


def figures_from(results: Dict[str, dict], etas: Sequence[int]) -> Dict[str, object]:
    """The flat JSON of the benchmark from each run's ``summary.json`` (keyed by ``run_name``),
    with ``mean_staleness`` added (``observed_staleness``); runs that are missing give nulls."""
    figures: Dict[str, object] = {}
    first = next(iter(results.values()), None)
    figures["initial_accuracy"] = first.get("initial_accuracy") if first else None
    for eta in etas:
        for decoupled in (True, False):
            name = run_name(eta, decoupled)
            s = results.get(name) or {}
            suffix = "" if decoupled else "_coupled"
            figures[f"accuracy_eta_{eta}{suffix}"] = s.get("final_accuracy")
            figures[f"accuracy_greedy_eta_{eta}{suffix}"] = s.get("final_accuracy_greedy")
            figures[f"mean_staleness_eta_{eta}{suffix}"] = s.get("mean_staleness")
            figures[f"max_staleness_eta_{eta}{suffix}"] = s.get(
                "max_staleness", s.get("max_staleness_observed"))
            figures[f"wall_s_eta_{eta}{suffix}"] = s.get("wall_seconds")
        on, off = figures[f"accuracy_eta_{eta}"], figures[f"accuracy_eta_{eta}_coupled"]
        figures[f"decoupled_gain_at_eta_{eta}"] = (on - off if on is not None and off is not None
                                                   else None)
    figures.setdefault(f"decoupled_gain_at_eta_{HEADLINE_ETA}", None)
    return figures


def plot_staleness(figures: Dict[str, object], etas: Sequence[int], path: str) -> Optional[str]:
    """Final accuracy against eta, decoupled and coupled, to ``path`` (None without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for suffix, label, width in (("", "decoupled loss", 2.4), ("_coupled", "coupled (plain PPO)",
                                                                1.4)):
        points = [(eta, figures.get(f"accuracy_eta_{eta}{suffix}")) for eta in etas]
        points = [(x, y) for x, y in points if y is not None]
        if points:
            ax.plot([x for x, _ in points], [y for _, y in points], "o-", label=label,
                    linewidth=width)
        for x, y in points:  # the staleness observed, which the lag only bounds from below
            mean = figures.get(f"mean_staleness_eta_{x}{suffix}")
            if mean is not None:
                ax.annotate(f"{mean:.1f}", (x, y), textcoords="offset points", fontsize=7,
                            xytext=(0, 6 if not suffix else -12), ha="center")
    if figures.get("initial_accuracy") is not None:
        ax.axhline(figures["initial_accuracy"], color="grey", linestyle=":",
                   label=f"warm-up checkpoint {figures['initial_accuracy']:.3f}")
    ax.set_xscale("symlog", linthresh=1)
    ax.margins(x=0.06)
    ax.set_xticks(list(etas))
    ax.set_xticklabels([str(e) for e in etas])
    ax.set_xlabel("forced staleness η (weight_sync.publish_lag, versions); labels: observed "
                  "mean staleness")
    ax.set_ylabel("final held-out accuracy (sampled)")
    ax.set_title(f"same task, seed and consumed samples ({figures.get('consumed_samples')}): "
                 "accuracy against staleness", fontsize=10)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _parse_etas(text: str) -> List[int]:
    try:
        etas = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--etas {text!r}: give comma-separated integers >= 0, e.g. 0,2,8,32")
    if not etas or min(etas) < 0:
        raise SystemExit(f"--etas {text!r}: give comma-separated integers >= 0, e.g. 0,2,8,32")
    return sorted(set(etas))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--etas", default=",".join(map(str, ETAS)),
                    help="forced staleness values (weight_sync.publish_lag), comma-separated")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps (default: the demo's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--output-dir", default="outputs",
                    help="runs go to OUTPUT_DIR/staleness/eta<k>[_coupled] (the warm-up cache is "
                         "shared with the demo's, OUTPUT_DIR/.cache, or $LAMINAR_CACHE_DIR)")
    ap.add_argument("--plot", default="outputs/staleness/staleness.png")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides applied to every run")
    args = ap.parse_args(argv)
    etas = _parse_etas(args.etas)

    from hydra import compose, initialize_config_dir

    from ..config import register_configs, validate_config
    from ..config.paths import conf_dir
    from ..launch.train import run_train

    register_configs()
    results: Dict[str, dict] = {}
    t0 = time.time()
    cfg = None
    for eta in etas:
        for decoupled in (True, False):
            name = run_name(eta, decoupled)
            overrides = ["experiment=cpu_demo", "mode=laminar", "algo.max_staleness=null",
                         "trainer.eval_interval=0", f"weight_sync.publish_lag={eta}",
                         f"algo.use_decoupled_loss={str(decoupled).lower()}",
                         f"output_dir={args.output_dir}", f"run_name=staleness/{name}",
                         *args.overrides]
            if args.steps is not None:
                overrides.append(f"trainer.total_steps={args.steps}")
            with initialize_config_dir(config_dir=conf_dir(), version_base=None):
                cfg = compose(config_name="config", overrides=overrides)
            validate_config(cfg)
            print(f"[staleness] {name}: publish_lag {eta}, decoupled loss {decoupled}, "
                  f"{cfg.trainer.total_steps} steps", flush=True)
            summary = run_train(cfg)
            summary.update(observed_staleness(os.path.join(cfg.output_dir, cfg.run_name)))
            results[name] = summary
    figures = figures_from(results, etas)
    steps = cfg.trainer.total_steps
    figures["steps"] = steps
    figures["consumed_samples"] = steps * cfg.trainer.train_batch_prompts \
        * cfg.algo.n_samples_per_prompt
    figures["bench_wall_s"] = time.time() - t0
    path = plot_staleness(figures, etas, args.plot) if args.plot else None

    def acc(key):
        value = figures.get(key)
        return "n/a" if value is None else f"{value:.3f}"

    lines = {"initial_accuracy": acc("initial_accuracy"),
             "consumed_samples": f"{figures['consumed_samples']} per run ({steps} steps)"}
    for eta in etas:
        for suffix in ("", "_coupled"):
            mean = figures[f"mean_staleness_eta_{eta}{suffix}"]
            lines[f"accuracy_eta_{eta}{suffix}"] = (
                f"{acc(f'accuracy_eta_{eta}{suffix}')} (greedy "
                f"{acc(f'accuracy_greedy_eta_{eta}{suffix}')}); staleness mean "
                f"{'n/a' if mean is None else f'{mean:.1f}'}, max "
                f"{figures[f'max_staleness_eta_{eta}{suffix}']}")
    for eta in etas:
        gain = figures[f"decoupled_gain_at_eta_{eta}"]
        lines[f"decoupled_gain_at_eta_{eta}"] = "n/a" if gain is None else f"{gain:+.3f}"
    if path:
        lines["plot"] = path
    report(figures, args.json, lines)
    return figures


if __name__ == "__main__":
    main()
