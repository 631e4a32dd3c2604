"""The controller role: the run's data, its evaluations, the books and the summary.

``run(cfg, token)`` is the controller of a multi-node run (``job=controller``): it waits for
rollout nodes to register, evaluates, serves the trainer until it reports ``/done``, then
evaluates again and writes ``summary.json``. The single-machine launcher (launch/train.py)
composes the same pieces around one process.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from dataclasses import asdict
from typing import Optional

from ..config.budgets import join_timeout_s
from ..config.schema import LaminarConfig
from ..errors import within
from ..netutil import engine_api_key
from .client import ControllerError
from .episode import TaskCodec, episode_plugin
from .evaluation import EvalResult, evaluate
from .server import Controller, TaskData


def load_task(cfg: LaminarConfig, out_dir: str, log) -> TaskData:
    """Train and eval rows, codec and the starting model for the configured data and model:
    the run's files and tokenizer, or the built-in synthetic task (whose starting checkpoint a
    short supervised warm-up builds, cached, when ``model.path`` is null)."""
    from ..data import tasks
    from ..data.pools import load_prompts

    d = cfg.data
    if d.train_files:
        from transformers import AutoTokenizer

        if cfg.model.path is None:
            raise ValueError("LMC-E706: data.train_files needs model.path (its tokenizer encodes "
                             "the prompts)")
        tok = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
        rows = load_prompts(list(d.train_files), d.prompt_key, d.answer_key)
        evals = (load_prompts(list(d.eval_files), d.prompt_key, d.answer_key) if d.eval_files
                 else rows[: d.num_eval])
        codec = TaskCodec(encode_prompt=lambda row: tok.encode(row[d.prompt_key]),
                          decode=lambda ids: tok.decode(ids, skip_special_tokens=True))
        chat = None
        if d.agent:
            from ..data.chat import ChatFormat

            chat = ChatFormat(tok)
            codec = _chat_codec(chat, d.prompt_key)
        return TaskData(rows, evals, codec, cfg.model.path, chat=chat)
    if d.task == "tool_addition":
        return _tool_task(cfg, out_dir, log)
    shape = dict(long_digits=d.long_digits, long_fraction=d.long_fraction)
    rows = tasks.make_dataset(d.num_train, d.digits, d.task, seed=cfg.seed, **shape)
    evals = tasks.make_dataset(d.num_eval, d.digits, d.task, seed=cfg.seed + 10_000, **shape)
    data_dir = os.path.join(out_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    tasks.write_dataset(os.path.join(data_dir, "train.jsonl"), rows)
    tasks.write_dataset(os.path.join(data_dir, "eval.jsonl"), evals)
    codec = TaskCodec(encode_prompt=lambda row: tasks.encode(row["prompt"]), decode=tasks.decode)
    model_path = cfg.model.path
    if model_path is None:
        from ..data.warmup import warmup_cache_dir, warmup_checkpoint

        model_path = warmup_checkpoint(warmup_cache_dir(cfg.output_dir), problems=rows,
                                       steps=d.warmup_steps, wrong_fraction=d.warmup_wrong_fraction,
                                       hidden=cfg.model.arch.hidden_size,
                                       layers=cfg.model.arch.num_hidden_layers, seed=cfg.seed,
                                       max_positions=tasks.position_budget(
                                           d.digits, d.task, d.long_digits,
                                           cfg.rollout.sampling.max_new_tokens),
                                       moe=_moe_fields(cfg.model.arch), log=log)
    # exact match accepts only the answer and EOS: an evaluation need not wait for more
    exact = d.reward_fn == "laminar_mcore.reward.builtin:exact_match"
    return TaskData(rows, evals, codec, model_path,
                    eval_max_new_tokens=(lambda row: len(row["answer"]) + 1) if exact else None)


def _chat_codec(chat, prompt_key: str = "prompt") -> TaskCodec:
    """An agent run's placeholder prompt (the row's prompt as the user's message, until the
    agent's first call renders its own) and a turn's text."""
    from ..data.agent_task import TOOLS

    return TaskCodec(encode_prompt=lambda row: chat.prompt(
        [{"role": "user", "content": str(row[prompt_key])}], TOOLS), decode=chat.decode_turn)


def _tool_task(cfg: LaminarConfig, out_dir: str, log) -> TaskData:
    """The agent demo's task (data/agent_task.py): its tokenizer with a chat template, and a
    starting checkpoint warmed up on noisy tool-use demonstrations (cached)."""
    from ..data import tasks
    from ..data.agent_task import tool_demonstrations
    from ..data.chat import ChatFormat, demo_tokenizer

    d = cfg.data
    if not d.agent:
        raise ValueError("LMC-E706: data.task=tool_addition is an agent task: set data.agent (e.g. "
                         "laminar_mcore.agents.builtin:calculator)")
    rows = tasks.make_dataset(d.num_train, d.digits, d.task, seed=cfg.seed)
    evals = tasks.make_dataset(d.num_eval, d.digits, d.task, seed=cfg.seed + 10_000)
    data_dir = os.path.join(out_dir, "data")
    os.makedirs(data_dir, exist_ok=True)
    tasks.write_dataset(os.path.join(data_dir, "train.jsonl"), rows)
    tasks.write_dataset(os.path.join(data_dir, "eval.jsonl"), evals)
    chat = ChatFormat(demo_tokenizer())
    model_path = cfg.model.path
    if model_path is None:
        from ..data.warmup import warmup_cache_dir, warmup_checkpoint

        demos = tool_demonstrations(rows, chat, wrong_fraction=d.warmup_wrong_fraction,
                                    seed=cfg.seed)
        model_path = warmup_checkpoint(
            warmup_cache_dir(cfg.output_dir), problems=rows, steps=d.warmup_steps,
            hidden=cfg.model.arch.hidden_size, layers=cfg.model.arch.num_hidden_layers,
            seed=cfg.seed, max_positions=cfg.rollout.max_episode_tokens, log=log,
            demonstrations=demos, tokenizer=chat.tok)
    return TaskData(rows, evals, _chat_codec(chat), model_path, chat=chat)


def evaluate_engine(cfg: LaminarConfig, task: TaskData, url: str,
                    api_key: Optional[str] = None) -> EvalResult:
    """Sampled and greedy accuracy of the engine at ``url`` on the run's held-out set
    (``api_key``: the run's engines', ``netutil.engine_api_key`` of its token)."""
    return asyncio.run(_evaluate_engine(cfg, task, url, api_key))


async def _evaluate_engine(cfg: LaminarConfig, task: TaskData, url: str,
                           api_key: Optional[str] = None, greedy: bool = True) -> EvalResult:
    """``greedy``: also at temperature 0 (an intermediate evaluation: ``trainer.eval_greedy``;
    an agent plugin evaluates as it does)."""
    plugin = episode_plugin(cfg)
    if plugin is not None:
        return await plugin.evaluate(cfg, task, url, api_key)
    return await evaluate(url, task.evals, task.codec, asdict(cfg.rollout.sampling),
                          cfg.data.reward_fn, api_key=api_key, greedy=greedy,
                          max_new_tokens_fn=task.eval_max_new_tokens)


def resume_state(cfg: LaminarConfig, out_dir: str, log) -> Optional[dict]:
    """The controller's saved state when ``trainer.resume`` picks a checkpoint, else None."""
    from ..data.checkpoints import EXTRA_STATE, resolve_resume

    resume_from = resolve_resume(cfg.trainer.resume, os.path.join(out_dir, "checkpoints"))
    if not resume_from:
        return None
    log(f"[train] resuming from {resume_from}")
    extra = os.path.join(resume_from, EXTRA_STATE)
    if os.path.isfile(extra):
        with open(extra) as f:
            return json.load(f)
    return None


def _engine_pull(planned, handles) -> str:
    """shard, whole or mixed: what the engines applied (``direct``: their own shards,
    ``flattened_bucket``: whole tensors; an engine whose ``/server_info`` turned its shard
    pulls into whole tensors counts as whole), or what the run planned before any pull."""
    loads = _pull_loads(handles)
    if not loads:
        return "shard" if planned else "whole"
    direct, whole = loads.get("direct", 0), sum(n for f, n in loads.items() if f != "direct")
    return "mixed" if direct and whole else "shard" if direct else "whole"


def _pull_loads(handles) -> dict:
    """Versions the engines' pullers applied, by SGLang ``load_format`` (an agent's pulls run
    on its node and are not counted here)."""
    out: dict = {}
    for handle in handles:
        for fmt, n in getattr(handle.puller, "loads", {}).items():
            out[fmt] = out.get(fmt, 0) + n
    return out


def finish_run(controller: Controller, result: dict, initial: EvalResult, t_start: float,
               out_dir: str, log) -> dict:
    """After training: bring the engines in service to the final version, evaluate on the
    first, keep the books and write ``summary.json`` and the plot. Raises if the books do not
    balance."""
    from ..relay.client import RelayError
    from ..relay.striped import relay_client
    from ..relay.transports import pull_latest_into_engine
    from ..rollout.client import EngineError, SGLangClient
    from ..rollout.launcher import engine_pull_spec, engine_transport, shard_pull

    cfg, metrics, task = controller.cfg, controller.metrics, controller.task
    version = result["version"]

    def pick():
        """The first engine in service (after faults, maybe a restarted one); waits a while
        for one that is being restarted."""
        deadline = time.time() + 240
        while True:
            handle = next((e for e in controller.manager.engines if e.healthy), None)
            if handle is not None or time.time() > deadline:
                return handle or controller.manager.engines[0]
            time.sleep(1.0)

    async def final_pull(handle):
        """Bring ``handle``'s engine to the final version through its relay (read again on
        every try: a relay restarted meanwhile has a new URL)."""
        spec = engine_pull_spec(cfg.rollout, int(handle.name.rsplit("engine", 1)[-1]),
                                cfg.weight_sync, task.model_path)  # its slot on its node
        handle.updating = True  # its supervisor does not count a failed check meanwhile
        try:
            async with SGLangClient(handle.client.base_url, api_key=handle.client.api_key) as ec:
                deadline = time.time() + 120
                served = await ec.get_weight_version()  # "default" before any update
                current = int(served) if served.isdigit() else 0
                while current < version and time.time() < deadline:
                    async with relay_client(handle.relay.url, controller.token) as rc:
                        try:
                            pulled = await pull_latest_into_engine(rc, ec, current, spec=spec)
                        except RelayError:  # its relay is being restarted: wait for the new one
                            pulled = None
                            await asyncio.sleep(0.5)
                    current = pulled if pulled is not None else current
                    await asyncio.sleep(0.05)
                return current
        finally:
            handle.updating = False
            handle.busy_until = time.time()

    async def probe(handle):
        """Greedy log-probs of a fixed prompt: engines holding the same weights agree exactly."""
        async with SGLangClient(handle.client.base_url, api_key=handle.client.api_key) as ec:
            out = await ec.generate(task.codec.encode_prompt(task.evals[0]),
                                    {"max_new_tokens": 8, "temperature": 0.0})
            return [round(float(x[0]), 7) for x in out["meta_info"]["output_token_logprobs"]]

    async def bring_all_engines(first):
        """Every other engine in service to the final version (the summary says which it
        holds)."""
        versions, probes = {}, {}
        for h in [e for e in controller.manager.engines if e.healthy and e is not first]:
            try:
                versions[h.name] = await final_pull(h)
                probes[h.name] = await probe(h)
            except Exception as exc:  # noqa: BLE001 - reported, the run's result stands
                versions[h.name] = f"error: {exc}"
        return versions, probes

    utilisation = controller.utilisation()
    controller.finish_evals()
    controller.stop_generation()
    for attempt in range(3):
        # an engine may fail now too: its supervisor restarts it and another one serves
        first = pick()
        try:
            engine_version = asyncio.run(final_pull(first))
            final = evaluate_engine(cfg, task, first.client.base_url, first.client.api_key)
            break
        except EngineError as exc:
            if attempt == 2:
                raise
            log(f"[train] the final evaluation's engine failed ({exc}); trying another")
            time.sleep(2 * cfg.rollout.engine_heartbeat_s + 1.0)
    others, probes = asyncio.run(bring_all_engines(first))
    if probes:
        probes[first.name] = asyncio.run(probe(first))
    offline = None
    if cfg.trainer.eval_offline:  # last: the engines end with snapshots' weights
        offline = evaluate_snapshots(controller, [first] + [
            e for e in controller.manager.engines if e.healthy and e is not first
            and isinstance(others.get(e.name), int)], out_dir, log, result["steps"])
    metrics.log("eval", step=result["steps"], **final.record(),
                wall_s=controller.version_wall_s(final.version))
    books = controller.books()
    summary = {"mode": cfg.mode, "initial_accuracy": initial.accuracy,
               "final_accuracy": final.accuracy,
               "initial_accuracy_greedy": initial.accuracy_greedy,
               "final_accuracy_greedy": final.accuracy_greedy, "final_engine_version": engine_version,
               "steps": result["steps"], "final_version": version, **books,
               "final_engine_versions": {first.name: engine_version, **others},
               "engines_agree": len({json.dumps(p) for p in probes.values()}) <= 1,
               "trajectories_in_flight_at_stop": len(controller.partial), **utilisation,
               "wall_seconds": time.time() - t_start, "model_path": task.model_path,
               "engine_transport": engine_transport(cfg.rollout, cfg.weight_sync),
               # each engine rank its own shard (weight_sync.engine_pull), or every tensor
               "engine_pull": _engine_pull(shard_pull(cfg.rollout, cfg.weight_sync,
                                                      task.model_path, engine_transport(
                                                          cfg.rollout, cfg.weight_sync)),
                                           controller.manager.engines),
               # versions the engines applied, by SGLang load_format (direct: their own shards)
               "engine_pull_loads": _pull_loads(controller.manager.engines)}
    balanced = books["trajectories_generated"] == (books["trajectories_consumed"]
                                                   + books["trajectories_buffered"]
                                                   + books["trajectories_discarded"])
    summary["books_balance"] = balanced
    if offline is not None:  # steps whose snapshot could not be evaluated (see the log)
        summary["eval_snapshots_failed"] = offline["failed"]
    summary["evals"] = sorted(({k: r[k] for k in ("step", "version", "accuracy",
                                                  "accuracy_greedy", "wall_s") if k in r}
                               for r in metrics.records if r["kind"] == "eval"),
                              key=lambda r: r["step"])
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot = metrics.plot()
    log(f"[train] accuracy {initial.accuracy:.3f} -> {final.accuracy:.3f} (greedy "
        f"{initial.accuracy_greedy:.3f} -> {final.accuracy_greedy:.3f}); trajectories generated "
        f"{books['trajectories_generated']}, consumed {books['trajectories_consumed']}, buffered "
        f"{books['trajectories_buffered']}, discarded {books['trajectories_discarded']} "
        f"({'balanced' if balanced else 'NOT BALANCED'}); max staleness "
        f"{books['max_staleness_observed']}; {summary['wall_seconds']:.0f}s. "
        f"Wrote {out_dir}/summary.json, metrics.jsonl, {os.path.basename(plot or '')}")
    if not balanced:
        raise RuntimeError("LMC-E607: trajectory accounting does not balance; see summary.json")
    return summary


def evaluate_snapshots(controller: Controller, handles: list, out_dir: str, log,
                       before_step: int) -> dict:
    """``trainer.eval_offline``: every snapshot the trainer wrote (``weights/snapshots.py``)
    of a step before ``before_step`` (the final evaluation is that step's), loaded from disk
    into one of ``handles``' engines and evaluated as a live evaluation would have been, each
    logged with its version's wall time in training. The engines take the snapshots one at a
    time from a shared queue; an engine that fails one gives it back and leaves (another
    takes it; three tries each). Returns ``{"evaluated": [steps], "failed": [steps]}``."""
    from ..rollout.client import SGLangClient
    from ..weights.snapshots import list_snapshots

    cfg, task = controller.cfg, controller.task
    snapshots = [s for s in list_snapshots(out_dir) if s[0] < before_step]
    t0, done, failed = time.time(), [], []

    busy = [0]  # snapshots being evaluated: one that fails may come back to the queue

    async def worker(handle, queue) -> None:
        url, key = handle.client.base_url, handle.client.api_key
        while True:
            if queue.empty():
                if not busy[0]:
                    return
                await asyncio.sleep(0.05)
                continue
            (step, version, path), tries = queue.get_nowait()
            busy[0] += 1
            try:
                async with SGLangClient(url, api_key=key) as ec:
                    await ec.update_weights_from_disk(path, weight_version=str(version))
                result = await _evaluate_engine(cfg, task, url, key,
                                                greedy=cfg.trainer.eval_greedy)
            except Exception as exc:  # noqa: BLE001 - as a live one, it must not fail the run
                log(f"[train] evaluating the step-{step} snapshot on {handle.name} failed: "
                    f"{exc!r}")
                if tries < 2:
                    queue.put_nowait(((step, version, path), tries + 1))
                else:
                    failed.append(step)
                return
            finally:
                busy[0] -= 1
            controller.metrics.log("eval", step=step, **result.record(),
                                   wall_s=controller.version_wall_s(version), offline=True)
            done.append(step)

    async def all_engines() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        for item in snapshots:
            queue.put_nowait((item, 0))
        await asyncio.gather(*(worker(h, queue) for h in handles))
        while not queue.empty():  # every engine left with these still queued
            failed.append(queue.get_nowait()[0][0])

    for h in handles:  # their supervisors do not count the loads as failed checks
        h.updating = True
    try:
        asyncio.run(all_engines())
    finally:
        for h in handles:
            h.updating = False
            h.busy_until = time.time()
    if snapshots:
        log(f"[train] evaluated {len(done)} of {len(snapshots)} snapshots after training on "
            f"{len(handles)} engine(s) ({time.time() - t0:.0f} s, off the training clock)"
            + (f"; failed: steps {sorted(failed)}" if failed else ""))
    return {"evaluated": sorted(done), "failed": sorted(failed)}


class Progress:
    """A tqdm bar that follows the controller's ``train`` records."""

    def __init__(self, total: int, metrics):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)
        self.metrics = metrics
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self):
        seen = 0
        while not self._stop.wait(0.5):
            records = [r for r in list(self.metrics.records) if r["kind"] == "train"]
            if len(records) > seen:
                last = records[-1]
                self.bar.update(len(records) - seen)
                self.bar.set_postfix(reward=f"{last.get('reward_mean', 0):.2f}",
                                     stale=f"{last.get('staleness_mean', 0):.1f}")
                seen = len(records)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)
        self.bar.close()


def run(cfg: LaminarConfig, token: str) -> dict:
    """The controller of a multi-node run (``job=controller``); see launch/cluster.py."""
    from ..metrics import MetricsWriter

    t_start = time.time()
    out_dir = os.path.join(cfg.output_dir, cfg.run_name)
    os.makedirs(out_dir, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    task = load_task(cfg, out_dir, log)
    metrics = MetricsWriter.for_run(cfg, out_dir)
    controller = None
    try:
        controller = Controller(
            cfg, task, metrics, token, initial_state=resume_state(cfg, out_dir, log),
            listen=(cfg.cluster.controller_addr, int(cfg.cluster.controller_port)),
            info={"model_path": os.path.abspath(task.model_path),
                  "checkpoint_dir": os.path.abspath(os.path.join(out_dir, "checkpoints"))})
        url = controller.start()
        log(f"LAMINAR_CONTROLLER_URL={url}")
        log(f"[controller] mode={cfg.mode}; waiting for {cfg.cluster.rollout_nodes} rollout "
            f"node(s) and the trainer ranks (token in $LAMINAR_RUN_TOKEN)")
        deadline = time.time() + join_timeout_s(cfg)
        while len(controller.rollout_nodes) < cfg.cluster.rollout_nodes or \
                any(m is None for m in controller.master_relays):
            if time.time() > deadline:
                raise ControllerError(f"LMC-E204: only {len(controller.rollout_nodes)} of "
                                      f"{cfg.cluster.rollout_nodes} rollout nodes registered "
                                      f"within cluster.join_timeout_s="
                                      f"{join_timeout_s(cfg):g}")
            time.sleep(0.2)
        first_engine = controller.rollout_nodes[0]["engines"][0]
        initial = evaluate_engine(cfg, task, first_engine, engine_api_key(controller.token))
        metrics.log("eval", step=0, **initial.record(), wall_s=0.0)
        log(f"[controller] {len(controller.rollout_nodes)} rollout node(s), "
            f"{len(controller.manager.engines)} engines; initial accuracy {initial.accuracy:.3f} "
            f"(greedy {initial.accuracy_greedy:.3f})")
        controller.ready = True
        progress = Progress(cfg.trainer.total_steps, metrics)
        try:
            while not controller.trainer_done_event.wait(1.0):
                if controller.error is not None:
                    raise ControllerError(within("controller failed", controller.error, "LMC-E209"))
                lost = controller.silent_trainer_node()
                if lost is not None:  # the survivors learn it from their next report
                    controller.stop_for_trainers(lost)
                    raise ControllerError(lost)
        finally:
            progress.close()
        return finish_run(controller, controller.trainer_done, initial, t_start, out_dir, log)
    finally:
        if controller is not None:
            controller.finished = True
            # rollout nodes poll /health for "done"; give them a moment before the server goes
            # (not after a SIGTERM: a scheduler's grace period is short, and /health says so)
            if not controller.closing:
                time.sleep(min(3.0, cfg.cluster.shutdown_grace_s))
            controller.stop()
        metrics.close()


def _moe_fields(arch) -> dict:
    """The mixture-of-experts fields of ``model.arch`` for the warm-up model (empty: dense)."""
    if arch.family != "qwen3_moe":
        return {}
    return dict(num_experts=int(arch.num_experts), num_experts_per_tok=int(arch.num_experts_per_tok),
                moe_intermediate_size=int(arch.moe_intermediate_size),
                norm_topk_prob=bool(arch.norm_topk_prob),
                decoder_sparse_step=int(arch.decoder_sparse_step),
                mlp_only_layers=[int(i) for i in arch.mlp_only_layers],
                head_dim=int(arch.head_dim or arch.hidden_size // arch.num_attention_heads))
