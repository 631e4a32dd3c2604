"""The controller's data module and the reward service."""

import asyncio
import time
import json
import threading

import pytest

from laminar_mcore.data import Trajectory
from laminar_mcore.data.pools import (ExperienceBuffer, InFlight, PartialResponsePool,
                                      PromptPool, load_prompts)
from laminar_mcore.reward import RewardService, load_reward_fn


def _traj(group, k, reward=1.0):
    return Trajectory(prompt_ids=[1], response_ids=[2], behav_logprobs=[-0.1], weight_version=0,
                      group_id=group, reward=reward, uid=f"{group}-{k}")


def test_prompt_pool_groups_epochs_and_exact_resume(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(5)))
    rows = load_prompts([str(path)])
    pool = PromptPool(rows, n_samples=4, seed=7)
    first_epoch = [pool.next_group() for _ in range(5)]
    assert sorted(g.index for g in first_epoch) == list(range(5)) and all(g.n == 4 for g in first_epoch)
    state = pool.state_dict()
    after = [pool.next_group().index for _ in range(7)]
    assert pool.epoch == 2
    resumed = PromptPool(rows, n_samples=4, seed=7)
    resumed.load_state_dict(state)
    assert [resumed.next_group().index for _ in range(7)] == after
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="no 'prompt' field"):
        load_prompts([str(bad)])
    bad.write_text("{oops\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not JSON"):
        load_prompts([str(bad)])
    # a dataset's own field names (data.prompt_key, data.answer_key): rewards read "answer"
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    rows = load_prompts([str(gsm)], "question", "solution")
    assert rows == [{"question": "1+1?", "solution": "2", "answer": "2"}]
    with pytest.raises(ValueError, match="no 'label' field; set data.answer_key"):
        load_prompts([str(gsm)], "question", "label")


def test_experience_buffer_hands_out_complete_groups_fifo_and_counts_everything():
    buf = ExperienceBuffer(group_size=2, max_groups=2)
    for g in ("a", "b", "c"):
        buf.add(_traj(g, 0))
    assert buf.ready_groups == 0 and buf.buffered == 3
    for g in ("a", "b", "c"):
        buf.add(_traj(g, 1))
    assert buf.discarded == {"evicted": 2}  # "a" was the stalest beyond max_groups
    batch = buf.take(1, timeout=0.1)
    assert [t.group_id for t in batch] == ["b", "b"]
    assert buf.take(2, timeout=0.05) is None
    buf.add(_traj("d", 0))
    assert buf.drop_group("d", "member_failed") == 1
    generated = 8 - 1  # seven trajectories were added in all
    assert buf.consumed + buf.buffered + sum(buf.discarded.values()) == generated
    state = buf.state_dict()
    other = ExperienceBuffer(group_size=2)
    other.load_state_dict(state)
    assert [t.uid for t in other.take(1, timeout=0.1)] == ["c-0", "c-1"]


def test_experience_buffer_take_blocks_until_a_group_completes():
    buf = ExperienceBuffer(group_size=2)
    got = []
    t = threading.Thread(target=lambda: got.append(buf.take(1, timeout=5)))
    t.start()
    buf.add(_traj("x", 0))
    buf.add(_traj("x", 1))
    t.join()
    assert [tr.uid for tr in got[0]] == ["x-0", "x-1"]


def _in_flight(rid, engine, version=3, **kw):
    return InFlight(Trajectory([1, 2], [], [], version, "g", uid=rid), engine, **kw)


def test_partial_pool_tracks_tokens_per_engine():
    pool = PartialResponsePool()
    pool.start(_in_flight("r1", "e0"))
    pool.start(_in_flight("r2", "e1"))
    pool.append("r1", [5], [-0.1])
    pool.append("r1", [6], [-0.2])
    with pytest.raises(ValueError, match="1 tokens but 2 log-probs"):
        pool.append("r1", [7], [-0.1, -0.2])
    assert [p.rid for p in pool.on_engine("e0")] == ["r1"]
    done = pool.finish("r1").traj  # the trajectory itself grew: nothing to rename at the end
    assert done.response_ids == [5, 6] and done.behav_logprobs == [-0.1, -0.2] and len(pool) == 1
    with pytest.raises(ValueError, match="already in flight"):
        pool.start(_in_flight("r2", "e0"))


def test_reward_service_scores_in_a_process_pool_and_reports_failures():
    assert load_reward_fn("laminar_mcore.reward.builtin:exact_match")("42", "42") == 1.0
    with pytest.raises(ValueError, match="cannot load reward function"):
        load_reward_fn("laminar_mcore.reward.builtin:nope")

    async def go():
        service = RewardService("laminar_mcore.reward.builtin:math_verify_reward", workers=1)
        try:
            return await asyncio.gather(
                service.score("The answer is $\\frac{1}{2}$", "0.5"),
                service.score("so we get 7", "8"),
                service.score("\\boxed{12}", "12"))
        finally:
            service.close()

    results = asyncio.run(go())
    assert [r for r, _ in results] == [1.0, 0.0, 1.0]

    async def failing():
        service = RewardService("laminar_mcore.data.tasks:decode", workers=1)  # wrong signature
        try:
            return await service.score("1", "1")
        finally:
            service.close()

    reward, error = asyncio.run(failing())
    assert reward is None and "TypeError" in error


def test_a_dead_or_stuck_reward_worker_costs_only_its_own_trajectory():
    """A verifier that kills its worker, or hangs, fails only the response it was scoring: the
    pool is rebuilt, calls that shared the dead pool are retried and scored, later calls work,
    and closing the service leaves no worker behind."""
    import psutil

    async def go():
        service = RewardService("tests.workers.rewards:flaky", workers=2, timeout_s=4.0)
        try:
            first = await asyncio.gather(
                service.score("slow", "slow"), service.score("die", "x"),
                service.score("slow", "other"), service.score("hang", "x"),
                service.score("ok", "ok"))
            later = await asyncio.gather(*(service.score(str(i), str(i % 2)) for i in range(4)))
            unpicklable = await service.score("1", "1", {"f": lambda: 0})
            return first, later, service.restarts, unpicklable
        finally:
            service.close()

    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    first, later, restarts, unpicklable = asyncio.run(go())
    rewards = [r for r, _ in first]
    assert rewards[0] == 1.0 and rewards[2] == 0.0 and rewards[4] == 1.0, first
    assert rewards[1] is None and "died 2 times" in first[1][1]
    assert rewards[3] is None and "TimeoutError" in first[3][1] and "reward_timeout_s" in first[3][1]
    assert [r for r, _ in later] == [1.0, 1.0, 0.0, 0.0]  # the service still works
    assert restarts == 3  # two deaths of the crashing call, one stuck call
    assert unpicklable[0] is None and "pickle" in unpicklable[1].lower()
    time.sleep(0.5)
    left = {p.pid for p in psutil.Process().children(recursive=True)} - children_before
    def worker(pid):  # (not multiprocessing's resource tracker, which the first spawn starts)
        try:
            proc = psutil.Process(pid)
            return proc.status() != psutil.STATUS_ZOMBIE and \
                "resource_tracker" not in " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            return False

    assert not [p for p in left if worker(p)], "reward workers left behind"


def test_partial_pool_state_is_json_ready():
    pool = PartialResponsePool()
    item = _in_flight("r1", "e0", ignore_eos=True)
    pool.start(item)
    pool.append("r1", [4], [-0.5])
    item.traj.add_version_spans([{"version": "3", "start": 0, "end": 1}], 0, 1, "3")
    state = json.loads(json.dumps(pool.state_dict()))
    assert state[0]["traj"]["response_ids"] == [4] and state[0]["ignore_eos"] is True
    assert Trajectory.from_dict(state[0]["traj"]).version_spans == [
        {"version": "3", "start": 0, "end": 1}]


def test_version_spans_of_a_resumed_trajectory_cover_its_tokens_once():
    """A trajectory resumed (or repacked) on another engine gets one request's spans per
    request, offset to whole-response positions; spans of one version merge."""
    t = Trajectory([1], [], [], 2, "g")
    t.add_version_spans([{"version": "2", "start": 0, "end": 5}], 0, 5, "2")
    t.add_version_spans([{"version": "2", "start": 0, "end": 3}], 5, 3, "2")
    t.add_version_spans(None, 8, 2, "2")  # an engine that reports no spans
    assert t.version_spans == [{"version": "2", "start": 0, "end": 10}]
    t.add_version_spans([{"version": "3", "start": 0, "end": 1}], 10, 1, "3")
    assert t.versions_seen() == ["2", "3"]


def _manager(prompts, partial, buffer, mode="laminar", eta=None, version=lambda: 0, batch=None):
    from laminar_mcore.config.schema import RolloutConfig
    from laminar_mcore.controller.episode import SingleTurn, TaskCodec
    from laminar_mcore.controller.manager import RolloutData, RolloutManager
    from laminar_mcore.modes import policy_for

    episode = SingleTurn(TaskCodec(lambda row: [1], lambda ids: ""), {}, None)
    return RolloutManager([], RolloutData(prompts, partial, buffer), episode,
                          policy_for(mode, eta), RolloutConfig(), trainer_version=version,
                          batch_trajectories=batch or prompts.n_samples)


def test_a_dropped_group_gives_its_admission_capacity_back():
    """AReaL's budget: a group that lost a member can never be trained on, so its capacity
    returns -- in mode=sync (bound 0) one reward error must not leave the trainer waiting for
    a group that cannot come -- and its members that finish later are discarded, not held."""
    buffer = ExperienceBuffer(group_size=2)
    prompts = PromptPool([{"prompt": "a", "answer": "a"}] * 4, n_samples=2)
    manager = _manager(prompts, PartialResponsePool(), buffer, mode="sync")
    manager.accepted = 2  # one group of two admitted: the sync bound (0 + 0 + 1) * 2 is full
    assert not manager.can_admit(2)
    buffer.add(_traj("g0", 0))
    manager._discard("g0", 1, "reward_error")  # its second member's reward failed
    assert manager.can_admit(2) and manager.accepted == 0
    assert buffer.add(_traj("g0", 1)) is False  # a late member of the dropped group
    manager._discard("g0", 1, "aborted")  # a second loss in the same group gives nothing more
    assert manager.accepted == 0
    assert buffer.buffered == 0
    assert buffer.discarded == {"reward_error": 1, "reward_error_group": 2, "aborted": 1}


def _versioned(group, k, version):
    t = _traj(group, k)
    t.weight_version = version
    return t


@pytest.mark.parametrize("mode", ["laminar", "areal"])
def test_laminar_eta_bounds_the_staleness_trained_on(mode):
    """mode=laminar, algo.max_staleness=1: once the trainer is at version v, nothing generated
    by a version before v - 1 is ever handed to it -- groups held (complete or not) are
    discarded as "stale" with their later members, each gives its admission capacity back --
    and an engine whose version would be more than 1 behind when its work is trained on
    (counting the full batches already waiting) starts none. mode=areal keeps AReaL's eta: it
    gates submission only."""
    from laminar_mcore.controller.engines import EngineHandle

    version = [0]
    buffer = ExperienceBuffer(group_size=2)
    prompts = PromptPool([{"prompt": "a", "answer": "a"}] * 4, n_samples=2)
    manager = _manager(prompts, PartialResponsePool(), buffer, mode=mode, eta=1,
                       version=lambda: version[0], batch=4)  # a batch: two groups
    manager.accepted = 8
    for g, v in (("old", 0), ("old2", 0), ("new", 1)):
        buffer.add(_versioned(g, 0, v))
        buffer.add(_versioned(g, 1, v))
    buffer.add(_versioned("open", 0, 0))  # its second member still generating
    engine = EngineHandle("e0", None, None, None, capacity=8)
    engine.version = 1
    assert manager.fresh_enough(engine)  # trained at version >= 1 (one batch waits): 0 behind
    version[0] = 2  # the trainer took a step
    dropped = manager.drop_stale()
    if mode == "areal":
        assert dropped == 0 and buffer.discarded == {} and manager.accepted == 8
        assert [t.group_id for t in buffer.take(2, 0)] == ["old", "old", "old2", "old2"]
        return
    assert dropped == 3 and manager.accepted == 8 - 3 * 2  # three groups' capacity came back
    assert buffer.discarded == {"stale": 5} and buffer.buffered == 2
    assert buffer.add(_versioned("open", 1, 0)) is False  # the late member of a stale group
    assert buffer.add(_versioned("late", 0, 0)) is False  # a version-0 group finishing now
    assert buffer.discarded == {"stale": 7} and manager.accepted == 8 - 4 * 2
    assert [t.weight_version for t in buffer.take(1, 0)] == [1, 1]  # 1 behind: trained on
    # version 2 with a full batch waiting: work started now is trained at version 3 at best
    assert manager.fresh_enough(engine)  # 1 >= 2 + 0 - 1: nothing waits
    buffer.add(_versioned("n1", 0, 2)), buffer.add(_versioned("n1", 1, 2))
    buffer.add(_versioned("n2", 0, 2)), buffer.add(_versioned("n2", 1, 2))
    assert not manager.fresh_enough(engine)  # 1 < 2 + 1 - 1: it pulls (or waits) first
    engine.version = 2
    assert manager.fresh_enough(engine)
    generated = 13  # trajectories added in all
    assert buffer.consumed + buffer.buffered + sum(buffer.discarded.values()) == generated


def test_background_tasks_are_supervised():
    """A trajectory task that fails unexpectedly is discarded with a reason (its group dropped,
    the books still balanced), never left in flight; a failing manager-wide task (the relay
    watcher) stops the run loudly instead of ending silently."""
    from laminar_mcore.controller.manager import EngineHandle
    from laminar_mcore.relay.client import RelayClient
    from laminar_mcore.relay.transports import PullSpec, make_puller
    from laminar_mcore.rollout.client import SGLangClient

    async def go():
        buffer, partial = ExperienceBuffer(group_size=2), PartialResponsePool()
        manager = _manager(PromptPool([{"prompt": "a"}], n_samples=2), partial, buffer)
        engine = EngineHandle("e0", SGLangClient("http://127.0.0.1:9"),
                              RelayClient("http://127.0.0.1:9", "t"), make_puller(PullSpec()))
        manager.engines.append(engine)
        item = InFlight(Trajectory([1], [], [], 0, "g0", uid="g0-0"), "e0", max_new_tokens=4)
        partial.start(item)
        engine.in_flight[item.rid] = item

        async def broken():
            raise KeyError("finish_reason")

        manager._spawn(broken(), "trajectory g0-0", manager._trajectory_failed(item))
        await asyncio.sleep(0.05)
        assert not engine.in_flight and len(partial) == 0
        assert buffer.discarded == {"internal_error": 1} and buffer.is_dropped("g0")
        assert manager.stats.generated == 1  # generated = consumed + buffered + discarded

        async def watcher():
            raise ValueError("relay answered nonsense")

        run = asyncio.ensure_future(manager.run())
        await asyncio.sleep(0.05)
        manager._spawn(watcher(), "relay watcher", manager._fatal)
        with pytest.raises(RuntimeError, match="rollout manager stopped: relay answered nonsense"):
            await asyncio.wait_for(run, 5)
        await engine.client.close()
        await engine.relay.close()

    asyncio.run(go())
