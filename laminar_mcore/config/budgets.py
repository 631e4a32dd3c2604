"""Time budgets that depend on each other, derived in one place (every role reads them here).

An engine may take ``rollout.start_timeout_s`` to start (null: 1800 s for SGLang, whose big
checkpoints load and capture CUDA graphs for many minutes; 180 s for the CPU engine), and a
rollout node registers with the controller only once all its engines are ready; so the time
roles wait for each other, ``cluster.join_timeout_s``, is by default that start budget plus
``JOIN_MARGIN_S`` (the node's own start, the relay's), and the configuration check refuses a
join budget below the start budget, naming both keys (LMC-E108).
"""

from __future__ import annotations

from typing import Tuple

DEFAULT_START_TIMEOUT_S = {"sglang": 1800.0, "cpu": 180.0}
JOIN_MARGIN_S = 300.0


def engine_start_timeout_s(rollout_cfg) -> float:
    """How long an engine of ``rollout_cfg`` may take to start, first start and restarts
    alike: ``rollout.start_timeout_s``, or when null 1800 s for sglang and 180 s for the CPU
    engine."""
    value = getattr(rollout_cfg, "start_timeout_s", None)
    if value is None:
        return DEFAULT_START_TIMEOUT_S.get(rollout_cfg.backend, DEFAULT_START_TIMEOUT_S["cpu"])
    if float(value) <= 0:
        raise ValueError(f"LMC-E103: rollout.start_timeout_s={value} must be > 0 (seconds), or "
                         "null for the backend's default (1800 sglang, 180 cpu)")
    return float(value)


def join_timeout_s(cfg) -> float:
    """How long roles wait for each other: ``cluster.join_timeout_s``, or when null the
    engines' start budget + JOIN_MARGIN_S."""
    value = cfg.cluster.join_timeout_s
    if value is None:
        return engine_start_timeout_s(cfg.rollout) + JOIN_MARGIN_S
    return float(value)


def budget_problems(cfg) -> list:
    """Budgets that contradict each other (for the configuration check)."""
    problems = []
    try:
        start = engine_start_timeout_s(cfg.rollout)
    except ValueError as exc:
        return [str(exc)]
    join = cfg.cluster.join_timeout_s
    if join is not None and float(join) < start:
        problems.append(
            f"LMC-E108: cluster.join_timeout_s={join} is below the engines' start budget "
            f"rollout.start_timeout_s={cfg.rollout.start_timeout_s} ({start:g} s for "
            f"rollout.backend={cfg.rollout.backend}): a node registers only once its engines "
            "started, so the run would stop while they load; raise cluster.join_timeout_s (or "
            "set it to null: the start budget + 300 s)")
    if not cfg.weight_sync.relay_full_wait_s > 0:
        problems.append(f"LMC-E103: weight_sync.relay_full_wait_s="
                        f"{cfg.weight_sync.relay_full_wait_s} must be > 0 (seconds)")
    pause = cfg.rollout.pause_timeout_s
    if not pause > 0:
        problems.append(f"LMC-E103: rollout.pause_timeout_s={pause} must be > 0 (seconds)")
    return problems


# File descriptors of the controller beyond its streams: per engine, the control pool of its
# client (16) and a few more (relay client, probes); then the process's own (logs, the
# reward service, the trainers' connections)
CONTROL_FDS_PER_ENGINE = 20
FD_MARGIN = 512


def controller_streams(cfg) -> int:
    """Generation streams one controller may hold at once: every engine full."""
    return cfg.cluster.rollout_nodes * cfg.rollout.num_engines * cfg.rollout.max_running_requests


def controller_open_files(cfg) -> int:
    """File descriptors one controller needs: one per stream, the engines' control
    connections, and a margin for everything else."""
    engines = cfg.cluster.rollout_nodes * cfg.rollout.num_engines
    return controller_streams(cfg) + engines * CONTROL_FDS_PER_ENGINE + FD_MARGIN


def raise_open_files_limit(cfg) -> Tuple[int, int]:
    """At the controller's start: its soft ``RLIMIT_NOFILE`` raised to the hard limit (1,024
    soft on many systems would stop a 7B recipe's 6,144 streams); refuses to start when even
    the hard limit is below ``controller_open_files``, naming both figures and the fix.
    Returns (the soft limit now, the file descriptors needed)."""
    import resource

    needed = controller_open_files(cfg)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise RuntimeError(
            f"LMC-E610: the controller needs about {needed} open files "
            f"({controller_streams(cfg)} streams: cluster.rollout_nodes="
            f"{cfg.cluster.rollout_nodes} x rollout.num_engines={cfg.rollout.num_engines} x "
            f"rollout.max_running_requests={cfg.rollout.max_running_requests}, + control "
            f"connections and a margin) but RLIMIT_NOFILE's hard limit is {hard}: raise it "
            "(ulimit -Hn as root, nofile in /etc/security/limits.conf, LimitNOFILE= for a "
            "systemd unit, docker run --ulimit nofile=N:N, or the scheduler's setting) or "
            "lower those keys")
    target = hard
    if hard == resource.RLIM_INFINITY:  # the kernel's own cap
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = max(needed, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise RuntimeError(f"LMC-E610: the controller needs about {needed} open files but "
                           f"could raise RLIMIT_NOFILE only to {soft}: raise the limit")
    return soft, needed
