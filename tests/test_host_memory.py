"""Host memory: the plan's host budget (cluster.host_memory_gb, cluster.shm_gb) and its refusals,
the relay's bound of weight_sync.relay_versions versions in /dev/shm (a receive beyond it waits
for a lease to be released or to lapse, in the real store and in a real relay process), and the
relay's refusal to start, or to take a version, that /dev/shm cannot hold."""

import glob
import json
import os
import socket
import threading
import time
import urllib.request

import pytest
import torch
from hydra import compose, initialize_config_dir

from laminar_mcore.config import ConfigError, register_configs, typed, validate_config
from laminar_mcore.config.paths import conf_dir
from laminar_mcore.config.plan import capacity_plan, relay_model_bytes
from laminar_mcore.config.plan_text import format_plan
from laminar_mcore.config.schema import WeightSyncConfig
from laminar_mcore.relay.chain import ReceiverBusy, push_version
from laminar_mcore.relay.launch import relay_process
from laminar_mcore.relay.server import RelayConfig, RelayServer
from laminar_mcore.relay.store import ShmFull, StoreFull, VersionStore
from laminar_mcore.relay.tmpfs import shm_space
from laminar_mcore.server_process import ServerStartError
from laminar_mcore.weights.bucket import SHM_DIR, layout, read_bucket, write_bucket

register_configs()
TOKEN = "run-token"
# The README's figure: /dev/shm per rollout node for the 235B recipe (2 versions of 470.2 GB),
# within the default tmpfs of a 2 TB node (half of it).
QWEN3_235B_SHM_GB = 940.4


def _compose(*overrides):
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


# ---------------------------------------------------------------------- the plan
def test_the_235b_recipe_fits_a_2tb_node_gpu_and_host():
    plan = capacity_plan(_compose("experiment=qwen3_235b_a22b_math"))
    assert (plan["host_memory_gb"], plan["shm_gb"], plan["relay_versions"]) == (2048, 1024, 2)
    assert plan["relay_shm_gb_per_rollout_node"] == pytest.approx(QWEN3_235B_SHM_GB, abs=0.1)
    assert plan["relay_shm_gb_per_rollout_node"] <= plan["shm_gb"]
    assert plan["pinned_publish_gb_per_trainer_node"] == pytest.approx(235.1, abs=0.1)
    assert plan["rollout_host_gb_per_node"] < plan["host_memory_gb"]
    assert plan["trainer_host_gb_per_node"] < plan["host_memory_gb"]
    assert plan["fits_gpu"] and plan["fits_host"] and plan["fits"] and not plan["problems"]
    text = format_plan(plan)
    assert "(2 versions) of 1024 GB" in text and "of 2048 GB" in text and "fits: yes" in text
    # the relay's start-up check gets the same version size
    cfg = _compose("experiment=qwen3_235b_a22b_math", "model.path=null",
                   "cluster.controller_addr=10.0.0.1")
    assert relay_model_bytes(cfg) / 1e9 * 2 == pytest.approx(QWEN3_235B_SHM_GB, abs=0.1)
    assert relay_model_bytes(typed(cfg)) == relay_model_bytes(cfg)  # as a supervisor holds it
    # published per rank, a relay also holds the whole tensors it assembles: twice the bytes
    dense = ("experiment=qwen2_5_7b_math", "model.path=null", "cluster.controller_addr=10.0.0.1")
    assert relay_model_bytes(_compose(*dense, "weight_sync.export=per_rank")) == \
        2 * relay_model_bytes(_compose(*dense))
    plans = [capacity_plan(_compose(*dense, f"weight_sync.export={e}"))
             for e in ("stage_lead", "per_rank")]
    assert plans[1]["relay_shm_gb_per_rollout_node"] == pytest.approx(
        2 * plans[0]["relay_shm_gb_per_rollout_node"], abs=0.2)
    # at TP1 every part is whole tensors, served as they are: once (a MoE's EP ranks too)
    assert relay_model_bytes(_compose(*dense, "weight_sync.export=per_rank", "parallel.tp=1")) \
        == relay_model_bytes(_compose(*dense, "parallel.tp=1"))


def test_host_problems_name_the_key_and_fits_is_both():
    three = capacity_plan(_compose("experiment=qwen3_235b_a22b_math",
                                   "weight_sync.relay_versions=3"))
    assert three["fits_gpu"] and not three["fits_host"] and not three["fits"]
    assert three["relay_shm_gb_per_rollout_node"] == pytest.approx(1410.6, abs=0.1)
    (problem,) = three["problems"]
    assert "weight_sync.relay_versions=3" in problem and "mount -o remount,size=1490G" in problem
    assert "cluster.shm_gb unset: half of cluster.host_memory_gb" in problem
    assert "fits: NO (GPU: yes, host: no)" in format_plan(three)
    remounted = capacity_plan(_compose("experiment=qwen3_235b_a22b_math",
                                       "weight_sync.relay_versions=3", "cluster.shm_gb=1490"))
    assert remounted["fits"]
    small = capacity_plan(_compose("experiment=qwen3_235b_a22b_math",
                                   "cluster.host_memory_gb=512", "cluster.shm_gb=1000"))
    assert not small["fits_host"] and small["fits_gpu"]
    assert any("cluster.shm_gb=1000 is more than cluster.host_memory_gb=512" in p
               for p in small["problems"])
    assert any(p.startswith("LMC-E124: a rollout node needs") and "cluster.host_memory_gb=512" in p
               for p in small["problems"])
    # the offloaded reference model's host memory counts on the trainer node
    off = capacity_plan(_compose("experiment=qwen3_235b_a22b_math", "algo.kl_coef=0.001",
                                 "algo.ref_offload=true", "cluster.host_memory_gb=300"))
    ref = off["reference_host_gb_per_trainer_node"]
    assert ref > 50 and off["trainer_host_gb_per_node"] == pytest.approx(
        off["pinned_publish_gb_per_trainer_node"] + ref + 8 * 8, abs=0.2)
    (trainer,) = [p for p in off["problems"] if p.startswith("LMC-E125: a trainer node needs")]
    assert "offloaded reference model" in trainer and "algo.ref_offload=false" in trainer
    # local_cpu: host memory is not checked
    cpu = capacity_plan(_compose())
    assert cpu["host_memory_gb"] == 0 and cpu["fits_host"] and cpu["fits"]
    assert "not checked: cluster.host_memory_gb=0" in format_plan(cpu)


@pytest.mark.parametrize("job", ["train", "rollout", "trainer"])
def test_a_run_whose_relay_does_not_fit_shm_is_refused_before_it_starts(job):
    cfg = _compose("experiment=qwen3_235b_a22b_math", f"job={job}", "model.path=null",
                   "cluster.controller_addr=10.0.0.1", "weight_sync.relay_versions=3")
    with pytest.raises(ConfigError, match=r"does not fit .*weight_sync.relay_versions=3 .*"
                                          r"mount -o remount,size=1490G /dev/shm"):
        validate_config(cfg)
    cfg.cluster.shm_gb = 1490
    validate_config(cfg)


def test_a_cpu_cluster_with_its_ram_stated_is_checked_and_local_cpu_is_not(tmp_path):
    """No GPUs but cluster.host_memory_gb set: the host budget is still checked before anything
    starts (a relay and the demo's two engine workers at 8 GB each do not fit 10 GB; one engine
    needs 16 GB); local_cpu states no
    RAM (0) and is not; job=plan reports the same misfit instead of refusing it."""
    from laminar_mcore.launch.plan import run_plan

    validate_config(_compose("job=train"))  # local_cpu: gpus_per_node=0, host_memory_gb=0
    small = _compose("job=train", "cluster.host_memory_gb=10")
    assert small.cluster.gpus_per_node == 0
    with pytest.raises(ConfigError, match=r"does not fit \(job=plan shows the whole plan\): a "
                                          r"rollout node needs 24.0 GB .*3 processes.*"
                                          r"cluster.host_memory_gb=10"):
        validate_config(small)
    with pytest.raises(ConfigError, match=r"rollout node needs 16.0 GB .*2 processes"):
        validate_config(_compose("job=train", "cluster.host_memory_gb=10",
                                 "rollout.num_engines=1"))
    with pytest.raises(ConfigError, match=r"cluster.shm_gb=100 is more than "
                                          r"cluster.host_memory_gb=64: .*lower it"):
        validate_config(_compose("job=train", "cluster.host_memory_gb=64", "cluster.shm_gb=100"))
    validate_config(_compose("job=train", "cluster.host_memory_gb=64"))
    plan_cfg = _compose("job=plan", "cluster.host_memory_gb=10", f"output_dir={tmp_path}")
    validate_config(plan_cfg)  # reported, not refused
    plan = run_plan(plan_cfg)
    written = json.loads((tmp_path / plan_cfg.run_name / "plan.json").read_text())
    assert written["fits_gpu"] and not written["fits_host"] and not written["fits"]
    assert written["problems"] == plan["problems"] and "cluster.host_memory_gb=10" in \
        written["problems"][0]


@pytest.mark.parametrize("override, message", [
    ("weight_sync.relay_versions=1", r"weight_sync.relay_versions=1 must be >= 2 .*set "
                                     r"weight_sync.relay_versions=2"),
    ("cluster.host_memory_gb=-1", r"cluster.host_memory_gb=-1 must be >= 0 .*0: host memory "
                                  r"not checked"),
    ("cluster.shm_gb=0", r"cluster.shm_gb=0 must be > 0 .*or null for half of "
                         r"cluster.host_memory_gb"),
])
@pytest.mark.parametrize("cluster", ["local_cpu", "multinode"])
def test_host_memory_keys_out_of_range_are_refused_naming_the_key(override, message, cluster):
    extra = (["experiment=qwen3_235b_a22b_math", "model.path=null",
              "cluster.controller_addr=10.0.0.1"] if cluster == "multinode" else [])
    for job in ("train", "plan"):  # a value that means nothing is refused by job=plan too
        with pytest.raises(ConfigError, match=message):
            validate_config(_compose(*extra, f"job={job}", override))


# ---------------------------------------------------------------------- the store
def _fill(store, version, value, owner="t", rows=64):
    sv = store.begin(version, 1, owner=owner, wait_s=0)
    named = {"w": torch.full((rows, 4), float(value)), "b": torch.arange(3)}
    metas, nbytes = layout(named)
    bucket = store.add_bucket(sv, (0, 0), nbytes, metas, last_of_stage=True)
    write_bucket(bucket.shm.buffer, named, metas)
    store.progress(sv, bucket, nbytes)
    assert store.try_complete(sv)
    return sv


def _own_segments(pid=None):
    return glob.glob(os.path.join(SHM_DIR, f"laminar-relay-{pid or os.getpid()}-*"))


def test_a_receive_waits_for_a_leased_version_and_the_store_never_holds_more():
    """relay_versions=2: v1 leased by a slow pull, v2 newest; v3 waits until the lease is
    released (never writing into v1's buffers), and never more than 2 versions' buffers
    exist -- in the store's books and in /dev/shm."""
    with pytest.raises(ValueError, match=r"weight_sync.relay_versions=1 must be >= 2"):
        VersionStore(max_versions=1)
    store = VersionStore(max_versions=2)
    try:
        before = set(_own_segments())
        _fill(store, 1, 1.0)
        lease_id, v1 = store.lease_latest()
        _fill(store, 2, 2.0)
        one = store.version_bytes
        got = {}
        waiter = threading.Thread(target=lambda: got.update(sv=store.begin(3, 1, owner="t",
                                                                           wait_s=20)))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and 3 not in store.receiving  # waiting for room
        lease2, newest = store.lease_latest()  # pulls go on meanwhile
        assert newest.version == 2 and store.release(lease2)
        assert waiter.is_alive() and store.release(lease_id)
        waiter.join(timeout=5)
        assert not waiter.is_alive() and got["sv"].version == 3
        store.fail(got["sv"], "test")
        for version in range(4, 9):  # steady state: buffers recycled, never a third copy
            _fill(store, version, float(version))
            with store.cond:
                assert len(store._holding()) <= 2 and store.held_bytes <= 2 * one
            assert len(set(_own_segments()) - before) <= 2
        # a leased version's bytes stay intact while newer ones wait
        lease_id, v8 = store.lease_latest()
        _fill(store, 9, 9.0)
        with pytest.raises(StoreFull, match=r"weight_sync.relay_versions=2 versions hold this "
                                            r"relay's buffers \(9 \(newest\), 8 \(leased"):
            store.begin(10, 1, owner="t", wait_s=0.2)
        assert torch.equal(read_bucket(v8.ordered()[0].shm.buffer, v8.ordered()[0].metas)["w"],
                           torch.full((64, 4), 8.0))
        # refused once, refused whole: the same sender's later calls (the trainer's stream,
        # bucket by bucket) never start a partial copy; another sender may take it
        store.release(lease_id)
        with pytest.raises(StoreFull):
            store.begin(10, 1, owner="t", wait_s=5)
        assert store.begin(10, 1, owner="push-2", wait_s=0).version == 10
    finally:
        store.close()


def test_a_lease_that_lapses_lets_the_waiting_receive_in():
    store = VersionStore(max_versions=2, lease_ttl_s=0.6)
    try:
        _fill(store, 1, 1.0)
        start = time.monotonic()  # (before the lease: its 0.6 s run from here at the latest)
        store.lease_latest()  # a puller that died: nobody releases it
        _fill(store, 2, 2.0)
        # let in once the lease lapsed (0.6 s), not at the end of its wait (which would refuse)
        assert store.begin(3, 1, owner="t", wait_s=60).version == 3
        assert 0.5 < time.monotonic() - start < 30
    finally:
        store.close()


def test_free_buffers_of_another_size_are_trimmed_and_fresh_ones_are_reserved():
    store = VersionStore(max_versions=2)
    try:
        before = set(_own_segments())
        for version in (1, 2, 3):
            _fill(store, version, 1.0, rows=64)
        for version in (4, 5, 6):  # a larger layout: the old buffers go, never more than 2
            sv = _fill(store, version, 1.0, rows=256)
            with store.cond:
                assert store.held_bytes <= 2 * store.version_bytes
            assert len(set(_own_segments()) - before) <= 2
        path = sv.ordered()[0].shm.path
        assert os.stat(path).st_blocks * 512 >= sv.nbytes  # every page allocated up front
    finally:
        store.close()


def test_a_version_that_shm_cannot_hold_is_refused_with_the_mount_to_enlarge():
    free, _ = shm_space()
    store = VersionStore(max_versions=2, model_bytes=free + 10**12)
    try:
        with pytest.raises(ShmFull, match=r"has .* GB free .* but version 1 .*mount -o remount,"
                                          r"size=\d+G .*cluster.shm_gb"):
            store.begin(1, 1, owner="trainer")
        with pytest.raises(ShmFull):  # the rest of its buckets: refused whole
            store.begin(1, 1, owner="trainer", wait_s=0)
    finally:
        store.close()


# ---------------------------------------------------------------------- a real relay
def test_a_relay_refuses_to_start_when_shm_cannot_hold_its_versions(tmp_path):
    free, _ = shm_space()
    cfg = RelayConfig(TOKEN, master=True, model_bytes=free // 2 + 10**10)
    with pytest.raises(ShmFull, match=r"cannot start: .* weight_sync.relay_versions=2 versions "
                                      r"of .*mount -o remount,size=\d+G"):
        RelayServer(cfg)
    with pytest.raises(ServerStartError, match=r"relay exited with 2:(.|\n)*cluster.shm_gb"):
        relay_process(cfg, str(tmp_path / "relay.log")).start()


def _post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _push(port, store, sv):
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.settimeout(60)
        return push_version(sock, store, sv, 2**20, lambda: False, TOKEN)


def test_a_relay_holds_at_most_relay_versions_and_a_push_waits_for_the_lease(tmp_path):
    """A real relay process: version 1 leased by a slow pull, 2 pushed; the push of 3 waits
    (the relay answers only once the lease is released) and the relay's /dev/shm never holds
    a third version."""
    relay = relay_process(RelayConfig(TOKEN, master=True, weight_sync=WeightSyncConfig(
        relay_versions=2)), str(tmp_path / "relay.log")).start()
    source = VersionStore()
    try:
        port = int(relay.wait_printed("LAMINAR_RELAY_DATA_PORT"))
        versions = {}
        for v in (1, 2, 3):  # pinned, as a forwarder pins what it pushes
            versions[v] = _fill(source, v, float(v), owner="source")
            source.pin(versions[v])
        assert _push(port, source, versions[1])
        lease = _post(relay.url, "/pull", {"format": "shm"})
        assert lease["version"] == 1
        assert _push(port, source, versions[2])
        done = {}
        pusher = threading.Thread(target=lambda: done.update(ok=_push(port, source, versions[3])))
        pusher.start()
        time.sleep(1.5)
        assert pusher.is_alive()  # waiting for room
        assert len(_own_segments(relay.proc.pid)) == 2  # v1 (leased) and v2, nothing of v3
        assert _post(relay.url, "/release", {"lease_id": lease["lease_id"]})["released"]
        pusher.join(timeout=20)
        assert done.get("ok") is True
        assert _post(relay.url, "/pull", {"format": "shm"})["version"] == 3
        assert len(_own_segments(relay.proc.pid)) == 2
    finally:
        relay.stop()
        source.close()
    # weight_sync.relay_full_wait_s: how long the version waits before it is refused
    relay = relay_process(RelayConfig(TOKEN, master=True, weight_sync=WeightSyncConfig(
        relay_versions=2, relay_full_wait_s=1.0)), str(tmp_path / "relay1s.log")).start()
    source = VersionStore()
    try:
        port = int(relay.wait_printed("LAMINAR_RELAY_DATA_PORT"))
        versions = {}
        for v in (1, 2, 3):  # pinned, as a forwarder pins what it pushes
            versions[v] = _fill(source, v, float(v), owner="source")
            source.pin(versions[v])
        assert _push(port, source, versions[1])
        assert _post(relay.url, "/pull", {"format": "shm"})["version"] == 1  # held
        assert _push(port, source, versions[2])
        with pytest.raises(ReceiverBusy, match=r"no lease or pin ended within 1 s"):
            _push(port, source, versions[3])
    finally:
        relay.stop()
        source.close()


_SMALL_SHM = r'''
import json, torch
from laminar_mcore.relay.server import RelayConfig, RelayServer
from laminar_mcore.relay.store import ShmFull, VersionStore
from laminar_mcore.weights.bucket import layout, write_bucket

out = {}
try:
    RelayServer(RelayConfig("t", master=True, model_bytes=600_000))
except ShmFull as exc:
    out["start"] = str(exc)
store = VersionStore(max_versions=2)
sv = store.begin(1, 1, owner="t")
try:
    store.add_bucket(sv, (0, 0), 2_000_000, [], last_of_stage=True)
except ShmFull as exc:  # fallocate says ENOSPC: no SIGBUS on a later write
    out["bucket"] = str(exc)
try:  # the whole version is refused: its other buckets are drained by the receiver
    store.begin(1, 1, owner="t")
except ShmFull as exc:
    out["again"] = str(exc)
sv = store.begin(2, 1, owner="t")  # the next version is taken
named = {"w": torch.ones(150_000)}  # 600 kB of the 1 MB
metas, nbytes = layout(named)
bucket = store.add_bucket(sv, (0, 1), nbytes, metas, last_of_stage=True)
write_bucket(bucket.shm.buffer, named, metas)
store.progress(sv, bucket, nbytes)
out["complete"] = store.try_complete(sv)
out["latest"] = store.latest_version
try:
    store.begin(3, 1, owner="t")
except ShmFull as exc:  # a second version cannot fit beside the first
    out["version"] = str(exc)
store.close()
print(json.dumps(out))
'''


def test_in_a_small_tmpfs_the_relay_refuses_instead_of_dying_of_sigbus():
    """A real 1 MB tmpfs mounted on /dev/shm in a private mount namespace: the relay refuses to
    start for 2 versions of 600 kB, a bucket larger than the free space is refused when it is
    allocated (not with SIGBUS when written), with its whole version (the next is taken), and
    a second version that cannot fit beside the
    first is refused at its ``begin``; each message names the mount to enlarge."""
    import subprocess
    import sys

    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no unprivileged mount namespace here: {probe.stderr.decode()[-200:]}")
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$0" -c "$1"', sys.executable,
         _SMALL_SHM], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["complete"] is True and out["latest"] == 2
    assert out["again"] == out["bucket"]
    assert out["bucket"].startswith("LMC-E500: version 1 refused: ")
    for key in ("start", "bucket", "version"):
        assert "/dev/shm has" in out[key] and "MB free of 1.05 MB" in out[key], out
        assert "mount -o remount,size=2M /dev/shm" in out[key] and "cluster.shm_gb" in out[key]
    assert "weight_sync.relay_versions=2 versions" in out["start"]
    assert "a weight bucket needs" in out["bucket"] and "version 3 needs" in out["version"]
