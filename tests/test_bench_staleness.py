"""bench.staleness and its knob, weight_sync.publish_lag: a lagged run publishes the weights of
step v - lag at step v (and the final weights at the end), its trajectories are that stale, the
final evaluation sees the final weights; the benchmark's figures; the knob's config errors."""

import json
import os
import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from laminar_mcore.config import ConfigError, register_configs, validate_config
from laminar_mcore.config.paths import conf_dir

register_configs()


def _compose(*overrides):
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_lagged_run_publishes_old_weights_and_ends_on_the_final_ones(tmp_path):
    steps, lag = 6, 2
    out = subprocess.run(
        [sys.executable, "-m", "laminar_mcore.launch", "experiment=cpu_reverse", "mode=laminar",
         "output_dir=out", "run_name=lag", f"trainer.total_steps={steps}",
         "trainer.train_batch_prompts=2", "algo.n_samples_per_prompt=4", "data.num_eval=8",
         "data.warmup_steps=20", "rollout.num_engines=1", "trainer.eval_interval=2",
         "algo.max_staleness=null", f"weight_sync.publish_lag={lag}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    run = tmp_path / "out" / "lag"
    # the master relay received version v - 2 at step v (none before step 3), then the final one
    relay_log = next((run / "logs").glob("relay-*.log")).read_text()
    published = [int(v) for v in re.findall(r"version (\d+) complete", relay_log)]
    assert published == list(range(1, steps - lag + 1)) + [steps], published
    # so the batch of step v (trainer version v - 1) holds nothing newer than version v - 1 - 2
    from laminar_mcore.data.trace import read_trace

    consumed = [r for r in read_trace(str(run)) if r["outcome"] == "consumed"]
    assert len(consumed) == steps * 2 * 4
    for r in consumed:
        assert r["staleness"] >= min(r["trainer_version"], lag), r
        assert r["version"] <= max(r["trainer_version"] - lag, 0), r
    # the final evaluation ran on the final weights, which the engines got unlagged
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_version"] == summary["final_engine_version"] == steps
    assert summary["evals"][-1]["step"] == steps and summary["evals"][-1]["version"] == steps
    assert summary["books_balance"]
    assert summary["max_staleness_observed"] >= lag


def test_staleness_figures_from_synthetic_summaries():
    from laminar_mcore.bench.staleness import figures_from, run_name

    def summary(acc, mean, top):
        return {"initial_accuracy": 0.4, "final_accuracy": acc, "final_accuracy_greedy": acc + 0.1,
                "max_staleness_observed": top, "mean_staleness": mean, "max_staleness": top,
                "wall_seconds": 60.0}

    results = {run_name(0, True): summary(0.72, 0.9, 2), run_name(0, False): summary(0.70, 1.0, 2),
               run_name(32, True): summary(0.60, 33.5, 36),
               run_name(32, False): summary(0.45, 33.2, 35)}
    assert set(results) == {"eta0", "eta0_coupled", "eta32", "eta32_coupled"}
    f = figures_from(results, [0, 32])
    assert f["initial_accuracy"] == 0.4
    assert f["accuracy_eta_0"] == 0.72 and f["accuracy_eta_0_coupled"] == 0.70
    assert f["accuracy_eta_32"] == 0.60 and f["accuracy_eta_32_coupled"] == 0.45
    assert f["decoupled_gain_at_eta_32"] == pytest.approx(0.15)
    assert f["decoupled_gain_at_eta_0"] == pytest.approx(0.02)
    assert f["mean_staleness_eta_32"] == 33.5 and f["max_staleness_eta_32_coupled"] == 35
    assert f["accuracy_greedy_eta_0"] == pytest.approx(0.82)
    # 32 not run: the headline is null; a missing run gives nulls, not an error
    partial = figures_from({"eta2": summary(0.7, 2.5, 4)}, [2])
    assert partial["decoupled_gain_at_eta_32"] is None
    assert partial["accuracy_eta_2_coupled"] is None and partial["decoupled_gain_at_eta_2"] is None
    json.dumps(f)  # one flat, JSON-serialisable object


def test_observed_staleness_reads_the_consumed_trajectories_of_the_trace(tmp_path):
    from laminar_mcore.bench.staleness import observed_staleness

    records = [{"id": "a", "outcome": "consumed", "staleness": 2},
               {"id": "b", "outcome": "consumed", "staleness": 5},
               {"id": "c", "outcome": "discarded", "staleness": None},
               {"id": "d", "outcome": "buffered", "staleness": None}]
    (tmp_path / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert observed_staleness(str(tmp_path)) == {"mean_staleness": 3.5, "max_staleness": 5}
    with pytest.raises(FileNotFoundError, match="no trajectory trace"):
        observed_staleness(str(tmp_path / "no_run"))


def test_publish_lag_config_errors_name_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"weight_sync.publish_lag=-1 must be >= 0"):
        validate_config(_compose("weight_sync.publish_lag=-1"))
    # the demo bounds staleness at 4: a lag of 8 cannot meet it
    with pytest.raises(ConfigError, match=r"publish_lag=8 > algo.max_staleness=4.*"
                                          r"algo.max_staleness=null"):
        validate_config(_compose("experiment=cpu_demo", "weight_sync.publish_lag=8"))
    with pytest.raises(ConfigError, match=r"publish_lag=2 with mode=sync.*mode=laminar"):
        validate_config(_compose("weight_sync.publish_lag=2", "mode=sync"))
    validate_config(_compose("experiment=cpu_demo", "weight_sync.publish_lag=8",
                             "algo.max_staleness=null"))
    validate_config(_compose("experiment=cpu_demo", "weight_sync.publish_lag=2"))
