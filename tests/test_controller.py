"""The controller's REST API in process, with no engines: every endpoint but /health proves the
run token (one middleware), malformed requests get a 400 and the server keeps serving, and
``ControllerClient`` -- the one spelling of the protocol -- says when its token is refused."""

import json
import urllib.error
import urllib.request

import pytest

from laminar_mcore.config.schema import LaminarConfig
from laminar_mcore.controller.client import ControllerClient, ControllerError
from laminar_mcore.controller.episode import TaskCodec
from laminar_mcore.controller.server import Controller, TaskData
from laminar_mcore.metrics import MetricsWriter

TOKEN = "controller-token-0123"


@pytest.fixture
def controller(tmp_path):
    task = TaskData(rows=[{"prompt": "ab", "answer": "ba"}] * 4, evals=[],
                    codec=TaskCodec(lambda row: [1, 2], lambda ids: ""), model_path="/none")
    metrics = MetricsWriter(str(tmp_path), loggers=["jsonl"])
    c = Controller(LaminarConfig(), task, metrics, TOKEN, info={"model_path": "/none"})
    c.start()
    yield c
    c.stop()
    metrics.close()


def _call(url, method="GET", body=None, token=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_every_endpoint_but_health_needs_the_token(controller):
    url = controller.url
    assert _call(url + "/health")[0] == 200
    for method, path in [("GET", "/batch"), ("POST", "/trained"), ("GET", "/state"),
                         ("POST", "/relay_role"), ("POST", "/register"), ("GET", "/cluster"),
                         ("POST", "/done")]:
        body = {} if method == "POST" else None
        assert _call(url + path, method, body)[0] == 401, path
        assert _call(url + path, method, body, token="wrong")[0] == 401, path
    with pytest.raises(ControllerError, match="refused the run token"):
        ControllerClient(url, "wrong").state()
    state = ControllerClient(url, TOKEN).state()  # the right token: served
    assert state["trainer_version"] == 0 and state["prompt_pool"]["issued"] == 0


def test_malformed_requests_get_400_and_the_controller_keeps_serving(controller):
    url = controller.url
    assert _call(url + "/trained", "POST", raw=b"{not json", token=TOKEN)[0] == 400
    assert _call(url + "/trained", "POST", {"step": "x", "version": 1}, token=TOKEN)[0] == 400
    assert _call(url + "/register", "POST", {"relay_url": 3, "engines": []}, token=TOKEN)[0] == 400
    assert _call(url + "/register", "POST", {"relay_url": "http://r", "engines": ["e"],
                                             "pull_agent": 7}, token=TOKEN)[0] == 400
    assert _call(url + "/done", "POST", [1, 2], token=TOKEN)[0] == 400
    assert controller.rollout_nodes == [] and controller.trainer_done is None
    client = ControllerClient(url, TOKEN)
    assert client.batch(deadline_s=0.5, poll_s=0.2) is None  # no engines: no batch, no error
    client.trained(1, 1, {"loss": 0.5}, 0.0, 0.1)
    assert controller.trainer_version == 1
    assert client.health()["ok"]


def test_a_resume_restores_the_admission_budget_from_consumed_and_buffered(tmp_path):
    """AReaL's budget after a restart counts what can still be trained on: trajectories
    consumed and buffered, not those in flight at the save (their engines are gone: they are
    discarded as ``restart``, their groups dropped). The books balance across the restart."""
    from dataclasses import asdict

    from laminar_mcore.config.schema import AlgoConfig
    from laminar_mcore.data.pools import InFlight
    from laminar_mcore.data.trajectory import Trajectory

    def traj(group, k):
        return Trajectory([1, 2], [3], [-0.5], 1, group, reward=1.0, uid=f"{group}-{k}")

    state = {"prompt_pool": {"epoch": 0, "position": 6, "issued": 6},
             "buffer": {"ready": [[traj("g0", 0).to_dict(), traj("g0", 1).to_dict()]],
                        "open": {"g1": [traj("g1", 0).to_dict()]},
                        "discarded": {}, "consumed": 8},
             # g1's other member was generating when the checkpoint was taken
             "partial": [asdict(InFlight(Trajectory([1, 2], [3], [-0.1], 1, "g1", uid="g1-1"),
                                         "node0-engine0", max_new_tokens=8))],
             "trainer_version": 4, "generated": 11, "accepted": 14, "max_staleness_observed": 1}
    cfg = LaminarConfig(algo=AlgoConfig(n_samples_per_prompt=2, max_staleness=1))
    task = TaskData(rows=[{"prompt": "ab", "answer": "ba"}] * 8, evals=[],
                    codec=TaskCodec(lambda row: [1, 2], lambda ids: ""), model_path="/none")
    metrics = MetricsWriter(str(tmp_path), loggers=["jsonl"])
    c = Controller(cfg, task, metrics, TOKEN, initial_state=state)
    c.start()
    try:
        books = c.books()
        assert c.manager.accepted == 8 + 2  # consumed + the complete group still buffered
        assert books["trajectories_buffered"] == 2
        assert books["discarded_reasons"] == {"restart": 1, "restart_group": 1}
        assert books["trajectories_generated"] == (books["trajectories_consumed"]
                                                   + books["trajectories_buffered"]
                                                   + books["trajectories_discarded"]) == 12
        assert c.trainer_version == 4 and c.prompts.issued == 6
    finally:
        c.stop()
        metrics.close()
