"""The backends of ``trainer.loggers``: one small class per tool, one interface.

Each backend receives the same records from ``MetricsWriter`` (``{"kind", "time", "step"?,
**values}``) and owns its connection to one tool. The scalar backends (tensorboard, wandb,
mlflow) take the numeric values of records that have a step, as ``kind/key``; records without a
step (fault events) go to ``metrics.jsonl`` only. A backend may fail at startup, with a message
saying what to install or set; once the run has started, it must never stop training: every
call goes through ``call_quietly``, which logs the first failure of a backend and swallows it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import numbers
import os
import queue
import threading
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

logger = logging.getLogger(__name__)

LOGGERS = ("tensorboard", "jsonl", "wandb", "mlflow")
DEFAULT_LOGGERS = ("tensorboard", "jsonl")
DEFAULT_PROJECT = "laminar_mcore"  # W&B project and MLflow experiment when none is set
# logger -> (module it imports, what to pip install)
_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow-skinny")}
_RECORD_FIELDS = ("kind", "time", "step")


class LoggerUnavailable(RuntimeError):
    """A configured logger cannot start: its package is missing or its tool refused the run."""


def logger_problems(names: Sequence[str]) -> List[str]:
    """What is wrong with a ``trainer.loggers`` list, each with its fix (empty: valid)."""
    problems = []
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        problems.append("LMC-E106: "
                        f"trainer.loggers has unknown logger(s) {', '.join(map(repr, unknown))}; "
                        f"the known ones are {', '.join(LOGGERS)}")
    if len(set(names)) != len(names):
        problems.append(f"LMC-E106: trainer.loggers={list(names)} names a logger twice")
    if "jsonl" not in names:
        problems.append("LMC-E106: "
                        f"trainer.loggers={list(names)} lacks jsonl: metrics.jsonl is the run's "
                        "own record (the summary, the chaos tests and the benchmarks read it); "
                        f"add it, e.g. trainer.loggers=[{','.join(['jsonl', *names])}]")
    return problems


def _install_hint(name: str) -> str:
    module, pip_name = _PACKAGES[name]
    return (f"LMC-E107: trainer.loggers has {name}, but the {module!r} package is not installed: "
            f"pip install {pip_name} (or drop {name} from trainer.loggers)")


def missing_packages(names: Iterable[str]) -> List[str]:
    """One message per configured logger whose package is not installed (nothing imported)."""
    return [_install_hint(n) for n in names
            if n in _PACKAGES and importlib.util.find_spec(_PACKAGES[n][0]) is None]


def _require(name: str):
    try:
        return importlib.import_module(_PACKAGES[name][0])
    except ImportError as exc:
        raise LoggerUnavailable(_install_hint(name)) from exc


def scalars(record: dict) -> Dict[str, float]:
    """The numeric values of a record as ``kind/key`` (bools, strings and None are left out;
    NaN and inf are kept: a non-finite loss is worth seeing)."""
    kind = record["kind"]
    return {f"{kind}/{key}": float(value) for key, value in record.items()
            if key not in _RECORD_FIELDS and isinstance(value, numbers.Real)
            and not isinstance(value, bool)}


def call_quietly(backend: "MetricsLogger", method: str, *args) -> None:
    """Call ``backend.<method>``; a failure is logged once per backend, never raised."""
    try:
        getattr(backend, method)(*args)
    except Exception as exc:  # noqa: BLE001 - a metrics backend must never stop the run
        if not backend.failed:
            backend.failed = True
            logger.warning("metrics logger %s failed (%s: %s); the run goes on, further "
                           "failures of this logger are not reported", backend.name,
                           type(exc).__name__, exc)


class MetricsLogger:
    """One destination of the run's records."""

    name = "?"
    failed = False  # set by call_quietly at the first failure, so it is reported once

    def log(self, record: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class JsonlLogger(MetricsLogger):
    name = "jsonl"

    def __init__(self, path: str):
        self._file = open(path, "a")

    def log(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardLogger(MetricsLogger):
    name = "tensorboard"

    def __init__(self, log_dir: str):
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir)

    def log(self, record: dict) -> None:
        if "step" in record:
            for key, value in scalars(record).items():
                self._writer.add_scalar(key, value, record["step"], walltime=record["time"])

    def close(self) -> None:
        self._writer.close()


class WandbLogger(MetricsLogger):
    """A W&B run in ``<out_dir>/wandb``; ``$WANDB_MODE`` (online, offline, disabled) applies.

    Each kind gets its own step axis (``kind/step``): W&B drops a record whose global step is
    lower than one already logged, and evaluations of step s arrive after training step s+k."""

    name = "wandb"

    def __init__(self, out_dir: str, project: Optional[str], run_name: str,
                 run_config: Optional[dict]):
        wandb = _require("wandb")
        project = project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
        try:
            self._run = wandb.init(project=project, name=run_name, dir=out_dir,
                                   config=run_config, reinit="create_new")
        except Exception as exc:  # noqa: BLE001 - say what to do, not only what W&B said
            raise LoggerUnavailable(
                f"LMC-E107: trainer.loggers has wandb, but W&B could not start a run in project "
                f"{project!r}: {exc}; log in (wandb login, or WANDB_API_KEY) or run without a "
                "network with WANDB_MODE=offline (wandb sync uploads it later)") from exc
        self._kinds: set = set()

    def log(self, record: dict) -> None:
        if "step" not in record:
            return
        kind = record["kind"]
        if kind not in self._kinds:
            self._run.define_metric(f"{kind}/step")
            self._run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")
            self._kinds.add(kind)
        self._run.log({f"{kind}/step": record["step"], **scalars(record)})

    def close(self) -> None:
        self._run.finish()


class MlflowLogger(MetricsLogger):
    """An MLflow run named after the run; the whole run config is logged as its params."""

    name = "mlflow"

    def __init__(self, tracking_uri: str, experiment: str, run_name: str,
                 run_config: Optional[dict]):
        _require("mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if tracking_uri.startswith("file:") or "://" not in tracking_uri:
            # MLflow 3 refuses its file store unless opted in; the file store is our default,
            # a run's own record on its own disk. An explicit MLFLOW_ALLOW_FILE_STORE wins.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            self._client = MlflowClient(tracking_uri)
            found = self._client.get_experiment_by_name(experiment)
            experiment_id = (found.experiment_id if found is not None
                             else self._client.create_experiment(experiment))
            self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in _flatten(run_config or {}).items()]
            for start in range(0, len(params), 100):  # MLflow takes 100 params per batch
                self._client.log_batch(self.run_id, params=params[start:start + 100])
        except Exception as exc:  # noqa: BLE001 - say where, not only what MLflow said
            raise LoggerUnavailable(
                f"LMC-E107: trainer.loggers has mlflow, but MLflow could not start a run in "
                f"experiment {experiment!r} at {tracking_uri}: {exc}; check "
                "trainer.mlflow_tracking_uri (or $MLFLOW_TRACKING_URI)") from exc

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        if "step" not in record:
            return
        millis = int(record["time"] * 1000)
        metrics = [Metric(key, value, millis, int(record["step"]))
                   for key, value in scalars(record).items()]
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id, "FINISHED")


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class OffThreadLogger(MetricsLogger):
    """Runs a backend on a thread of its own, so that a slow or unreachable tracking server
    delays that backend, never the controller's event loop. At most ``max_pending`` records
    wait; past that, records are dropped for this backend (reported once)."""

    def __init__(self, backend: MetricsLogger, max_pending: int = 10000,
                 close_timeout_s: float = 120.0):
        self.backend = backend
        self.name = backend.name
        self._queue: "queue.Queue[Optional[dict]]" = queue.Queue(max_pending)
        self._close_timeout_s = close_timeout_s
        self._dropped = 0
        self._thread = threading.Thread(target=self._drain, name=f"metrics-{self.name}",
                                        daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                call_quietly(self.backend, "close")
                return
            call_quietly(self.backend, "log", record)

    def log(self, record: dict) -> None:
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                logger.warning("metrics logger %s is %d records behind; dropping records for "
                               "it (metrics.jsonl keeps them all)", self.name,
                               self._queue.maxsize)

    def close(self) -> None:
        try:
            self._queue.put(None, timeout=self._close_timeout_s)
        except queue.Full:
            logger.warning("metrics logger %s did not catch up within %.0f s at close",
                           self.name, self._close_timeout_s)
            return
        self._thread.join(self._close_timeout_s)
        if self._thread.is_alive():
            logger.warning("metrics logger %s did not finish within %.0f s at close; its last "
                           "records may be missing", self.name, self._close_timeout_s)


def build_loggers(names: Sequence[str], out_dir: str, run_name: str,
                  wandb_project: Optional[str] = None, mlflow_tracking_uri: Optional[str] = None,
                  mlflow_experiment: Optional[str] = None,
                  run_config: Optional[dict] = None) -> List[MetricsLogger]:
    """Start the backends named in ``names``; raise ``LoggerUnavailable``/``ValueError`` (and
    close what had started) if one cannot start."""
    problems = logger_problems(names)
    if problems:
        raise ValueError("; ".join(problems))
    built: List[MetricsLogger] = []
    try:
        for name in names:
            if name == "jsonl":
                built.append(JsonlLogger(os.path.join(out_dir, "metrics.jsonl")))
            elif name == "tensorboard":
                built.append(TensorBoardLogger(os.path.join(out_dir, "tensorboard")))
            elif name == "wandb":
                built.append(OffThreadLogger(WandbLogger(out_dir, wandb_project, run_name,
                                                         run_config)))
            elif name == "mlflow":
                uri = (mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
                       or Path(out_dir, "mlruns").resolve().as_uri())
                experiment = (mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")
                              or DEFAULT_PROJECT)
                built.append(OffThreadLogger(MlflowLogger(uri, experiment, run_name, run_config)))
    except BaseException:
        for backend in built:
            call_quietly(backend, "close")
        raise
    return built
