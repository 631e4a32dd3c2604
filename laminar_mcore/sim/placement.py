"""Each system at its best placement: the trainer/rollout splits a sweep tries and how it
picks one (the paper tuned every system's split; its Table 2: 7B on 256 GPUs, laminar 192 : 64,
AReaL 128 : 128, one-step 40 : 216).

Candidates are whole machines to the trainer at 1/(s+1), 2/(s+1), ... s/(s+1) of the machines
(``splits`` = s; at least the trainer's TP x PP, at least one engine left); ``sync`` (verl)
also tries colocation (every GPU generates, then trains). The best is the fastest
(``SimResult.tokens_per_s``) whose staleness stays within a limit; the fastest at any staleness
when none does. ``report.py`` runs the same sweep for every system at every point
(``--sweep-iterations``), and ``--sweep-placement`` for one system at one point.
"""

from __future__ import annotations

from typing import Dict, List

from .cluster import GPUS_PER_MACHINE, placement_for
from .costs import CostModel


def candidate_trainer_gpus(mode: str, gpus: int, cost: CostModel, splits: int = 3) -> List[int]:
    """The trainer GPU counts a sweep tries for ``mode`` on ``gpus`` (``gpus`` itself:
    colocated, sync only)."""
    machines = gpus // GPUS_PER_MACHINE
    out: List[int] = [gpus] if mode == "sync" else []
    if machines < 2:
        place = placement_for("one_step", gpus, cost, 0.5)
        return out + [place.trainer_gpus]
    for i in range(splits):
        t = min(max(round(machines * (i + 1) / (splits + 1)), 1), machines - 1)
        trainer = max(t * GPUS_PER_MACHINE, cost.min_trainer_gpus())
        if gpus - trainer >= cost.engine_tp and trainer not in out:
            out.append(trainer)
    return out


def staleness_max(result: dict) -> int:
    return max(map(int, result["staleness"]), default=0)


def best(results: List[dict], staleness_limit: int) -> dict:
    """The fastest run whose staleness stays within ``staleness_limit`` (else the fastest)."""
    ok = [r for r in results if staleness_max(r) <= staleness_limit]
    return max(ok or results, key=lambda r: r["tokens_per_s"])


def choose_splits(results: List[dict], staleness_limit: int) -> Dict[tuple, int]:
    """{(model, gpus, mode): trainer GPUs} from a sweep's runs."""
    groups: Dict[tuple, List[dict]] = {}
    for r in results:
        groups.setdefault((r["model"], r["gpus"], r["mode"]), []).append(r)
    return {k: best(v, staleness_limit)["trainer_gpus"] for k, v in groups.items()}
