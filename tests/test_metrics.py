"""The metrics writer and its loggers: the same records reach jsonl, TensorBoard, W&B (offline)
and MLflow (a file store), without a network; names and missing packages fail at startup; a
logger failing mid-run never stops the run."""

import glob
import json
import logging
import math
import struct
import sys
import threading

import pytest

from laminar_mcore.metrics import LoggerUnavailable, MetricsWriter
from laminar_mcore.metrics.loggers import (MetricsLogger, OffThreadLogger, missing_packages,
                                           scalars)

# Out of order on purpose: the evaluation of step 0 arrives after training step 2 (as in a run).
RECORDS = [
    ("train", 1, dict(loss=0.5, reward_mean=0.25, version=1, engine="e0", ok=True, none=None)),
    ("train", 2, dict(loss=float("nan"), reward_mean=0.75, version=2, engine="e1", ok=False)),
    ("eval", 0, dict(accuracy=0.125, accuracy_greedy=0.5)),
    ("fault", None, dict(fault="engine", event="down")),
]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline and MLflow on its file store, every file of both under tmp_path; no
    telemetry, no error reporting, no console capture."""
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
                       "WANDB_ERROR_REPORTING": "false", "WANDB_DISABLE_GIT": "true",
                       "WANDB_DIR": str(tmp_path / "wandb_home"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wandb_home"),
                       "WANDB_CONFIG_DIR": str(tmp_path / "wandb_home"),
                       "WANDB_DATA_DIR": str(tmp_path / "wandb_home"),
                       "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}.items():
        monkeypatch.setenv(key, value)
    # the writer sets MLFLOW_ALLOW_FILE_STORE: set it here first, so that monkeypatch records
    # it and takes the writer's value away at the end (a delenv of an unset one records nothing)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    for key in ("WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME",
                "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(key, raising=False)
    yield tmp_path
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()  # stops the wandb-core service process


def _expected():
    """kind/key -> [(step, value)] for every scalar the records carry (NaN as a string)."""
    out = {}
    for kind, step, values in RECORDS:
        if step is None:
            continue
        for key, value in scalars({"kind": kind, "step": step, **values}).items():
            out.setdefault(key, []).append((step, _plain(value)))
    return out


def _plain(value):
    return "nan" if math.isnan(value) else value


def _wandb_history(run_file):
    """The history rows of an offline W&B run, read from its .wandb file (a LevelDB-style log:
    a 7-byte header, 32 KiB blocks, records framed by crc32/length/type, protobuf payloads)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, chunk, rows = open(run_file, "rb").read(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the tail of a block too short for a header is padding
            pos += block - pos % block
            continue
        length, frame = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if frame in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_every_logger_gets_the_same_records(offline):
    out_dir = str(offline / "run")
    writer = MetricsWriter(out_dir, ["tensorboard", "jsonl", "wandb", "mlflow"], run_name="demo",
                           run_config={"trainer": {"lr": 0.5, "loggers": ["jsonl"]}, "seed": 7})
    for kind, step, values in RECORDS:
        writer.log(kind, step=step, **values)
    writer.close()
    writer.close()  # idempotent: role.py and train.py close in `finally`
    expected = _expected()
    assert set(expected) == {"train/loss", "train/reward_mean", "train/version", "eval/accuracy",
                             "eval/accuracy_greedy"}

    lines = [json.loads(line) for line in open(f"{out_dir}/metrics.jsonl")]
    assert [(r["kind"], r.get("step")) for r in lines] == [(k, s) for k, s, _ in RECORDS]
    assert lines[0]["engine"] == "e0" and lines[3]["event"] == "down" and lines[0]["ok"] is True
    assert json.dumps(lines) == json.dumps(writer.records)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(f"{out_dir}/tensorboard")
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(expected)
    for key, points in expected.items():
        assert [(e.step, _plain(e.value)) for e in events.Scalars(key)] == points

    (run_file,) = glob.glob(f"{out_dir}/wandb/offline-run-*/run-*.wandb")
    got = {}
    for row in _wandb_history(run_file):
        kind = next(key for key in row if key.endswith("/step")).split("/")[0]
        for key, value in row.items():
            if key.startswith(f"{kind}/") and key != f"{kind}/step":
                got.setdefault(key, []).append((row[f"{kind}/step"], _plain(value)))
    assert got == expected

    from mlflow.tracking import MlflowClient

    client = MlflowClient((offline / "run" / "mlruns").as_uri())  # the default: <out>/mlruns
    experiment = client.get_experiment_by_name("laminar_mcore")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "demo" and run.info.status == "FINISHED"
    assert run.data.params == {"trainer.lr": "0.5", "trainer.loggers": "['jsonl']", "seed": "7"}
    for key, points in expected.items():
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted((m.step, _plain(m.value)) for m in history) == sorted(points)


def test_names_are_checked_and_jsonl_is_required(tmp_path):
    with pytest.raises(ValueError, match="unknown logger.*'neptune'.*known ones are "
                                         "tensorboard, jsonl, wandb, mlflow"):
        MetricsWriter(str(tmp_path), ["jsonl", "neptune"])
    with pytest.raises(ValueError, match=r"lacks jsonl.*trainer.loggers=\[jsonl,tensorboard\]"):
        MetricsWriter(str(tmp_path), ["tensorboard"])
    with pytest.raises(ValueError, match="names a logger twice"):
        MetricsWriter(str(tmp_path), ["jsonl", "jsonl"])


@pytest.mark.parametrize("name,pip_name", [("wandb", "wandb"), ("mlflow", "mlflow-skinny"),
                                           ("tensorboard", "tensorboard")])
def test_a_missing_package_fails_at_startup_with_the_install_command(tmp_path, monkeypatch,
                                                                     name, pip_name):
    monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    assert missing_packages(["jsonl", name]) == [
        f"LMC-E107: trainer.loggers has {name}, but the '{name}' package is not installed: "
        f"pip install {pip_name} (or drop {name} from trainer.loggers)"]
    with pytest.raises(LoggerUnavailable, match=f"pip install {pip_name} "):
        MetricsWriter(str(tmp_path), ["jsonl", name])


class _Broken(MetricsLogger):
    name = "broken"

    def log(self, record):
        raise OSError("disk full")


def test_a_logger_failing_mid_run_warns_once_and_the_run_goes_on(tmp_path, caplog):
    writer = MetricsWriter(str(tmp_path), ["jsonl"])
    writer._loggers.append(_Broken())
    with caplog.at_level(logging.WARNING, logger="laminar_mcore.metrics"):
        for step in range(3):
            writer.log("train", step=step, loss=1.0)
    writer.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "broken failed (OSError: disk full)" in warnings[0]
    assert len(open(tmp_path / "metrics.jsonl").readlines()) == 3


class _Stalled(MetricsLogger):
    """A tracking server that does not answer until released."""

    name = "stalled"

    def __init__(self):
        self.entered, self.release, self.got, self.closed = (threading.Event(), threading.Event(),
                                                             [], False)

    def log(self, record):
        self.entered.set()
        self.release.wait()
        self.got.append(record["step"])

    def close(self):
        self.closed = True


def test_a_stalled_tracking_server_never_blocks_the_writer(caplog):
    backend = _Stalled()
    off_thread = OffThreadLogger(backend, max_pending=1)
    off_thread.log({"kind": "train", "step": 0})
    backend.entered.wait()  # step 0 is stuck in the backend
    with caplog.at_level(logging.WARNING, logger="laminar_mcore.metrics"):
        for step in (1, 2, 3):  # 1 waits in the queue, 2 and 3 are dropped
            off_thread.log({"kind": "train", "step": step})
    assert [r.getMessage() for r in caplog.records] == [
        "metrics logger stalled is 1 records behind; dropping records for it (metrics.jsonl "
        "keeps them all)"]
    backend.release.set()
    off_thread.close()
    assert backend.got == [0, 1] and backend.closed
