"""Fault recovery, measured: one run per fault kind, a process killed with -9 mid-run.

    python -m laminar_mcore.bench.faults [--kinds engine,relay,master_relay,trainer]
        [--window-s 60] [--json PATH] [hydra overrides ...]

Each run is the CPU demo's work (``experiment=cpu_demo``) on two rollout nodes of one engine
each (so that a relay that is not the master exists), with a checkpoint every 10 steps. After
``--window-s`` seconds of training one process of the kind is killed (testing/chaos.py); the
run goes on for another window and then stops gracefully (its STOP file), writing its books.
Per kind it reports:

* ``<kind>_recovery_s``: from the kill to the role back in service (the engine's replacement
  holds the newest version; the relay restarted and rejoined the chain; a new master relay
  elected; the trainer resumed from its checkpoint and published);
* ``<kind>_dip``: 1 - trainer-consumed tokens/s over the window after the kill / over the
  window before it (0 when it did not drop);
* ``relay_chain_rebuild_s``: from killing a chained relay to the master's chain without it;
* ``trajectories_lost``: generated - consumed - buffered - discarded over every run (must be 0).

Laminar reports 252 s to recover a whole rollout machine at 32B scale; here the same
mechanisms run on a tiny model, so the seconds are those of process start-up on 2 cores.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

KINDS = ("engine", "relay", "master_relay", "trainer")
EXTRA_KINDS = ("engine_hang",)  # on request: an engine stopped with SIGSTOP


def dip(records, t: float, window_s: float) -> dict:
    """Trainer-consumed tokens in the window before ``t`` and after it, and the drop."""
    before = after = 0.0
    for r in records:
        if r.get("kind") != "train":
            continue
        tokens = float(r.get("tokens_per_s", 0.0)) * float(r.get("step_seconds", 0.0))
        if t - window_s < r["time"] <= t:
            before += tokens
        elif t < r["time"] <= t + window_s:
            after += tokens
    return {"before_tokens_per_s": before / window_s, "after_tokens_per_s": after / window_s,
            "dip": max(0.0, 1.0 - after / before) if before > 0 else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None, help="keep the runs here (default: a temp dir)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = ap.parse_args(argv)

    from ..testing.chaos import ChaosRun, Kill
    from .common import report

    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS) - set(EXTRA_KINDS)
    if unknown:
        ap.error(f"unknown fault kinds {sorted(unknown)}; choose from "
                 f"{', '.join(KINDS + EXTRA_KINDS)}")
    base = ["experiment=cpu_demo", "cluster.rollout_nodes=2", "rollout.num_engines=1",
            "trainer.total_steps=100000", "trainer.save_interval=10", "trainer.eval_interval=0",
            "data.num_eval=32", *args.overrides]
    figures: dict = {"window_s": args.window_s}
    lines: dict = {}
    lost = 0
    with tempfile.TemporaryDirectory(prefix="laminar-bench-faults-") as tmp:
        root = Path(args.workdir or tmp)
        for kind in kinds:
            kill = Kill(kind, at_time_s=args.window_s)
            work = root / kind
            work.mkdir(parents=True, exist_ok=True)
            result = ChaosRun(work, base, [kill], seed=args.seed, run_name=f"faults-{kind}",
                              stop_after_s=args.window_s).run(timeout_s=6 * args.window_s + 600)
            s = result.summary
            if result.returncode != 0 or s is None or kill.recovered_at is None:
                raise SystemExit(f"the {kind} run failed (rc {result.returncode}, recovered "
                                 f"{kill.recovered_at is not None}):\n{result.output[-4000:]}")
            d = dip(result.records, kill.time, args.window_s)
            figures[f"{kind}_recovery_s"] = kill.recovery_s
            figures[f"{kind}_dip"] = d["dip"]
            figures[f"{kind}_tokens_per_s_before"] = d["before_tokens_per_s"]
            figures[f"{kind}_tokens_per_s_after"] = d["after_tokens_per_s"]
            if kill.chain_rebuild_s is not None:
                figures["relay_chain_rebuild_s"] = kill.chain_rebuild_s
            run_lost = s["trajectories_generated"] - (
                s["trajectories_consumed"] + s["trajectories_buffered"]
                + s["trajectories_discarded"]) + s["discarded_reasons"].get("lost", 0)
            lost += run_lost
            figures[f"{kind}_discarded"] = s["trajectories_discarded"]
            figures[f"{kind}_leftover_processes"] = len(result.leftover_processes)
            figures[f"{kind}_leftover_segments"] = len(result.leftover_segments)
            lines[kind] = (f"recovered in {kill.recovery_s:.2f} s; trainer tokens/s "
                           f"{d['before_tokens_per_s']:.0f} before -> "
                           f"{d['after_tokens_per_s']:.0f} after (dip "
                           f"{(d['dip'] or 0):.1%}); discarded {s['trajectories_discarded']} "
                           f"({s['discarded_reasons']}), lost {run_lost}"
                           + (f"; chain rebuilt in {kill.chain_rebuild_s:.3f} s"
                              if kill.chain_rebuild_s is not None else ""))
    figures["trajectories_lost"] = lost
    lines["trajectories_lost"] = str(lost)
    report(figures, args.json, lines)
    return figures


if __name__ == "__main__":
    main()
