"""One master relay against a striped tier of two, each on a host of its own (issue 52).

    python -m laminar_mcore.bench.stripes [--json PATH] [--link-gbit 1] [--layers 4]
        [--repeats 3] [--loopback]

A pipeline-parallel trainer (PP2, TP1: two torchrun ranks on the trainer host, a Qwen2-0.5B
shape of ``--layers`` layers, random bf16 weights) publishes each version with its own
``WeightPublisher`` (stage leads, ``weight_sync.export=stage_lead``) two ways, alternately in
one run: both stages into one master relay on host ``m0`` (today's funnel: the whole version
crosses ``m0``'s link), and each stage into its own stripe's master relay, on ``m0`` and ``m1``
(``master_relays``: the version crosses two links). With root the three are separate hosts
(network namespaces, ``testing/netns.py``), the link into every host rate-limited with
``tc ... tbf`` to ``--link-gbit`` (a master relay's ingress is the funnel); without (or with
``--loopback``) all run on loopback, unlimited, where striping has no link to spread over.

Figures (flat JSON): ``stripes_sync_s_one_master`` and ``stripes_sync_s_two_masters`` (median
seconds from the publish call until every master relay of the tier holds the version),
``stripes_speedup`` (their ratio), ``stripes_blocked_s_*`` (the trainer's median blocked time
per publish), ``stripes_version_gb``, ``stripes_link_gbit`` (0: loopback), ``stripes_repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import List, Optional

import torch

from .common import report

TOKEN = "bench-stripes"
# relay control ports (separate hosts): the one master (on m0), stripe 0's (m0), stripe 1's (m1)
PORTS = {"one": 18710, "s0": 18711, "s1": 18712}


def _get(url: str, path: str) -> dict:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _publish_port(key: str, url: str, timeout_s: float = 120.0) -> int:
    """Relay ``key``'s publish port from its ``/health``, waiting for the relay to listen (the
    relays start beside the trainer: on a busy machine one may still be importing torch when
    a rank first asks) and to have the port."""
    import urllib.error

    deadline = time.time() + timeout_s
    while True:
        try:
            port = _get(url, "/health").get("publish_port")
        except (urllib.error.URLError, ConnectionError) as exc:
            port, why = None, f"not answering ({exc})"
        else:
            why = "no publish port"
        if port is not None:
            return int(port)
        if time.time() > deadline:
            raise RuntimeError(f"relay {key} at {url}: {why} after {timeout_s:.0f} s; see its log")
        time.sleep(0.2)


def worker(args) -> None:
    """One trainer rank (under torchrun): publish alternately to the two tiers, time each."""
    import torch.distributed as dist

    from ..parallel import init_trainer_parallel
    from ..trainer.model import build_gpt_model
    from ..trainer.publisher import WeightPublisher
    from .delta import qwen2_config

    torch.set_num_threads(1)
    init_trainer_parallel(tp=1, pp=2, seed=0)
    cfg = qwen2_config(layers=args.layers, hidden=args.hidden,
                       intermediate=4864 * args.hidden // 896, vocab=args.vocab)
    model = build_gpt_model(cfg, dtype=torch.bfloat16)
    urls = {k: f"http://{host}:{port}" for k, (host, port) in args.relays.items()}
    tiers = {"one_master": ["one"], "two_masters": ["s0", "s1"]}
    publishers = {}
    for name, relays in tiers.items():
        masters = []
        for key in relays:
            masters.append((args.relays[key][0], _publish_port(key, urls[key])))
        publishers[name] = WeightPublisher(
            model, cfg, master_relays=masters if name == "two_masters" else (),
            relay_host=masters[0][0], publish_port=masters[0][1],
            bucket_bytes=args.bucket_mb * 2**20, chunk_bytes=8 * 2**20, token=TOKEN)
    rank = dist.get_rank()
    times = {name: [] for name in tiers}
    blocked = {name: [] for name in tiers}
    version = 0
    for i in range(1 + args.repeats):  # the first round allocates every buffer: not measured
        for name, relays in tiers.items():
            version += 1
            dist.barrier()
            start = time.perf_counter()
            stats = publishers[name].publish(version)
            if rank == 0:  # until every master of the tier holds the version
                while any(_get(urls[k], "/latest")["version"] != version for k in relays):
                    if time.perf_counter() - start > 600:
                        raise RuntimeError(f"version {version} did not reach {relays} in "
                                           "600 s; see the relays' logs")
                    time.sleep(0.01)
            elapsed = time.perf_counter() - start
            publishers[name].wait()
            dist.barrier()
            if i:
                times[name].append(elapsed)
                blocked[name].append(stats.blocked_s)
            if rank == 0:
                print(f"[bench.stripes] {name}: version {version} at every master relay in "
                      f"{elapsed:.2f} s", flush=True)
    nbytes = torch.tensor([sum(p.numel() * p.element_size() for p in model.parameters())])
    dist.all_reduce(nbytes)
    for p in publishers.values():
        p.close()
    if rank == 0:
        with open(args.worker, "w") as f:
            json.dump({"times": times, "blocked": blocked, "nbytes": int(nbytes)}, f)
    dist.destroy_process_group()


def _relay_cmd(key: str, host: str, port: int, stripes: int, stripe: int) -> List[str]:
    from ..config.schema import WeightSyncConfig
    from ..relay.launch import relay_command
    from ..relay.server import RelayConfig

    return relay_command(RelayConfig(
        TOKEN, relay_id=key, host=host, port=port, master=True, trainer_stages=2,
        stripe=stripe, stripes=stripes, weight_sync=WeightSyncConfig(publish_backend="gloo"),
        heartbeat_s=1.0))


def _trainer_cmd(args, out: str, relays: dict, port: int) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
            "--master-addr=127.0.0.1", f"--master-port={port}", "-m",
            "laminar_mcore.bench.stripes", "--worker", out, "--layers", str(args.layers),
            "--hidden", str(args.hidden), "--vocab", str(args.vocab),
            "--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb),
            "--relays", json.dumps(relays)]


def _run(args, link: Optional[float]) -> dict:
    out = os.path.join(args.logs, "worker.json")
    env = dict(os.environ, LAMINAR_RUN_TOKEN=TOKEN, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    relays = [("one", "m0", 1, 0), ("s0", "m0", 2, 0), ("s1", "m1", 2, 1)]
    if link is None:  # loopback: ports free now
        from ..netutil import free_port

        where = {key: ("127.0.0.1", free_port()) for key, *_ in relays}
        procs = [subprocess.Popen(_relay_cmd(key, *where[key], n, s), env=env,
                                  stdout=open(os.path.join(args.logs, f"relay-{key}.log"), "w"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
                 for key, _, n, s in relays]
        try:
            trainer = subprocess.run(_trainer_cmd(args, out, where, free_port()), env=env,
                                     timeout=3600)
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=30)
        if trainer.returncode:
            raise RuntimeError(f"the trainer failed ({trainer.returncode}); see {args.logs}")
    else:
        from ..testing.netns import Hosts

        shm_mb = max(2048, int(2 * 3.3 * args.version_gb * 1024))
        with Hosts(["trainer", "m0", "m1"], shm_mb=shm_mb, workdir=args.logs) as net:
            net.limit_ingress(link)
            renv = Hosts.role_env(TOKEN)
            # gloo binds the address the host name resolves to (127.0.1.1 here, as on Debian):
            # every role's sockets on the host's own link (what the launchers pin)
            renv.update(GLOO_SOCKET_IFNAME="eth0")
            at = {key: (net.addr(host), PORTS[key]) for key, host, *_ in relays}
            for key, host, n, s in relays:
                net.start(host, _relay_cmd(key, *at[key], n, s),
                          os.path.join(args.logs, f"relay-{key}.log"), env=renv)
            trainer = net.start("trainer", _trainer_cmd(args, out, at, 18719),
                                os.path.join(args.logs, "trainer.log"), env=renv)
            codes = net.wait([trainer], timeout=3600)
            with open(os.path.join(args.logs, "trainer.log")) as log:
                print("".join(line for line in log if "[bench.stripes]" in line), end="")
            if codes[0] != 0:
                raise RuntimeError(f"the trainer failed ({codes[0]}); see "
                                   f"{args.logs}/trainer.log")
    with open(out) as f:
        return json.load(f)


def main(argv: Optional[List[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the figures here (one flat object)")
    ap.add_argument("--link-gbit", type=float, default=1.0,
                    help="the rate of the link into every host (network namespaces, tc tbf)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=896, help="a multiple of 14 (Qwen2's heads)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=3, help="measured publishes per tier")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--loopback", action="store_true",
                    help="every role on loopback, no rate limit (also without root)")
    ap.add_argument("--logs", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--relays", type=json.loads, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.layers < 2 or args.hidden % 14:
        ap.error("--repeats must be at least 1, --layers at least 2 (one per stage) and "
                 "--hidden a multiple of 14")
    if args.worker:
        worker(args)
        return {}
    args.logs = args.logs or tempfile.mkdtemp(prefix="laminar-bench-stripes-")
    os.makedirs(args.logs, exist_ok=True)
    # bf16 GB: embeddings and head, the layers (Qwen2-0.5B's shape scaled by --hidden)
    args.version_gb = 2 * (2 * args.vocab * args.hidden + args.layers * 16.6e6 * (
        args.hidden / 896) ** 2) / 1e9
    from ..testing.netns import hosts_or_loopback

    link = args.link_gbit if hosts_or_loopback(args.loopback, "bench.stripes",
                                               "loopback, no rate limit") else None
    result = _run(args, link)
    one = statistics.median(result["times"]["one_master"])
    two = statistics.median(result["times"]["two_masters"])
    figures = {
        "stripes_sync_s_one_master": round(one, 4),
        "stripes_sync_s_two_masters": round(two, 4),
        "stripes_speedup": round(one / two, 3),
        **{f"stripes_blocked_s_{tier}": round(statistics.median(result["blocked"][tier]), 4)
           for tier in ("one_master", "two_masters")},
        "stripes_version_gb": round(result["nbytes"] / 1e9, 3),
        "stripes_link_gbit": link or 0,
        "stripes_repeats": args.repeats,
    }
    lines = {k: str(v) for k, v in figures.items()}
    lines["stripes_speedup"] += " (one master relay's seconds / two stripes' seconds)"
    report(figures, args.json, lines)
    return figures


if __name__ == "__main__":
    main()
