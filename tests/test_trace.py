"""The trajectory trace (data/trace.py) and its reader (python -m laminar_mcore.tools.trace):
the records of a known small run give exact figures, the timeline is drawn, a line cut by a
crash is skipped, and bad input is a clear error."""

import json
import subprocess
import sys

import pytest

from laminar_mcore.data.trace import TrajectoryTrace, read_trace, trace_record
from laminar_mcore.data.trajectory import Trajectory
from laminar_mcore.tools.trace import main as trace_tool, percentile


def _traj(uid, n, version, segments, timings, repacks=0):
    t = Trajectory([1, 2, 3], [7] * n, [-0.1] * n, version, uid.split("-")[0], reward=1.0,
                   uid=uid, timings=timings,
                   metadata={"segments": segments, **({"repacks": repacks} if repacks else {})})
    t.add_version_spans(None, 0, n, str(version))
    return t


def _run(tmp_path):
    """Ten consumed trajectories (lengths 1..9 and one long tail of 100, repacked from e0 to
    e1) and one discarded; trainer at version 2."""
    trace = TrajectoryTrace(str(tmp_path))
    t0 = 1000.0
    batch = []
    for k in range(10):
        n = 100 if k == 9 else k + 1
        version = 1 if k < 5 else 2
        seg = [{"engine": f"e{k % 2}", "version": version, "how": "new", "start": t0 + k,
                "end": t0 + k + n / 10, "tokens": n}]
        repacks = 0
        if k == 9:  # the long tail: half on e1, then repacked onto e0
            seg = [dict(seg[0], engine="e1", end=t0 + 14, tokens=50),
                   {"engine": "e0", "version": 2, "how": "repack", "start": t0 + 14,
                    "end": t0 + 19, "tokens": 50}]
            repacks = 1
        end = seg[-1]["end"]
        batch.append(_traj(f"g{k}-0", n, version, seg,
                           {"submitted": t0 + k - 0.5, "first_token": t0 + k + 0.01,
                            "finished": end, "rewarded": end + 0.5, "consumed": end + 1.5},
                           repacks))
    trace.consumed(batch, trainer_version=2)
    trace.discarded([_traj("gx-0", 3, 1, [], {"submitted": t0})], "reward_error", 2)
    trace.close()
    trace.consumed(batch[:1], trainer_version=2)  # after close: dropped, never raises
    return trace


def test_the_story_of_a_known_run_has_exact_figures_and_a_timeline(tmp_path, capsys):
    trace = _run(tmp_path)
    assert trace.written == 11
    records = read_trace(str(tmp_path))
    assert [r["id"] for r in records][:2] == ["g0-0", "g1-0"] and len(records) == 11
    tail = records[9]
    assert tail["engines"] == ["e1", "e0"] and tail["repacks"] == 1
    assert tail["versions"] == ["2"] and tail["staleness"] == 0 and tail["version"] == 2
    assert records[0]["staleness"] == 1 and records[10]["discard_reason"] == "reward_error"
    assert records[10]["staleness"] is None

    f = trace_tool([str(tmp_path), "--json", str(tmp_path / "story.json")])
    assert json.loads((tmp_path / "story.json").read_text()) == f
    assert (f["trajectories"], f["consumed"], f["discarded"], f["discarded_reward_error"]) == (
        11, 10, 1, 1)
    assert (f["length_p50"], f["length_p90"], f["length_p99"], f["length_p100"]) == (
        5, 9, 100, 100)
    assert (f["repacked"], f["repacks"], f["resumed"], f["mixed_versions"]) == (1, 1, 0, 0)
    assert (f["staleness_0"], f["staleness_1"]) == (5, 5)
    assert f["buffered_s_p50"] == 1.0 and f["rewarding_s_total"] == 5.0
    assert f["queued_s_p50"] == pytest.approx(0.51)
    out = capsys.readouterr().out
    assert "p99 100" in out and "repacked: 1 trajectories" in out
    assert "g9-0: 100 tokens" in out and "e1 -> e0" in out  # the slowest, and where it ran
    png = tmp_path / "timeline.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_run_continues_the_trace_after_a_crash_and_a_fresh_run_starts_anew(tmp_path):
    """A crash cuts the last line short: a resumed run's records start on a line of their own,
    the cut one is skipped with a warning, and a trajectory buffered at the stop and consumed
    after the resume counts once, as consumed. A fresh run of the same name starts anew."""
    _run(tmp_path)
    path = tmp_path / "trajectories.jsonl"
    first = _traj("g10-0", 4, 2, [], {"submitted": 1.0})
    trace = TrajectoryTrace(str(tmp_path), resume=True)
    trace.left_over([first], [_traj("g11-0", 2, 2, [], {})], trainer_version=2)
    trace.close()
    path.write_text(path.read_text() + '{"id": "cut')  # the process died mid-line
    resumed = TrajectoryTrace(str(tmp_path), resume=True)
    resumed.consumed([first], trainer_version=3)
    resumed.close()
    records = {r["id"]: r for r in read_trace(str(tmp_path))}
    assert len(records) == 13 and records["g10-0"]["outcome"] == "consumed"
    assert records["g10-0"]["staleness"] == 1 and records["g11-0"]["outcome"] == "in_flight"
    f = trace_tool([str(tmp_path)])
    assert (f["trajectories"], f["consumed"], f["buffered"], f["in_flight"]) == (13, 11, 0, 1)

    fresh = TrajectoryTrace(str(tmp_path))  # a new run, not a resume: the old trace goes
    fresh.discarded([_traj("g0-0", 1, 0, [], {})], "aborted")
    fresh.close()
    assert [r["outcome"] for r in read_trace(str(path))] == ["discarded"]


def test_bad_input_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "laminar_mcore.tools.trace",
                          str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert out.returncode != 0 and "no trajectory trace here" in out.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "trajectories.jsonl").write_text("")
    with pytest.raises(SystemExit, match="holds no trajectories yet"):
        trace_tool([str(tmp_path / "empty")])


def test_percentile_is_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3, 1, 2], 50) == 2 and percentile([3, 1, 2], 100) == 3
    assert percentile(list(range(1, 101)), 99) == 99 and percentile([5], 1) == 5


def test_a_record_is_json_and_names_the_engines_in_order():
    t = _traj("g-0", 2, 3, [{"engine": "a", "version": 3, "start": 1, "end": 2},
                            {"engine": "a", "version": 3, "start": 2, "end": 3},
                            {"engine": "b", "version": 3, "start": 3, "end": 4}], {})
    r = json.loads(json.dumps(trace_record(t, "consumed", trainer_version=5)))
    assert r["engines"] == ["a", "b"] and r["staleness"] == 2 and r["discard_reason"] is None
