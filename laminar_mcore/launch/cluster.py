"""Multi-node roles: the controller, a rollout node and a trainer rank, each its own process.

    # one machine (or any): the controller; prints its URL
    python -m laminar_mcore.launch job=controller cluster=multinode cluster.controller_addr=HOST
    # every rollout node: a relay and rollout.num_engines engines on this node
    python -m laminar_mcore.launch job=rollout cluster=multinode cluster.controller_addr=HOST \\
        rollout.host=$(hostname -i)
    # every trainer node: torchrun runs one trainer rank per process
    torchrun --nnodes N --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29400 \\
        -m laminar_mcore.launch job=trainer cluster=multinode cluster.controller_addr=HOST

All roles share the run token through ``LAMINAR_RUN_TOKEN`` and find each other through the
controller (``cluster.controller_addr``:``cluster.controller_port``): the first rollout node to
register hosts the master relay that trainers publish to, the others chain from it; trainers
wait until ``cluster.rollout_nodes`` nodes have registered. When training ends the controller
evaluates, writes the summary and tells the rollout nodes to stop; a rollout node whose
controller is gone stops its engines on its own. This module only finds the token and the
controller, settles the addresses other hosts will dial (a rollout node's ``rollout.host``; the
interface a trainer's gloo/NCCL sockets use) and hands over to the role (controller/role.py,
rollout/node.py, trainer/loop.py).
"""

from __future__ import annotations

import os

from ..config import typed
from ..controller.client import TOKEN_ENV, ControllerClient, ControllerError, controller_url
from ..netutil import (SOCKET_IFNAME_ENVS, is_loopback, is_unspecified, pin_socket_interfaces,
                       route_source_address)

ClusterError = ControllerError


def environ_rank0() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


def run_token() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if len(token) < 8:
        raise ClusterError(f"LMC-E200: multi-node roles share a secret run token: export "
                           f"{TOKEN_ENV}=<at least 8 characters, e.g. $(openssl rand -hex 16)> "
                           "on every node")
    return token


def advertised_host(cfg) -> str:
    """The address a rollout node binds and advertises (its relay, engines, pull agent):
    ``rollout.host`` when it is one other hosts can dial; when it is loopback or unspecified
    (the default 127.0.0.1, ``$(hostname -i)`` where /etc/hosts maps the name to 127.0.1.1,
    0.0.0.0) and the controller is on another host, this host's address on its route to the
    controller. With a loopback controller address every role is on this machine and
    loopback stays."""
    host, controller = str(cfg.rollout.host), str(cfg.cluster.controller_addr)
    if not (is_loopback(host) or is_unspecified(host)) or is_loopback(controller):
        return host
    address = route_source_address(controller)
    if is_loopback(address):
        raise ClusterError(f"LMC-E202: rollout.host={host!r} is not an address other hosts can "
                           f"reach and the route to the controller ({controller}) leaves from "
                           f"{address}: set rollout.host to this node's address on the cluster "
                           "network")
    print(f"[rollout] rollout.host={host!r} is not an address other hosts can reach: "
          f"advertising {address}, this host's address on its route to the controller "
          f"{controller} (set rollout.host to choose another)", flush=True)
    return address


def pin_trainer_interfaces(cfg=None, environ=None) -> str:
    """A trainer rank's gloo/NCCL sockets on the interface that routes to torchrun's rendezvous
    host (``MASTER_ADDR``) or, where that is loopback (torchrun passes the rank-0 node's host
    name, which Debian's and Ubuntu's /etc/hosts map to 127.0.1.1, or ``localhost``), to the
    controller -- unless the user set ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``. Without
    it gloo advertises loopback to the other trainer nodes and the world cannot form. Returns
    a line for the log ('' if nothing was pinned: every role on this machine)."""
    environ = os.environ if environ is None else environ
    controller = str(cfg.cluster.controller_addr) if cfg is not None else ""
    for target, what in ((environ.get("MASTER_ADDR", ""), "the rendezvous host"),
                         (controller, "the controller")):
        if not target or is_loopback(target):
            continue
        try:
            address = route_source_address(target)
        except ValueError:
            continue
        name = pin_socket_interfaces(address, environ)
        if name:
            return (f"[trainer] collectives on {name} ({address}, the route to {what} "
                    f"{target}): " + ", ".join(f"{k}={environ[k]}" for k in SOCKET_IFNAME_ENVS))
    return ""


def check_trainer_rendezvous(cfg, environ=None) -> None:
    """Stop a trainer rank that torchrun handed a loopback rendezvous address on a node other
    than the first, in a run whose controller is on another host: it would wait on its own
    loopback for a store that lives on the first node. torchrun passes the first node's
    ``--local-addr``, or else its host name, which there may resolve to loopback (Debian's and
    Ubuntu's ``127.0.1.1`` line in /etc/hosts) and be sent to the other nodes as ``localhost``."""
    environ = os.environ if environ is None else environ
    master, node = environ.get("MASTER_ADDR", ""), int(environ.get("GROUP_RANK", "0") or 0)
    if node > 0 and master and is_loopback(master) \
            and not is_loopback(str(cfg.cluster.controller_addr)):
        raise ClusterError(
            "LMC-E202: "
            f"torchrun gave trainer node {node} MASTER_ADDR={master}, a loopback address: the "
            "first trainer node's host name resolves to loopback there (as /etc/hosts' "
            "127.0.1.1 line makes it), so the other nodes cannot reach its store. Start "
            "torchrun on every trainer node with --local-addr=<that node's cluster address> "
            "(e.g. --local-addr=$(hostname -I | cut -d' ' -f1)), or map the host names to "
            "cluster addresses in /etc/hosts")


def run_role(job: str, cfg) -> object:
    cfg = typed(cfg)
    token = run_token()
    if job == "controller":
        from ..controller.role import run

        return run(cfg, token)
    if job == "rollout":
        from ..rollout.node import run

        cfg.rollout.host = advertised_host(cfg)
        # the relay's publish group (gloo) with trainers on other hosts: this host's interface
        pin_socket_interfaces(cfg.rollout.host)
        return run(cfg, ControllerClient(controller_url(cfg), token))
    if job == "trainer":
        from ..trainer.loop import run

        check_trainer_rendezvous(cfg)
        line = pin_trainer_interfaces(cfg)
        if line and environ_rank0():
            print(line, flush=True)
        return run(cfg, token)
    raise ValueError(f"LMC-E102: job={job!r} is not a cluster role")
