"""tools/gpu_check.sh (the GPU check on an offline GPU machine, docs/gpu.md): its arguments, the
wheel install into a temporary prefix (dry run, a hand-made wheel), one short CPU rehearsal end
to end, and the source tree importable without ``pip install -e .``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _wheel(folder: Path, name: str = "fakepkg", version: str = "0.1",
           tag: str = "py3-none-any") -> Path:
    """A minimal valid wheel, written with zipfile (no build backend)."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": ("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                               f"Tag: {tag}\n")}
    files[f"{dist}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


def _run(args, tmp_path: Path, timeout: float = 60, **env) -> subprocess.CompletedProcess:
    tmp = tmp_path / "tmpdir"
    tmp.mkdir(exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith("LAMINAR_GPU_CHECK_")}
    full.update({"PYTHON": sys.executable, "TMPDIR": str(tmp), **env})
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env=full, timeout=timeout)


def test_script_syntax_and_shellcheck():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    if shutil.which("shellcheck"):
        r = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("args", [[], ["one"], ["a", "b", "c"]])
def test_wrong_arguments_print_usage_and_exit_2(tmp_path, args):
    r = _run(args, tmp_path)
    assert r.returncode == 2 and "usage: tools/gpu_check.sh WHEELS OUTDIR" in r.stderr


def test_help_exits_0(tmp_path):
    r = _run(["--help"], tmp_path)
    assert r.returncode == 0 and "LAMINAR_GPU_CHECK_REHEARSAL" in r.stdout


def test_missing_or_empty_wheel_folder_or_interpreter_exit_2(tmp_path):
    r = _run([tmp_path / "nope", tmp_path / "out"], tmp_path)
    assert r.returncode == 2 and "no wheel folder" in r.stderr and "make gpu-wheels" in r.stderr
    (tmp_path / "empty").mkdir()
    r = _run([tmp_path / "empty", tmp_path / "out"], tmp_path)
    assert r.returncode == 2 and "no *.whl" in r.stderr
    _wheel(tmp_path / "w")
    r = _run([tmp_path / "w", tmp_path / "out"], tmp_path, PYTHON=str(tmp_path / "no-python"))
    assert r.returncode == 2 and "no interpreter" in r.stderr


@pytest.mark.parametrize("installer", ["pip", "zip"])
def test_dry_run_installs_the_wheels_and_cleans_up(tmp_path, installer):
    _wheel(tmp_path / "w")
    out = tmp_path / "out"
    r = _run([tmp_path / "w", out], tmp_path, LAMINAR_GPU_CHECK_DRY="1",
             LAMINAR_GPU_CHECK_REHEARSAL="1", LAMINAR_GPU_CHECK_INSTALLER=installer,
             LAMINAR_GPU_CHECK_ARGS="--only kernels")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "installed fakepkg-0.1" in r.stdout
    would = [line for line in r.stdout.splitlines() if "would run" in line]
    assert len(would) == 1
    assert f"-m laminar_mcore.bench.gpu --json {out}/gpu.json" in would[0]
    assert "--cpu-rehearsal --only kernels" in would[0] and f"PYTHONPATH={ROOT}:" in would[0]
    has_pytest = '"--pytest"' in (ROOT / "laminar_mcore" / "bench" / "gpu.py").read_text()
    assert ("--pytest" in would[0]) == has_pytest
    assert sorted(p.name for p in out.iterdir()) == ["install.log"]
    assert list((tmp_path / "tmpdir").iterdir()) == []  # the prefix is gone (trap)


def test_a_wheel_for_another_python_is_an_error_except_in_a_rehearsal(tmp_path):
    _wheel(tmp_path / "w")
    _wheel(tmp_path / "w", "otherpy", "1.0", "cp39-cp39-manylinux_2_17_x86_64")
    r = _run([tmp_path / "w", tmp_path / "out"], tmp_path, LAMINAR_GPU_CHECK_DRY="1")
    assert r.returncode == 2 and "otherpy-1.0-cp39" in r.stderr and "Python 3.12" in r.stderr
    r = _run([tmp_path / "w", tmp_path / "out"], tmp_path, LAMINAR_GPU_CHECK_DRY="1",
             LAMINAR_GPU_CHECK_REHEARSAL="1")
    assert r.returncode == 0, r.stderr
    assert "skipped (not for" in r.stdout and "otherpy-1.0-cp39" in r.stdout
    assert "installed fakepkg-0.1" in r.stdout and "installed otherpy" not in r.stdout


def test_rehearsal_end_to_end_one_check(tmp_path):
    """The whole script once, on the cheapest check: the results it leaves and its exit status."""
    _wheel(tmp_path / "w")
    out = tmp_path / "out"
    r = _run([tmp_path / "w", out], tmp_path, timeout=240, LAMINAR_GPU_CHECK_REHEARSAL="1",
             LAMINAR_GPU_CHECK_ARGS="--only kernels", LAMINAR_GPU_CHECK_PYTEST="0",
             PYTHONWARNINGS="ignore")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert {"gpu.json", "gpu.log", "versions.txt", "install.log"} <= set(names)
    assert len(names) <= 8
    assert "[PASS] kernels" in (out / "gpu.log").read_text()
    versions = (out / "versions.txt").read_text()
    assert "laminar_mcore.kernels" in versions and "NOT IMPORTABLE" not in versions
    assert f"PASSED; results in {out}" in r.stdout
    assert list((tmp_path / "tmpdir").iterdir()) == []


# --- the source tree without `pip install -e .` -----------------------------------------------

PROBE = textwrap.dedent("""
    import os, sys
    # no editable install: drop its finder (python -I already ignores PYTHONPATH and user site)
    sys.meta_path[:] = [f for f in sys.meta_path
                        if "__editable__" not in getattr(f, "__module__", "")]
    root = sys.argv[1]
    sys.path.insert(0, root)
    import laminar_mcore.conf, laminar_mcore.kernels, laminar_mcore.kernels.packing
    assert laminar_mcore.__file__ == os.path.join(root, "laminar_mcore", "__init__.py")
    assert laminar_mcore.kernels.__file__ == os.path.join(root, "kernels", "__init__.py")
    assert laminar_mcore.conf.__file__ == os.path.join(root, "conf", "__init__.py")
    from importlib.resources import files
    assert (files("laminar_mcore.conf") / "experiment" / "cpu_demo.yaml").is_file()
    from laminar_mcore.config.paths import conf_dir
    assert conf_dir() == os.path.dirname(laminar_mcore.conf.__file__)
    # Hydra finds the tree as the package (pkg://laminar_mcore.conf) and composes it
    from hydra import compose, initialize_config_module
    from laminar_mcore.config import register_configs
    register_configs()
    with initialize_config_module(config_module="laminar_mcore.conf", version_base=None):
        assert compose("config", overrides=["experiment=cpu_demo"]).job
    print("ok")
""")


def test_source_tree_imports_kernels_and_conf_without_an_install(tmp_path):
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__")
    for name in ("laminar_mcore", "kernels", "conf"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-I", str(probe), str(src)], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
    # the control: without laminar_mcore/__init__.py's finder the same probe fails
    init = src / "laminar_mcore" / "__init__.py"
    init.write_text(init.read_text().replace("\n_source_tree_subpackages()\n", "\n"))
    r = subprocess.run([sys.executable, "-I", str(probe), str(src)], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode != 0 and "No module named 'laminar_mcore.conf'" in r.stderr, r.stderr
