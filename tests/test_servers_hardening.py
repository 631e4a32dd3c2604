"""Every server of a run stops promptly, answers every malformed request with a 4xx naming the
field, and discloses nothing without the token (issue 37) -- the relay and the controller here;
the CPU engine's endpoints join ``tests/malformed.py``'s table the same way.

* SIGTERM with a long poll pending: the process exits within seconds (target 2 s), the poller
  gets an answer (503 "shutting down"), and the relay's shared memory is gone.
* Malformed requests: ``malformed.check_server`` against every endpoint (a real relay process;
  the controller in process, as its tests run it).
* Without the token: only /health ({"ok": true}) and /metrics answer; nothing shows a port.
* The publish rendezvous: a stranger on the publish port (garbage, a TCPStore-protocol
  command, a wrong token, a silent connection) joins nothing and disturbs nothing; the next
  publish arrives bit for bit.
"""

import asyncio
import datetime
import glob
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from laminar_mcore.netutil import TOKEN_ENV
from laminar_mcore.relay.chain import recv_frame, send_frame
from laminar_mcore.relay.client import RelayClient, open_lease
from laminar_mcore.relay.launch import relay_process
from laminar_mcore.relay.rendezvous import (RendezvousRefused, join_publish_session, relay_proof)
from laminar_mcore.relay.server import RelayConfig
from laminar_mcore.weights.delta import digest
from laminar_mcore.weights.bucket import SHM_DIR, layout, write_bucket
from laminar_mcore.weights.transport import Channel, stage_group

from .conftest import WORKERS, running_controller, wait_until
from .malformed import Endpoint, check_server, tokenless_answers

TOKEN = "hardening-token-0123"
EXIT_BOUND_S = 10.0  # the target is 2 s; the bound leaves room for a busy machine
LOCAL = "http://127.0.0.1:9"

RELAY_ENDPOINTS = [
    Endpoint("GET", "/health", open=True),
    Endpoint("GET", "/metrics", open=True),
    Endpoint("GET", "/latest", query={"after": "0", "wait_s": "0"},
             query_fields={"after": "int", "wait_s": "number"}),
    Endpoint("GET", "/chain"),
    Endpoint("GET", "/digests"),
    Endpoint("POST", "/pull", body={"min_version": 5, "ttl_s": 30.0, "format": "shm",
                                    "devices": ["cuda:0"], "device": "cuda:0"},
             fields={"min_version": "int", "ttl_s": "number", "format": "str",
                     "devices": "list_str", "device": "str"}),
    Endpoint("POST", "/bucket", body={"lease_id": "x", "index": 0, "applied": [0]},
             fields={"lease_id": "str", "index": "int", "applied": "list_int"},
             required=("lease_id",)),  # (no index: only the acknowledgements)
    Endpoint("POST", "/release", body={"lease_id": "x"}, fields={"lease_id": "str"},
             required=("lease_id",)),
    Endpoint("POST", "/release_holder", body={"host": "10.0.0.9"}, fields={"host": "str"},
             required=("host",)),
    Endpoint("POST", "/set_downstream",
             body={"relays_after_source": 2, "data_host": "127.0.0.1", "data_port": 9},
             fields={"relays_after_source": "int", "data_host": "str", "data_port": "int"}),
    Endpoint("POST", "/register", body={"relay_id": "r9", "control_url": LOCAL,
                                        "data_host": "127.0.0.1", "data_port": 9},
             fields={"relay_id": "str", "control_url": "url", "data_host": "str",
                     "data_port": "int"},
             required=("relay_id", "control_url", "data_host", "data_port")),
    Endpoint("POST", "/report_failure", body={"data_addr": "127.0.0.1:9"},
             fields={"data_addr": "str"}, required=("data_addr",)),
    Endpoint("POST", "/promote", body={"relays": []}, fields={"relays": "list"}),
    Endpoint("POST", "/set_master", body={"master_url": LOCAL}, fields={"master_url": "url"},
             required=("master_url",)),
]

PUBLISH = {"host": "127.0.0.1", "port": 9}
CONTROLLER_ENDPOINTS = [
    Endpoint("GET", "/health", open=True),
    Endpoint("GET", "/metrics", open=True),
    Endpoint("GET", "/metrics/targets", open=True),
    Endpoint("GET", "/batch", query={"timeout": "0"}, query_fields={"timeout": "number"}),
    Endpoint("POST", "/trained", body={"step": 1, "version": 1, "stats": {"loss": 0.5},
                                       "publish_blocked_s": 0.0, "wait_s": 0.0},
             fields={"step": "int", "version": "int", "stats": "dict",
                     "publish_blocked_s": "number", "wait_s": "number"},
             required=("step", "version")),
    Endpoint("GET", "/state"),
    Endpoint("POST", "/done", body={"steps": 1, "version": 1},
             fields={"steps": "int", "version": "int"}, required=("version",)),
    Endpoint("POST", "/relay_role", body={"stripe": 0, "node": "n0"}, query={"timeout": "0"},
             fields={"stripe": "int", "node": "str"}, query_fields={"timeout": "number"}),
    Endpoint("POST", "/register", body={"relay_url": LOCAL, "engines": [LOCAL],
                                        "publish": PUBLISH, "pull_agent": LOCAL,
                                        "relay_urls": [LOCAL]},
             fields={"relay_url": "url", "engines": "list_url", "publish": "dict",
                     "pull_agent": "url", "relay_urls": "list_url"},
             required=("relay_url", "engines")),
    Endpoint("GET", "/cluster", query_fields={"newest": "bool"}),
    Endpoint("GET", "/engine_states", query_fields={"url": "list_url"}),
    Endpoint("POST", "/resumed", body={"step": 1, "version": 1, "restarts": 0},
             fields={"step": "int", "version": "int", "restarts": "int"}, required=("version",)),
    Endpoint("POST", "/register_relay", body={"relay_url": LOCAL, "publish": PUBLISH,
                                              "stripe": 0, "node": "n0"},
             fields={"relay_url": "url", "publish": "dict", "stripe": "int", "node": "str"},
             required=("relay_url", "publish")),
    Endpoint("POST", "/engine_down", body={"url": LOCAL, "reason": "x", "evict": False},
             fields={"url": "url", "reason": "str", "evict": "bool"}, required=("url",)),
    Endpoint("POST", "/engine_replaced", body={"old_url": LOCAL, "new_url": LOCAL},
             fields={"old_url": "url", "new_url": "url"}, required=("old_url", "new_url")),
    Endpoint("POST", "/relay_replaced", body={"old_url": LOCAL, "new_url": LOCAL,
                                              "publish": PUBLISH, "stripe": 0},
             fields={"old_url": "url", "new_url": "url", "publish": "dict", "stripe": "int"},
             required=("old_url", "new_url")),
    Endpoint("POST", "/trainer_alive", body={"rank": 0, "node": 0, "host": "t0", "restarts": 0},
             fields={"rank": "int", "node": "int", "host": "str", "restarts": "int"},
             required=("rank", "node", "host")),
]


# ---------------------------------------------------------------------- helpers
def _relay(tmp_path, name="master", **kw):
    return relay_process(RelayConfig(TOKEN, relay_id=name, master=True, trainer_stages=1, **kw),
                         str(tmp_path / f"{name}.log")).start()


def _get(url, token=TOKEN, timeout=10):
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _weights(version):
    g = torch.Generator().manual_seed(version)
    return {"w": torch.randn(300, 7, generator=g), "b": torch.arange(13, dtype=torch.int64),
            "h": torch.randn(64, generator=g).to(torch.bfloat16)}


def _publish(port, version, token=TOKEN, chunk=4096):
    """What a stage lead's ``WeightPublisher`` does, for one bucket: join the publish session
    (proving the token), form the stage's group on its store and send the version."""
    session = join_publish_session("127.0.0.1", port, token, 0, 30.0)
    try:
        pg = stage_group(session.store, 0, 1, session.backend, datetime.timedelta(seconds=30),
                         session=session.number)
        channel = Channel(pg, 0, session.backend, chunk)
        named = _weights(version)
        metas, nbytes = layout(named)
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        write_bucket(buf, named, metas)
        channel.send_header({"type": "version", "version": version, "stage": 0,
                             "num_stages": 1, "base": None})
        assert channel.recv_header()["accept"]
        channel.send_header({"type": "bucket", "version": version, "stage": 0, "num_stages": 1,
                             "index": 0, "last_of_stage": True, "nbytes": nbytes,
                             "chunk_bytes": chunk, "metas": [m.to_dict() for m in metas],
                             "encoding": "full", "digest": digest(buf), "payload_bytes": nbytes})
        for off in range(0, nbytes, chunk):
            channel.send(buf[off:off + chunk])
        channel.send_header({"type": "end"})
        assert channel.recv_header() == {"need": [], "failed": False}
        channel.send_header({"type": "close"})
        channel.flush()
    finally:
        session.close()


def _pull_exact(url, version):
    async def go():
        async with RelayClient(url, TOKEN) as client:
            lease = await client.lease(min_version=version)
            assert lease is not None and lease.version == version
            try:
                with open_lease(await client.buckets(lease)) as named:
                    ref = _weights(version)
                    assert set(named) == set(ref)
                    return all(torch.equal(named[k], ref[k]) for k in ref)
            finally:
                await client.release(lease)
    return asyncio.run(go())


def _closed(sock) -> bool:
    """The peer closed ``sock`` without answering (EOF, or a reset: it left bytes unread)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def _segments(pid):
    return glob.glob(os.path.join(SHM_DIR, f"laminar-*-{pid}-*"))


@pytest.fixture
def controller(tmp_path):
    yield from running_controller(tmp_path, TOKEN)


# ---------------------------------------------------------------------- relay
@pytest.mark.multiprocess
def test_relay_answers_every_malformed_request_with_a_4xx_naming_the_field(tmp_path):
    relay = _relay(tmp_path)
    try:
        # the bug of issue 37: a number JSON cannot hold was a 500
        req = urllib.request.Request(relay.url + "/pull", data=b'{"min_version": 1e309}',
                                     method="POST", headers={"Authorization": f"Bearer {TOKEN}"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400 and "min_version" in err.value.read().decode()
        failures = check_server(relay.url, TOKEN, RELAY_ENDPOINTS)
        assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
        status, text = _get(relay.url + "/chain")  # and it still serves, unchanged
        assert status == 200 and json.loads(text)["chain"] == ["master"]
        assert relay.alive()
    finally:
        relay.stop()


@pytest.mark.multiprocess
def test_relay_discloses_nothing_without_the_token(tmp_path):
    relay = _relay(tmp_path)
    try:
        publish_port = relay.wait_printed("LAMINAR_RELAY_PUBLISH_PORT")
        data_port = relay.wait_printed("LAMINAR_RELAY_DATA_PORT")
        answers = tokenless_answers(relay.url, ["/health", "/metrics", "/chain", "/latest",
                                                "/latest?after=0&wait_s=0", "/nowhere"])
        assert answers["/health"] == '200 {"ok": true}'
        assert answers["/metrics"].startswith("200 ")
        for path in ("/chain", "/latest", "/latest?after=0&wait_s=0", "/nowhere"):
            assert answers[path].startswith("401 ") and "token" in answers[path], path
        for path, answer in answers.items():
            for port in (publish_port, data_port):
                assert not re.search(rf"\b{port}\b", answer), (path, answer[:300])
        # with the token: the details, the publish port among them
        status, text = _get(relay.url + "/health")
        assert status == 200 and json.loads(text)["publish_port"] == int(publish_port)
        assert json.loads(_get(relay.url + "/chain")[1])["publish_port"] == int(publish_port)
    finally:
        relay.stop()


@pytest.mark.multiprocess
def test_relay_stops_within_seconds_of_sigterm_with_a_long_poll_pending(tmp_path):
    relay = _relay(tmp_path)
    try:
        port = int(relay.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
        _publish(port, 1)
        wait_until(lambda: json.loads(_get(relay.url + "/latest")[1])["version"] == 1, 30, "v1")
        pid = relay.proc.pid
        assert _segments(pid), "the relay holds its version in shared memory"
        answers = []

        def poll():
            answers.append(_get(relay.url + "/latest?after=1&wait_s=55", timeout=70))

        poller = threading.Thread(target=poll)
        poller.start()
        wait_until(lambda: "laminar_relay_long_polls_waiting 1" in _get(relay.url + "/metrics")[1],
                   30, "the long poll waiting at the relay")  # (then SIGTERM, not before)
        assert not answers  # pending
        t0 = time.monotonic()
        relay.proc.send_signal(signal.SIGTERM)
        relay.proc.wait(timeout=60)
        exited = time.monotonic() - t0
        poller.join(timeout=10)
        print(f"relay exited {exited:.2f} s after SIGTERM")
        assert exited < EXIT_BOUND_S, f"the relay took {exited:.1f} s to exit after SIGTERM"
        assert answers and answers[0][0] == 503 and "shutting down" in answers[0][1], answers
        assert relay.proc.returncode == 0
        assert not _segments(pid), "shared memory left behind"
    finally:
        relay.stop()


@pytest.mark.multiprocess
def test_publish_port_admits_only_a_trainer_with_the_token(tmp_path):
    relay = _relay(tmp_path)
    silent = None
    try:
        port = int(relay.wait_printed("LAMINAR_RELAY_PUBLISH_PORT"))
        _publish(port, 1)
        wait_until(lambda: json.loads(_get(relay.url + "/latest")[1])["version"] == 1, 30, "v1")
        # a stranger that connects and says nothing holds no session (and is dropped later)
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)
        # garbage
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            assert recv_frame(s)["type"] == "publish-challenge"
            s.sendall(b"\x00\x00\x00\x05hello")
            assert _closed(s)  # nothing answered
        # what a torch TCPStore client sends first (a validation, then a SET of a key)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            recv_frame(s)
            s.sendall(bytes([9]) + struct.pack("<I", 0x3C85F7CE) + bytes([0])
                      + struct.pack("<Q", 3) + b"key" + struct.pack("<Q", 5) + b"value")
            assert _closed(s)
        # a well-formed join without the token; a join with the token of another run
        for token in ("", "another-run-token-0123"):
            with pytest.raises(RendezvousRefused, match="token"):
                join_publish_session("127.0.0.1", port, token, 0, 10.0)
        # a forged proof
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            nonce = recv_frame(s)["nonce"]
            send_frame(s, {"type": "join", "stage": 0, "nonce": "a" * 32, "proof": "0" * 64})
            reply = recv_frame(s)
            assert reply["accept"] is False and "authentication failed" in reply["reason"]
            assert nonce not in json.dumps(reply)
        # strangers holding every unauthenticated slot (one trickling a byte at a time) do not
        # keep the trainer out: the oldest is dropped for each newcomer
        from laminar_mcore.relay.rendezvous import MAX_PENDING

        squatters = [socket.create_connection(("127.0.0.1", port), timeout=10)
                     for _ in range(MAX_PENDING + 4)]
        squatters[-1].sendall(b"\x00")
        # the next publish arrives whole and bit for bit; the relay still serves
        _publish(port, 2)
        wait_until(lambda: json.loads(_get(relay.url + "/latest")[1])["version"] == 2, 30, "v2")
        assert _pull_exact(relay.url, 2)
        log = (tmp_path / "master.log").read_text()
        assert log.count("refused a publish join from") >= 4, log[-2000:]
        assert relay.alive()
        for s in squatters:
            s.close()
    finally:
        if silent is not None:
            silent.close()
        relay.stop()


def test_a_trainer_publishes_only_to_a_relay_that_proves_the_token():
    """A fake relay (it accepts every join) cannot take a trainer's weights: its answer does
    not prove the token, and the trainer gives up before its group forms."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]

    def fake():
        conn, _ = listener.accept()
        with conn:
            send_frame(conn, {"type": "publish-challenge", "nonce": "n" * 32})
            hello = recv_frame(conn)
            send_frame(conn, {"accept": True, "backend": "gloo", "session": 1,
                              "proof": relay_proof("a-guess", "n" * 32, hello["nonce"], 1)})
            conn.recv(1)

    thread = threading.Thread(target=fake, daemon=True)
    thread.start()
    try:
        with pytest.raises(RendezvousRefused, match="did not prove the run's token"):
            join_publish_session("127.0.0.1", port, TOKEN, 0, 10.0)
    finally:
        listener.close()
        thread.join(timeout=5)


# ---------------------------------------------------------------------- controller
def test_controller_answers_every_malformed_request_with_a_4xx_naming_the_field(controller):
    failures = check_server(controller.url, TOKEN, CONTROLLER_ENDPOINTS)
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
    # nothing was changed by any of them
    assert controller.rollout_nodes == [] and controller.master_relay is None
    assert controller.trainer_done is None and controller.trainer_version == 0
    assert not any(controller._master_claimed)


def test_controller_discloses_nothing_without_the_token(controller):
    answers = tokenless_answers(controller.url, ["/health", "/metrics", "/metrics/targets",
                                                 "/state", "/cluster", "/batch?timeout=0",
                                                 "/engine_states", "/nowhere"])
    assert answers["/health"].startswith("200 ")
    assert answers["/metrics"].startswith("200 ") and answers["/metrics/targets"].startswith("200")
    for path in ("/state", "/cluster", "/batch?timeout=0", "/engine_states", "/nowhere"):
        assert answers[path].startswith("401 ") and "token" in answers[path], path
    assert TOKEN not in "".join(answers.values())


@pytest.mark.multiprocess
def test_controller_stops_within_seconds_of_sigterm_with_long_polls_pending(tmp_path):
    env = dict(os.environ, **{TOKEN_ENV: TOKEN, "PYTHONWARNINGS": "ignore"})
    proc = subprocess.Popen([sys.executable, os.path.join(WORKERS, "controller_server.py"),
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        url = None
        deadline = time.time() + 120
        lines = []
        while url is None and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("LAMINAR_CONTROLLER_URL="):
                url = line.strip().split("=", 1)[1]
        assert url, "".join(lines)
        answers = {}

        def call(name, path, method="GET"):
            req = urllib.request.Request(url + path, method=method, data=b"{}" if
                                         method == "POST" else None,
                                         headers={"Authorization": f"Bearer {TOKEN}"})
            try:
                with urllib.request.urlopen(req, timeout=70) as resp:
                    answers[name] = (resp.status, resp.read().decode())
            except urllib.error.HTTPError as exc:
                answers[name] = (exc.code, exc.read().decode())

        call("first relay_role", "/relay_role?timeout=55", "POST")  # claims the master
        assert answers["first relay_role"][0] == 200
        pollers = [threading.Thread(target=call, args=("batch", "/batch?timeout=55")),
                   threading.Thread(target=call, args=("relay_role", "/relay_role?timeout=55",
                                                       "POST"))]
        for t in pollers:
            t.start()
        time.sleep(2.0)  # (both requests at the controller before SIGTERM, even under load)
        assert set(answers) == {"first relay_role"}  # both pending
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        exited = time.monotonic() - t0
        for t in pollers:
            t.join(timeout=10)
        print(f"controller exited {exited:.2f} s after SIGTERM")
        assert exited < EXIT_BOUND_S, f"the controller took {exited:.1f} s after SIGTERM"
        for name in ("batch", "relay_role"):
            assert answers.get(name, (0,))[0] == 503 and "shutting down" in answers[name][1], \
                answers
        assert "LAMINAR_CONTROLLER_STOPPED" in out, out[-2000:]  # stopped, not killed
        assert proc.returncode == 128 + signal.SIGTERM
        assert not _segments(proc.pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------------- the CPU engine
def _engine_endpoints(model_path):
    """The CPU engine's endpoints (SGLang 0.5.23's routes). Order matters: a well-formed body
    with an unknown field is served, as SGLang ignores unknown fields, so the pause comes
    last, after its continue. Not listed: /init_weights_update_group (a well-formed request
    starts a rendezvous) and the OpenAI routes (tests/test_sglang_protocol.py)."""
    gen = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
    return [
        Endpoint("GET", "/health", open=True), Endpoint("GET", "/ready", open=True),
        Endpoint("GET", "/metrics", open=True),
        Endpoint("POST", "/generate", body=gen,
                 fields={"input_ids": "list_int", "sampling_params": "dict"}),
        Endpoint("GET", "/model_info"), Endpoint("GET", "/server_info"),
        Endpoint("GET", "/v1/loads", query={"include": "core"}, query_fields={"include": "str"}),
        Endpoint("POST", "/begin_weight_update", body={}),
        Endpoint("POST", "/end_weight_update", body={}),
        Endpoint("POST", "/update_weights_from_tensor", body={
            "serialized_named_tensors": ["x"], "load_format": "flattened_bucket",
            "flush_cache": True}, fields={"serialized_named_tensors": "list_str",
                                          "load_format": "str", "flush_cache": "bool"}),
        Endpoint("POST", "/update_weights_from_distributed", body={
            "names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]], "group_name": "g"},
            fields={"names": "list_str", "dtypes": "list_str", "shapes": "list",
                    "group_name": "str"}),
        Endpoint("POST", "/update_weights_from_disk", body={"model_path": model_path},
                 fields={"model_path": "str"}),
        Endpoint("POST", "/update_weight_version", body={"new_version": "7"},
                 fields={"new_version": "str"}),
        Endpoint("POST", "/destroy_weights_update_group", body={"group_name": "g"},
                 fields={"group_name": "str"}),
        Endpoint("POST", "/abort_request", body={"rid": "nobody"}, fields={"rid": "str"}),
        Endpoint("POST", "/flush_cache", body={}, query={"timeout": "0"},
                 query_fields={"timeout": "number"}),
        Endpoint("POST", "/continue_generation", body={}),
        Endpoint("POST", "/pause_generation", body={"mode": "retract"}, fields={"mode": "str"}),
    ]


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    from laminar_mcore.models.hf import initial_hf_state, save_hf_checkpoint, tiny_hf_config

    path = str(tmp_path_factory.mktemp("engine") / "m")
    cfg = tiny_hf_config("qwen2")
    save_hf_checkpoint(path, cfg, initial_hf_state(type("M", (), {"path": None})(), cfg, 0))
    return path


def _engine(model_path, tmp_path, **kw):
    from laminar_mcore.rollout.launcher import EngineProcess, cpu_engine_command

    return EngineProcess(cpu_engine_command(model_path, api_key=TOKEN, **kw),
                         log_path=str(tmp_path / "engine.log")).start()


@pytest.mark.multiprocess
def test_cpu_engine_never_answers_a_malformed_request_with_a_5xx(engine_model, tmp_path):
    """The CPU engine is SGLang's twin: it refuses what 0.5.23 refuses (a wrong type is a 400
    there too) and, like it, ignores unknown fields -- so the table's cases must get an answer
    below 500 (401 without the key), and the engine must keep serving."""
    engine = _engine(engine_model, tmp_path)
    try:
        failures = check_server(engine.url, TOKEN, _engine_endpoints(engine_model),
                                health="/model_info", max_body=64 << 20, twin=True)
        assert not failures, "\n".join(failures[:40])
        assert _get(engine.url + "/ready")[0] == 503  # paused by the last line, as asked
    finally:
        engine.stop()


@pytest.mark.multiprocess
def test_cpu_engine_stops_within_seconds_of_sigterm_with_streams_pending(engine_model,
                                                                         tmp_path):
    """SIGTERM while a stream runs and a request waits at the pause gate of a paused engine:
    the stream ends with an error chunk (503, shutting down), the waiting request gets a 503,
    and the process exits within seconds."""
    import aiohttp

    engine = _engine(engine_model, tmp_path)
    try:
        async def scenario():
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with aiohttp.ClientSession(headers=headers) as s:
                chunks = []

                async def stream():
                    async with s.post(engine.url + "/generate", json={
                            "input_ids": [1, 2], "stream": True, "sampling_params": {
                                "max_new_tokens": 400, "ignore_eos": True}}) as resp:
                        async for line in resp.content:
                            if line.startswith(b"data:"):
                                chunks.append(line[5:].strip())

                streaming = asyncio.create_task(stream())
                while not chunks:
                    await asyncio.sleep(0.02)
                async with s.post(engine.url + "/pause_generation",
                                  json={"mode": "retract"}) as resp:
                    assert resp.status == 200

                async def gated():
                    async with s.post(engine.url + "/generate", json={
                            "input_ids": [3], "sampling_params": {"max_new_tokens": 2}}) as r:
                        return r.status, await r.text()

                waiting = asyncio.create_task(gated())
                await asyncio.sleep(1.0)  # (at the engine's gate before SIGTERM, under load too)
                t0 = time.monotonic()
                engine.proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(streaming, 30)
                gate = await asyncio.wait_for(waiting, 30)
                return chunks, gate, t0

        chunks, gate, t0 = asyncio.run(scenario())
        engine.proc.wait(timeout=60)
        exited = time.monotonic() - t0
        print(f"CPU engine exited {exited:.2f} s after SIGTERM")
        assert exited < EXIT_BOUND_S, f"the engine took {exited:.1f} s to exit after SIGTERM"
        assert chunks[-1] == b"[DONE]"
        error = json.loads(chunks[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"]
        assert gate[0] == 503 and "shutting down" in gate[1]
    finally:
        engine.stop()
