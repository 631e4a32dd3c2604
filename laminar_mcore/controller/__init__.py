"""The controller role: the data module, the rollout manager, the reward service, the books,
the mode policy and the REST API the trainer and the rollout nodes talk to.

* ``server.Controller`` -- REST API (auth as middleware), engine/relay registry, books, metrics;
* ``manager.RolloutManager`` -- trajectory-level dispatch, pull-when-idle, repack, supervision;
* ``episode`` -- what one episode does (the plug-in point for rollout logic);
* ``modes`` -- laminar / one_step / sync as policies;
* ``client.ControllerClient`` -- the one spelling of the protocol (trainer, cluster roles);
* ``role.run`` -- the controller process of a multi-node run.

Engine code (``rollout/``) never imports this package; the trainer only uses the client.
"""

__all__ = ["Controller", "ControllerClient", "ControllerError", "RolloutManager", "run"]


def __getattr__(name):
    if name in ("ControllerClient", "ControllerError"):
        from . import client

        return getattr(client, name)
    if name == "Controller":
        from .server import Controller

        return Controller
    if name == "RolloutManager":
        from .manager import RolloutManager

        return RolloutManager
    if name == "run":
        from .role import run

        return run
    raise AttributeError(name)
