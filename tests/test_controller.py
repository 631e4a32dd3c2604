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
from laminar_mcore.data.trace import read_trace
from laminar_mcore.metrics import MetricsWriter

from .conftest import running_controller

TOKEN = "controller-token-0123"


@pytest.fixture
def controller(tmp_path):
    yield from running_controller(tmp_path, TOKEN)


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
                         ("POST", "/done"), ("POST", "/refused"), ("POST", "/leave")]:
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
    # a version the master relay refused: recorded, so barrier modes do not wait for it
    assert _call(url + "/refused", "POST", {"version": "1"}, token=TOKEN)[0] == 400
    client.refused(1, "weight_sync.relay_versions=2 versions hold this relay's buffers")
    assert controller.manager.refused_versions == {1} and controller.manager.sync_target() == 0
    assert client.health()["ok"]


def test_a_resume_restores_the_admission_budget_from_consumed_and_buffered(tmp_path):
    """AReaL's budget after a restart counts what can still be trained on: trajectories
    consumed and buffered, not those in flight at the save (their engines are gone: they are
    discarded as ``restart``, their groups dropped). The books balance across the restart."""
    from dataclasses import asdict

    from laminar_mcore.config.schema import AlgoConfig
    from laminar_mcore.data.pools import InFlight
    from laminar_mcore.data.trajectory import Trajectory

    def traj(group, k, version=3):
        return Trajectory([1, 2], [3], [-0.5], version, group, reward=1.0, uid=f"{group}-{k}")

    state = {"prompt_pool": {"epoch": 0, "position": 6, "issued": 6},
             # g2 is of version 1: 3 behind the trainer's 4, more than eta = 1 (stale)
             "buffer": {"ready": [[traj("g0", 0).to_dict(), traj("g0", 1).to_dict()],
                                  [traj("g2", 0, 1).to_dict(), traj("g2", 1, 1).to_dict()]],
                        "open": {"g1": [traj("g1", 0).to_dict()]},
                        "discarded": {}, "consumed": 8},
             # g1's other member was generating when the checkpoint was taken
             "partial": [asdict(InFlight(Trajectory([1, 2], [3], [-0.1], 3, "g1", uid="g1-1"),
                                         "node0-engine0", max_new_tokens=8))],
             "trainer_version": 4, "generated": 13, "accepted": 16, "max_staleness_observed": 1}
    cfg = LaminarConfig(algo=AlgoConfig(n_samples_per_prompt=2, max_staleness=1),
                        output_dir=str(tmp_path), run_name="resumed")
    task = TaskData(rows=[{"prompt": "ab", "answer": "ba"}] * 8, evals=[],
                    codec=TaskCodec(lambda row: [1, 2], lambda ids: ""), model_path="/none")
    metrics = MetricsWriter(str(tmp_path), loggers=["jsonl"])
    c = Controller(cfg, task, metrics, TOKEN, initial_state=state)
    c.start()
    try:
        books = c.books()
        assert c.manager.accepted == 8 + 2  # consumed + the complete group still buffered
        assert books["trajectories_buffered"] == 2
        assert books["discarded_reasons"] == {"restart": 1, "restart_group": 1, "stale": 2}
        assert books["trajectories_generated"] == (books["trajectories_consumed"]
                                                   + books["trajectories_buffered"]
                                                   + books["trajectories_discarded"]) == 14
        assert c.trainer_version == 4 and c.prompts.issued == 6
        # the trace names both: the one in flight at the save, and its buffered group member
        trace = read_trace(str(tmp_path / "resumed"))
        assert {(r["id"], r["outcome"], r["discard_reason"]) for r in trace} == {
            ("g1-1", "discarded", "restart"), ("g1-0", "discarded", "restart_group"),
            ("g2-0", "discarded", "stale"), ("g2-1", "discarded", "stale")}
    finally:
        c.stop()
        metrics.close()
    # at the stop, what is still buffered is written too: the trace holds the whole books
    trace = read_trace(str(tmp_path / "resumed"))
    assert sorted((r["id"], r["outcome"]) for r in trace) == [
        ("g0-0", "buffered"), ("g0-1", "buffered"), ("g1-0", "discarded"), ("g1-1", "discarded"),
        ("g2-0", "discarded"), ("g2-1", "discarded")]


def test_metrics_are_prometheus_text_without_the_token_and_the_trace_records_each_trajectory(
        tmp_path):
    """``GET /metrics`` (no token, read-only) parses with Prometheus' own parser and counts what
    the books count: consumed, buffered, discarded by reason, staleness at consumption; every
    trajectory that left is one line of ``trajectories.jsonl``, and the trace tool reads it."""
    from prometheus_client.parser import text_string_to_metric_families

    from laminar_mcore.config.schema import AlgoConfig, TrainerConfig
    from laminar_mcore.data.trajectory import Trajectory
    from laminar_mcore.tools.trace import main as trace_tool

    cfg = LaminarConfig(algo=AlgoConfig(n_samples_per_prompt=2),
                        trainer=TrainerConfig(train_batch_prompts=1),
                        output_dir=str(tmp_path), run_name="m")
    task = TaskData(rows=[{"prompt": "ab", "answer": "ba"}] * 4, evals=[],
                    codec=TaskCodec(lambda row: [1, 2], lambda ids: ""), model_path="/none")
    metrics = MetricsWriter(str(tmp_path / "m"), loggers=["jsonl"])
    c = Controller(cfg, task, metrics, TOKEN)
    c.start()

    def scrape():
        with urllib.request.urlopen(c.url + "/metrics") as r:  # no token
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
        return {f: {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for s in fam.samples} for f, fam in families.items()}

    def value(m, family, sample=None, **labels):
        return m[family][(sample or family, tuple(sorted(labels.items())))]

    try:
        m = scrape()
        p = "laminar_controller_"
        for name in ("trajectories_generated", "trajectories_consumed", "trajectories_buffered",
                     "trajectories_in_flight", "trajectories_discarded", "staleness",
                     "trainer_version", "engines", "engine_pulls", "engine_pull_seconds",
                     "repacks", "trajectories_resumed", "engine_restarts", "relay_failovers",
                     "trainer_restarts", "faults"):
            assert p + name in m, name
        assert value(m, p + "trajectories_consumed", p + "trajectories_consumed_total") == 0
        assert value(m, p + "engines", state="idle") == 0

        c.trainer_version = 3
        for k, version in enumerate((1, 3)):  # one group: staleness 2 and 0 at consumption
            c.buffer.add(Trajectory([1, 2], [5] * (4 + k), [-0.5] * (4 + k), version, "g0",
                                    reward=1.0, uid=f"g0-{k}"))
        c.buffer.add(Trajectory([1, 2], [5], [-0.5], 3, "g1", reward=0.0, uid="g1-0"))
        c.buffer.drop_group("g1", "aborted_group")  # its other member failed
        status, body = _call(c.url + "/batch?timeout=5", token=TOKEN)
        assert status == 200 and len(json.loads(body)["trajectories"]) == 2

        m = scrape()
        assert value(m, p + "trajectories_consumed", p + "trajectories_consumed_total") == 2
        assert value(m, p + "trajectories_buffered") == 0
        assert value(m, p + "trajectories_discarded", p + "trajectories_discarded_total",
                     reason="aborted_group") == 1
        assert value(m, p + "trainer_version") == 3
        stale = p + "staleness"
        assert value(m, stale, stale + "_bucket", le="0.0") == 1
        assert value(m, stale, stale + "_bucket", le="1.0") == 1
        assert value(m, stale, stale + "_bucket", le="2.0") == 2
        assert value(m, stale, stale + "_count") == 2 and value(m, stale, stale + "_sum") == 2
        assert _call(c.url + "/metrics", "POST", {})[0] in (401, 405)  # read-only
        status, body = _call(c.url + "/metrics/targets")  # Prometheus' HTTP discovery
        assert status == 200 and json.loads(body) == [
            {"targets": [c.url.split("//")[1]], "labels": {"role": "controller"}}]
    finally:
        c.stop()
        metrics.close()

    trace = {r["id"]: r for r in read_trace(str(tmp_path / "m"))}
    assert set(trace) == {"g0-0", "g0-1", "g1-0"}
    assert (trace["g0-0"]["outcome"], trace["g0-0"]["staleness"]) == ("consumed", 2)
    assert (trace["g0-1"]["response_tokens"], trace["g0-1"]["staleness"]) == (5, 0)
    assert "consumed" in trace["g0-1"]["timings"]
    assert (trace["g1-0"]["outcome"], trace["g1-0"]["discard_reason"]) == (
        "discarded", "aborted_group")
    figures = trace_tool([str(tmp_path / "m"), "--json", str(tmp_path / "story.json")])
    assert (figures["consumed"], figures["discarded"], figures["discarded_aborted_group"]) == (
        2, 1, 1)
    assert (figures["staleness_0"], figures["staleness_2"], figures["length_p50"]) == (1, 1, 4)
