"""The train job end to end on CPU: relay, engines, controller and trainer world as real
processes; a few steps in laminar and sync modes; books balance; outputs are written."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.mark.parametrize("mode", ["laminar", "sync"])
def test_train_job_runs_and_keeps_the_books(tmp_path, mode):
    out = subprocess.run(
        [sys.executable, "-m", "laminar_mcore.launch", f"mode={mode}", "output_dir=out",
         "run_name=e2e", "trainer.total_steps=3", "trainer.train_batch_prompts=4",
         "data.num_eval=16", "data.warmup_steps=20", "rollout.num_engines=2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "e2e" / "summary.json").read_text())
    keys = {"initial_accuracy", "final_accuracy", "trajectories_generated", "trajectories_consumed",
            "trajectories_buffered", "trajectories_discarded", "max_staleness_observed", "wall_seconds"}
    assert keys <= set(summary)
    assert summary["books_balance"] and summary["steps"] == 3 and summary["final_version"] == 3
    assert summary["trajectories_consumed"] == 3 * 4 * 8
    assert summary["trajectories_generated"] == (summary["trajectories_consumed"]
                                                 + summary["trajectories_buffered"]
                                                 + summary["trajectories_discarded"])
    if mode == "sync":
        assert summary["max_staleness_observed"] == 0  # generate, train, sync: never stale
    records = [json.loads(l) for l in (tmp_path / "out" / "e2e" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert (tmp_path / "out" / "e2e" / "summary.png").exists()
    assert any((tmp_path / "out" / "e2e" / "tensorboard").iterdir())


def test_train_job_resumes_with_its_data_module(tmp_path):
    def run(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "laminar_mcore.launch", "output_dir=out", "run_name=resume",
             "trainer.train_batch_prompts=4", "data.num_eval=16", "data.warmup_steps=20",
             "trainer.save_interval=2", *extra],
            cwd=tmp_path, capture_output=True, text=True, timeout=600,
            env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        return out, json.loads((tmp_path / "out" / "resume" / "summary.json").read_text())

    _, first = run("trainer.total_steps=2")
    ckpt = tmp_path / "out" / "resume" / "checkpoints" / "step_00000002"
    state = json.loads((ckpt / "extra_state.json").read_text())
    assert state["prompt_pool"]["issued"] > 0 and state["trainer_version"] == 2
    out, second = run("trainer.total_steps=4", "trainer.resume=auto")
    assert "resuming from" in out.stdout
    assert second["steps"] == 4 and second["final_version"] == 4
    assert second["trajectories_consumed"] == 4 * 4 * 8  # two steps before the restart, two after
    assert second["books_balance"]
