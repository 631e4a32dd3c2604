"""The CPU engine's weight-update routes, with SGLang 0.5.23's semantics
(``srt/managers/scheduler_components/weight_updater.py``, ``tokenizer_control_mixin.py``):

- ``/update_weights_from_tensor`` and ``/update_weights_from_distributed`` run only inside a
  session opened by ``/begin_weight_update`` and closed by ``/end_weight_update`` (400,
  ``success=false`` and SGLang's message otherwise); ``/update_weights_from_disk`` needs none;
- an update waits for every running request (the model-update writer lock) unless generation
  is paused, so no request mixes versions unless the caller paused it in place;
- ``flush_cache`` (default true) flushes after loading and fails the call while requests are
  kept, as SGLang's does; ``weight_version`` is recorded on success;
- ``serialized_named_tensors`` holds one payload per TP rank (``--tp-size``): whole Hugging Face
  tensors each rank narrows (``flattened_bucket``), or each rank's own parameters in SGLang's
  fused per-rank layout (``direct``, ``weights/engine_layout.py``); the served model is their
  union (one CPU computes every rank's part). Entries past the TP size are ignored, as SGLang
  ignores them; whole tensors load as SGLang's ``load_weights`` loads them
  (``DecoderLM.load_like_sglang``: a name it has no parameter for is skipped);
- what SGLang's scheduler cannot load ends the engine, as it ends that scheduler
  (``scheduler_dies``): a direct payload of a name that is not a parameter, a tensor of another
  size in a direct payload, a flattened bucket or a checkpoint; a broadcast's fails the call
  with the tensors before it loaded (``PARTIALLY_UPDATED``).

Mixed into ``CpuEngineServer``; it never imports trainer code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Dict, List, Tuple

import torch
from aiohttp import web

from ..weights.bucket import decode_handle, open_handle
from ..weights.engine_layout import Layout, LayoutError, layout_for_config
from .engine_http import HTTPError

logger = logging.getLogger("laminar_mcore.cpu_engine")
SESSION_REQUIRED = "{op} must run between begin_weight_update() and end_weight_update()"
FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still "
                 "running or queued. Retract or finish them, then call /flush_cache.")


def torch_dtype(name) -> torch.dtype:
    """SGLang's ``getattr(torch, dtype)``: a bare torch attribute name such as ``bfloat16``
    (``"torch.bfloat16"`` is refused there too)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise HTTPError(400, f"dtypes: {str(name)[:80]!r} is not a torch dtype name (SGLang "
                             "reads getattr(torch, dtype): e.g. 'bfloat16', not 'torch.bfloat16')")
    return dtype


def rank_layout(model, tp: int, ep: int = 1) -> Tuple[int, Layout]:
    """(TP size, SGLang's per-rank layout of ``model`` at it and expert parallel size ``ep``:
    the experts as SGLang's default runner keeps them); a TP size the model's heads (or an EP
    size its experts) do not split over is refused at start-up, as SGLang refuses it."""
    if int(tp) < 1:
        raise ValueError(f"--tp-size {tp} must be >= 1")
    try:
        return int(tp), layout_for_config(model.config, int(tp), model.adapter, int(ep))
    except LayoutError as exc:
        raise ValueError(f"--tp-size {tp} --ep-size {ep}: {exc}") from None


class LoadFailed(Exception):
    """A load that failed after receiving, with SGLang's whole message (``_apply``)."""


# SGLang 0.5.23's answer to a broadcast whose load failed (model_runner_components/
# weight_updater.py, load_weights_from_distributed): the tensors before the failing one loaded
PARTIALLY_UPDATED = ("Failed to update parameter online: {}. The full weights of the "
                     "ModelRunner are partially updated. Please discard the whole weights.")


def scheduler_dies(exc: BaseException, what: str = "a direct weight payload") -> None:
    """What SGLang 0.5.23 does with weights it cannot load, ``what``: a payload of
    ``/update_weights_from_tensor`` (direct: a name that is not one of its parameters, a size
    that differs; flattened_bucket: a size that differs) -- nothing catches the error
    (``scheduler_components/weight_updater.py``) -- or a checkpoint of
    ``/update_weights_from_disk`` with a tensor of another size: its rollback reads the
    weights again from the checkpoint the update named (``model_config.model_path`` is set
    before loading) and fails the same way, uncaught. The scheduler process ends and takes
    the server down (``run_scheduler_process``). The twin ends the same way, saying why."""
    logger.error("%s failed to load (%s): SGLang 0.5.23's scheduler exits on it, and so does "
                 "this engine", what, exc)
    logging.shutdown()
    os._exit(1)


def load_rank_parameters(model, layout: Layout, ranks: List[Dict[str, torch.Tensor]]) -> int:
    """``load_format="direct"``: rank r's payload holds its own SGLang parameters, each copied
    whole (SGLang's ``_model_load_weights_direct``: ``params_dict[name]``, then
    ``default_weight_loader``'s size check); every rank's names and sizes are checked before
    anything is written (``ValueError``: the caller ends the engine, as SGLang's scheduler
    ends). The served model takes each rank's pieces back."""
    for r, named in enumerate(ranks):
        for name, t in named.items():
            if name not in layout.shapes:
                raise ValueError(f"rank {r}: {name!r} is not a parameter of the model (SGLang's "
                                 "per-rank names, e.g. model.layers.0.self_attn.qkv_proj.weight)")
            if tuple(t.shape) != layout.shapes[name]:
                raise ValueError(f"rank {r}: Attempted to load weight ({tuple(t.shape)}) into "
                                 f"parameter ({layout.shapes[name]}) {name}")
    written = set()
    with torch.no_grad():
        for r, named in enumerate(ranks):
            for name, t in named.items():
                for p in layout.pieces(name, r):
                    model.params[p.hf].narrow(p.dim, p.start, p.length).copy_(
                        (t[p.expert] if p.expert >= 0 else t).narrow(p.dim, p.at, p.length))
                    written.add(p.hf)
    return len(written)


def load_rank_slices(model, layout: Layout, ranks: List[Dict[str, torch.Tensor]]) -> int:
    """``load_format="flattened_bucket"`` at TP > 1: rank r's payload holds whole Hugging Face
    tensors, of which rank r keeps its slices (SGLang's weight loaders narrow them), read as
    SGLang's ``load_weights`` reads them (``DecoderLM.load_like_sglang``): a name the model has
    no parameter for is skipped, a size that differs raises ``ValueError`` after what came
    before it was written."""
    written = set()
    with torch.no_grad():
        for r, named in enumerate(ranks):
            for hf, t in named.items():
                hf = model.sglang_name(hf)
                if hf is None:
                    continue
                model.check_size(hf, t)
                for p in layout.hf_pieces(r).get(hf, []):
                    model.params[hf].narrow(p.dim, p.start, p.length).copy_(
                        t.narrow(p.dim, p.start, p.length))
                    written.add(hf)
    return len(written)


class WeightUpdateRoutes:
    """Weight-update handlers; the server provides ``core``, ``tp_size``, ``layout``,
    ``session_open``, ``paused``,
    ``pause_cond``, ``model_update_lock``, ``dist_group``, ``_command`` and ``_json``."""

    async def _model_update(self, fn, *, abort_all: bool = False):
        """Run a weight operation as SGLang does: at once when generation is paused, else
        under the writer lock, which waits for every running request to end."""
        if abort_all:
            await self._command("abort", None, True)
        async with self.pause_cond:
            paused = self.paused
            if paused:
                return await fn()
        async with self.model_update_lock.writer():
            return await fn()

    def _answer(self, success: bool, message: str, **extra) -> web.Response:
        return web.json_response({"success": success, "message": message, **extra},
                                 status=200 if success else 400)

    async def begin_weight_update(self, request: web.Request):
        await self._json(request, empty_ok=True)

        async def begin():
            if self.session_open:
                return False, "a weight-update session is already open; call end_weight_update() first"
            self.session_open = True
            return True, "Success"

        return self._answer(*await self._model_update(begin))

    async def end_weight_update(self, request: web.Request):
        await self._json(request, empty_ok=True)

        async def end():
            if not self.session_open:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self.session_open = False
            return True, "Success"

        return self._answer(*await self._model_update(end))

    async def _apply(self, op: str, body: dict, load, succeeded: str = "Success",
                     failed: str = "Failed to update weights") -> web.Response:
        """The common tail of update_weights_from_{tensor,distributed}, in SGLang's order: the
        session is checked first (garbage outside a session gets the session message), then
        the payload is decoded and loaded, the cache flushed if asked (SGLang's default; a
        refused flush fails the call after the weights changed, as in 0.5.23) and the version
        recorded; the messages are SGLang's. ``load`` raises ``HTTPError`` for a payload it cannot read."""
        async def update():
            if not self.session_open:
                return False, SESSION_REQUIRED.format(op=op)
            try:
                await load()
            except LoadFailed as exc:
                return False, str(exc)
            except (ValueError, KeyError, RuntimeError) as exc:
                return False, f"{failed}: {exc}"
            return await self._recorded(body, succeeded)

        return self._answer(*await self._model_update(
            update, abort_all=bool(body.get("abort_all_requests", False))))

    async def _recorded(self, body: dict, message: str) -> Tuple[bool, str]:
        """After a load that succeeded, in SGLang 0.5.23's order: the scheduler records the
        version (outputs carry it from now on), then flushes the cache if asked -- a refused
        flush fails the call with the new weights and that version in place, while
        ``/model_info`` (the tokenizer side, updated only on success) keeps the old one."""
        version = body.get("weight_version")
        if version is not None:
            await self._command("set_version", str(version))
        if body.get("flush_cache", True) and not (await self._command("flush_cache"))[0]:
            return False, FLUSH_REFUSED
        if version is not None:
            self.served_version = str(version)
            message += f" Weight version updated to {version}."
        return True, message

    async def update_weights_from_tensor(self, request: web.Request):
        body = await self._json(request)

        async def load():
            fmt = body.get("load_format")
            if fmt not in ("flattened_bucket", "direct"):
                raise HTTPError(400, f"load_format {fmt!r} is not supported by the CPU engine; "
                                     "use 'flattened_bucket' (whole tensors) or 'direct' (each "
                                     "rank's own parameters, SGLang's per-rank layout)")
            serialized = body.get("serialized_named_tensors")
            if not isinstance(serialized, list) or len(serialized) < self.tp_size:
                raise HTTPError(400, "serialized_named_tensors must be a list with one entry per "
                                     f"TP rank (this engine has {self.tp_size})")
            try:  # rank r reads entry r; SGLang never reads entries past its TP size
                handles = [decode_handle(data) for data in serialized[:self.tp_size]]
            except ValueError as exc:
                raise HTTPError(400, str(exc)) from None

            def read():
                with contextlib.ExitStack() as stack:
                    ranks = [stack.enter_context(open_handle(h)) for h in handles]
                    try:
                        if fmt == "direct":
                            return load_rank_parameters(self.core.model, self.layout, ranks)
                        if self.tp_size == 1:
                            return self.core.model.load_like_sglang(ranks[0])
                        return load_rank_slices(self.core.model, self.layout, ranks)
                    except ValueError as exc:
                        scheduler_dies(exc, f"a {fmt} weight payload")

            return await self._command("call", read)

        return await self._apply("update_weights_from_tensor", body, load)

    async def update_weights_from_disk(self, request: web.Request):
        body = await self._json(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not os.path.isdir(path):
            raise HTTPError(400, f"model_path {path!r} is not a directory")
        from ..models.hf import load_hf_config, load_hf_state_dict

        try:
            load_hf_config(path)
            state = await asyncio.to_thread(load_hf_state_dict, path)
        except ValueError as exc:  # SGLang: its weights iterator cannot be had
            raise HTTPError(400, f"cannot load {path}: {exc}") from None

        async def update():  # no session needed, as in SGLang 0.5.23
            try:
                await self._command("update_weights", state, None)
            except ValueError as exc:
                scheduler_dies(exc, f"the checkpoint {path}")
            self.model_path = path
            return await self._recorded(body, "Succeeded to update model weights.")

        success, message = await self._model_update(
            update, abort_all=bool(body.get("abort_all_requests", False)))
        return self._answer(success, message, num_paused_requests=0)

    async def init_weights_update_group(self, request: web.Request):
        """Join a sender's group with SGLang's ``init_custom_process_group`` rendezvous: a
        TCPStore at master_address:master_port, rank ``rank_offset`` (this engine's one TP
        rank), the group's store keys prefixed with ``group_name``."""
        body = await self._json(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size")
                   if k not in body]
        if missing:
            raise HTTPError(400, f"missing fields: {missing}")
        name = body.get("group_name", "weight_update_group")
        if self.dist_group is not None:
            return self._answer(False, f"weight update group {self.dist_group['name']!r} already exists")
        backend = body.get("backend", "nccl")
        if backend != "gloo":
            raise HTTPError(400, f"backend {backend!r}: the CPU engine joins weight update groups "
                                 "with backend 'gloo' (SGLang on GPUs uses nccl)")
        from ..weights.update_group import join_update_group

        try:
            pg = await asyncio.to_thread(join_update_group, str(body["master_address"]),
                                         int(body["master_port"]), int(body["world_size"]),
                                         int(body["rank_offset"]), name, backend)
        except Exception as exc:  # noqa: BLE001 - a failed rendezvous is reported, not fatal
            return self._answer(False, f"Failed to init process group: {exc}")
        self.dist_group = {"name": name, "pg": pg}
        return self._answer(True, "Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(self, request: web.Request):
        body = await self._json(request)
        from ..weights.update_group import receive_tensors

        async def load():
            names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
            if not (isinstance(names, list) and isinstance(dtypes, list)
                    and isinstance(shapes, list) and len(names) == len(dtypes) == len(shapes)):
                raise HTTPError(400, "names, dtypes and shapes must be lists of one length")
            group = body.get("group_name", "weight_update_group")
            if self.dist_group is None or group != self.dist_group["name"]:
                raise HTTPError(400, f"no weight update group {group!r}; call "
                                     "/init_weights_update_group")
            fmt = body.get("load_format")
            if fmt not in (None, "flattened_bucket"):
                raise HTTPError(400, f"load_format {fmt!r} is not supported; use none (one "
                                     "broadcast per tensor) or 'flattened_bucket' (one buffer "
                                     "for the whole update)")
            if not all(isinstance(s, list) and all(isinstance(x, int) and x >= 0 for x in s)
                       for s in shapes):
                raise HTTPError(400, "shapes must be lists of non-negative ints")
            specs = [(str(n), torch_dtype(d), tuple(s)) for n, d, s in zip(names, dtypes, shapes)]
            named = await asyncio.to_thread(receive_tensors, self.dist_group["pg"], specs, fmt)
            try:  # SGLang loads in order: a failure leaves the tensors before it loaded
                return await self._command("update_weights", named, None)
            except ValueError as exc:
                raise LoadFailed(PARTIALLY_UPDATED.format(exc)) from None

        return await self._apply("update_weights_from_distributed", body, load,
                                 succeeded="Succeeded to update parameter online.",
                                 failed="Failed to receive weights")

    async def destroy_weights_update_group(self, request: web.Request):
        body = await self._json(request, empty_ok=True)
        group = body.get("group_name", "weight_update_group")
        if self.dist_group is None or self.dist_group["name"] != group:
            return self._answer(False, f"no weight update group {group!r}")
        from ..weights.update_group import destroy_update_group

        pg, self.dist_group = self.dist_group["pg"], None
        try:
            await asyncio.to_thread(destroy_update_group, pg)
        except Exception as exc:  # noqa: BLE001 - reported as SGLang reports it
            return self._answer(False, f"Failed to destroy custom process group: {exc}.")
        return self._answer(True, "Succeeded to destroy custom process group.")

    async def update_weight_version(self, request: web.Request):
        body = await self._json(request)
        if "new_version" not in body:
            raise HTTPError(400, "missing field new_version")
        if body.get("abort_all_requests"):
            await self._command("abort", None, True)
        await self._command("set_version", str(body["new_version"]))
        self.served_version = str(body["new_version"])
        return web.json_response({"success": True, "message":
                                  f"Weight version updated to {body['new_version']}",
                                  "new_version": str(body["new_version"])})
