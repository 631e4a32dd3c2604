"""SGLang 0.5.23's own source, read as the spec of the protocol our client and CPU engine speak.

    python -m laminar_mcore.testing.sglang_source   # fetch into the cache, print where

SGLang cannot be installed on CPU machines, but its wheel can be downloaded: ``fetch`` runs
``pip download --no-deps sglang==0.5.23`` once and extracts the few files the conformance tests
read (route table, request structs, auth, the weight-update session, the flattened weight
bucket and its receivers) under ``.venv``. Nothing of SGLang is imported except
``sglang/api/v1/api_types.py`` and ``sglang/srt/utils/auth.py``, which depend only on msgspec
and the standard library, and ``sglang/srt/weight_sync/tensor_bucket.py``, which depends only on
torch.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from typing import Dict, Optional, Set, Tuple

from .wheel_source import default_cache, fetch_wheel_files

VERSION = "0.5.23"
FILES = ("sglang/api/v1/api_types.py", "sglang/srt/entrypoints/http_server.py",
         "sglang/srt/entrypoints/v1_loads.py", "sglang/srt/managers/io_struct.py",
         "sglang/srt/utils/auth.py", "sglang/srt/managers/scheduler_components/weight_updater.py",
         "sglang/srt/arg_groups/fields/serving.py", "sglang/srt/arg_groups/fields/exec_.py",
         "sglang/srt/utils/common.py", "sglang/srt/weight_sync/tensor_bucket.py",
         "sglang/srt/model_executor/model_runner_components/weight_updater.py",
         "sglang/srt/managers/tokenizer_manager.py", "sglang/srt/managers/scheduler.py",
         "sglang/srt/managers/scheduler_components/flush_wrapper.py",
         "sglang/srt/managers/scheduler_components/output_streamer.py",
         # the per-rank parameter layout (weights/engine_layout.py)
         "sglang/srt/layers/vocab_parallel_embedding.py", "sglang/srt/layers/linear.py",
         "sglang/srt/models/qwen2.py", "sglang/srt/models/qwen3.py", "sglang/srt/models/llama.py",
         # ... and of the experts (Qwen3-MoE, SGLang's default MoE runner)
         "sglang/srt/models/qwen3_moe.py", "sglang/srt/layers/moe/fused_moe_triton/layer.py",
         "sglang/srt/layers/quantization/unquant.py", "sglang/srt/distributed/parallel_state.py",
         "sglang/srt/arg_groups/model_overrides/qwen3_moe.py", "sglang/srt/runtime_context.py",
         # ... and the arguments /server_info reports (what decides an engine's layout)
         "sglang/srt/arg_groups/fields/parallel.py", "sglang/srt/arg_groups/fields/model.py",
         "sglang/srt/server_args.py", "sglang/srt/utils/common.py",
         # how a whole-tensor update loads (the legacy loader, its size check)
         "sglang/srt/environ.py", "sglang/srt/model_loader/weight_utils.py")


def cache_dir() -> str:
    return default_cache(f"sglang-{VERSION}-source", "LAMINAR_SGLANG_SOURCE")


def fetch(timeout_s: float = 600) -> str:
    """The cache directory, downloading and extracting the wheel if it is not there yet.
    Raises ``RuntimeError`` saying why when it cannot be had."""
    return fetch_wheel_files("sglang", VERSION, FILES, cache_dir(), timeout_s)


def read(relpath: str) -> str:
    with open(os.path.join(fetch(), relpath)) as f:
        return f.read()


def load_module(relpath: str, name: str):
    """Import one self-contained SGLang file (api_types, auth) without the package."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(fetch(), relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def routes() -> Set[Tuple[str, str]]:
    """(METHOD, path) of every literal route of SGLang's HTTP server (and /v1/loads)."""
    out: Set[Tuple[str, str]] = set()
    for rel in ("sglang/srt/entrypoints/http_server.py", "sglang/srt/entrypoints/v1_loads.py"):
        for node in ast.walk(ast.parse(read(rel))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for dec in node.decorator_list:
                if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                        and dec.args and isinstance(dec.args[0], ast.Constant)):
                    continue
                kind, path = dec.func.attr, dec.args[0].value
                if kind in ("get", "post", "put", "delete"):
                    out.add((kind.upper(), path))
                elif kind == "api_route":
                    methods = next((kw.value for kw in dec.keywords if kw.arg == "methods"), None)
                    for m in (ast.literal_eval(methods) if methods is not None else ["GET"]):
                        out.add((m.upper(), path))
    # /metrics is a Prometheus app mounted with --enable-metrics (utils/common.py).
    if 'Mount("/metrics"' in read("sglang/srt/utils/common.py"):
        out.add(("GET", "/metrics"))
    return out


def struct_fields(class_name: str, relpath: str = "sglang/srt/managers/io_struct.py"
                  ) -> Dict[str, Optional[object]]:
    """Field name -> default (``...`` when required) of a msgspec Struct in ``relpath``,
    with the fields of its base classes in the same file."""
    tree = ast.parse(read(relpath))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> Dict[str, object]:
        node = classes[name]
        out: Dict[str, object] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out.update(fields(base.id))
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                try:
                    default = ast.literal_eval(stmt.value) if stmt.value is not None else ...
                except ValueError:
                    default = ast.unparse(stmt.value)
                out[stmt.target.id] = default
        return out

    return fields(class_name)


if __name__ == "__main__":
    print(fetch())
