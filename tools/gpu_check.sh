#!/usr/bin/env bash
# The GPU check on an offline GPU machine, in one command (docs/gpu.md): installs the wheels of
# `make gpu-wheels` into a temporary prefix (no network, no build), puts it and this source tree
# on PYTHONPATH (no `pip install -e .`) and runs `python -m laminar_mcore.bench.gpu`.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: tools/gpu_check.sh WHEELS OUTDIR

  WHEELS  the folder of wheels made by `make gpu-wheels` (Python 3.12, manylinux x86_64)
  OUTDIR  where the results go (created): gpu.json, gpu.log, versions.txt, install.log

environment:
  PYTHON=python3                 the interpreter (3.12 for those wheels)
  LAMINAR_GPU_CHECK_REHEARSAL=1  bench.gpu --cpu-rehearsal, no GPU needed (PYTHON defaults to
                                 the repository's .venv); wheels not for PYTHON are skipped
  LAMINAR_GPU_CHECK_DRY=1        stop after installing: print the command it would run
  LAMINAR_GPU_CHECK_ARGS=...     more arguments for bench.gpu (e.g. "--only kernels")
  LAMINAR_GPU_CHECK_TIMEOUT=S    stop bench.gpu after S seconds
  LAMINAR_GPU_CHECK_PYTEST=0     without bench.gpu's --pytest (the tests that use CUDA)
  LAMINAR_GPU_CHECK_INSTALLER=pip|zip  how wheels are installed (default: pip if it imports)

exit status: 0 all checks passed, 1 a check failed, 2 wrong arguments or setup
EOF
}
die() { echo "gpu_check: error: $*" >&2; exit 2; }

case "${1:-}" in -h|--help) usage; exit 0;; esac
if [ "$#" -ne 2 ]; then usage >&2; exit 2; fi
WHEELS=$1
OUT=$2
[ -d "$WHEELS" ] || die "no wheel folder '$WHEELS' (make one with \`make gpu-wheels\` where there is internet)"
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
[ "${#wheels[@]}" -gt 0 ] || die "no *.whl in '$WHEELS' (make gpu-wheels fills it)"

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
REHEARSAL=${LAMINAR_GPU_CHECK_REHEARSAL:-0}
[ "$REHEARSAL" = 0 ] || REHEARSAL=1
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  if [ "$REHEARSAL" = 1 ] && [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; fi
fi
command -v "$PYTHON" >/dev/null || die "no interpreter '$PYTHON' (set PYTHON)"
case $PYTHON in /*) ;; */*) PYTHON=$PWD/$PYTHON;; esac  # bench.gpu runs in $ROOT
mkdir -p "$OUT" || die "cannot create '$OUT'"
OUT=$(cd "$OUT" && pwd)

TMP=$(mktemp -d "${TMPDIR:-/tmp}/laminar-gpu-check.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
SITE=$TMP/site
mkdir -p "$SITE" "$TMP/tmp"

# Which wheels this interpreter can use (a wheel for another Python: an error, or in a rehearsal
# skipped, the current environment having that package already).
compat=$("$PYTHON" - "${wheels[@]}" <<'EOF'
import os, sys
try:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
except ImportError:
    try:
        from pip._vendor.packaging.tags import sys_tags
        from pip._vendor.packaging.utils import parse_wheel_filename
    except ImportError:
        sys_tags = None
supported = set(sys_tags()) if sys_tags else set()
for w in sys.argv[1:]:
    try:
        ok = sys_tags is None or bool(supported & parse_wheel_filename(os.path.basename(w))[3])
    except Exception:
        ok = False
    print("Y" if ok else "N", w)
EOF
) || die "$PYTHON cannot read the wheel names"
use=()
while read -r ok wheel; do
  if [ "$ok" = Y ]; then use+=("$wheel")
  elif [ "$REHEARSAL" = 1 ]; then echo "gpu_check: skipped (not for $PYTHON): $(basename "$wheel")"
  else die "$(basename "$wheel") is not for $PYTHON ($("$PYTHON" -V 2>&1)); set PYTHON to a Python 3.12"
  fi
done <<<"$compat"

# Install: pip without index, dependencies or builds; without pip, unpack the wheels.
INSTALLER=${LAMINAR_GPU_CHECK_INSTALLER:-}
if [ -z "$INSTALLER" ]; then
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then INSTALLER=pip; else INSTALLER=zip; fi
fi
echo "gpu_check: installing ${#use[@]} wheel(s) into $SITE ($INSTALLER)"
if [ "${#use[@]}" -gt 0 ]; then
  if [ "$INSTALLER" = pip ]; then
    PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip install --no-index --no-deps --only-binary=:all: \
      --ignore-requires-python --no-compile --disable-pip-version-check --no-warn-script-location \
      --target "$SITE" "${use[@]}" >"$OUT/install.log" 2>&1 \
      || { cat "$OUT/install.log" >&2; die "installing the wheels failed (log: $OUT/install.log)"; }
  else
    "$PYTHON" - "$SITE" "${use[@]}" >"$OUT/install.log" 2>&1 <<'EOF' \
      || { cat "$OUT/install.log" >&2; die "unpacking the wheels failed (log: $OUT/install.log)"; }
import glob, os, shutil, sys, zipfile
site = sys.argv[1]
for w in sys.argv[2:]:
    with zipfile.ZipFile(w) as z:
        z.extractall(site)
    print("unpacked", w)
for data in glob.glob(os.path.join(site, "*.data")):
    for kind in ("purelib", "platlib"):
        src = os.path.join(data, kind)
        for name in os.listdir(src) if os.path.isdir(src) else []:
            shutil.move(os.path.join(src, name), os.path.join(site, name))
    shutil.rmtree(data)
EOF
  fi
fi
for info in "$SITE"/*.dist-info; do
  [ -d "$info" ] && echo "gpu_check: installed $(basename "$info" .dist-info)"
done

export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export TMPDIR=$TMP/tmp
args=(--json "$OUT/gpu.json")
# bench.gpu's --pytest (the tests that use CUDA), where this checkout's bench.gpu has it
if [ "${LAMINAR_GPU_CHECK_PYTEST:-1}" = 0 ]; then :
elif grep -q -- '"--pytest"' "$ROOT/laminar_mcore/bench/gpu.py"; then args+=(--pytest)
else echo "gpu_check: note: this bench.gpu has no --pytest; running without it"; fi
[ "$REHEARSAL" = 0 ] || args+=(--cpu-rehearsal)
read -r -a extra <<<"${LAMINAR_GPU_CHECK_ARGS:-}"
args+=(${extra[@]+"${extra[@]}"})
cmd=("$PYTHON" -m laminar_mcore.bench.gpu "${args[@]}")
if [ -n "${LAMINAR_GPU_CHECK_TIMEOUT:-}" ]; then
  cmd=(timeout -k 30 "$LAMINAR_GPU_CHECK_TIMEOUT" "${cmd[@]}")
fi
if [ "${LAMINAR_GPU_CHECK_DRY:-0}" != 0 ]; then
  echo "gpu_check: would run in $ROOT: PYTHONPATH=$PYTHONPATH ${cmd[*]}"
  exit 0
fi

# versions.txt: the GPU, driver and the versions (and origins) of what the check imports
{
  echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(uname -srm) ${HOSTNAME:-}"
  if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1 || true; else echo "no nvidia-smi"; fi
  "$PYTHON" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
bad = []
for mod in ("torch", "triton", "numpy", "safetensors", "transformers", "megatron.core", "hydra",
            "omegaconf", "antlr4", "zstandard", "laminar_mcore", "laminar_mcore.kernels",
            "laminar_mcore.conf"):
    try:
        m = importlib.import_module(mod)
        print(f"{mod} {getattr(m, '__version__', '-')} {getattr(m, '__file__', '')}")
    except Exception as exc:  # noqa: BLE001 - listed, and the check stops below
        bad.append(mod)
        print(f"{mod} NOT IMPORTABLE: {type(exc).__name__}: {exc}")
try:
    import torch
    print("cuda", torch.version.cuda, "available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("gpu", torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version())
except Exception as exc:  # noqa: BLE001
    print("cuda: ", type(exc).__name__, exc)
sys.exit(1 if bad else 0)
EOF
} >"$OUT/versions.txt" 2>&1 || {
  grep -E "NOT IMPORTABLE|Error" "$OUT/versions.txt" >&2 || true
  die "a package the check needs does not import (see $OUT/versions.txt); a wheel missing" \
    "or too old here: carry it too (make gpu-wheels GPU_WHEEL_EXTRA='name==version')"
}

echo "gpu_check: running ${cmd[*]}"
set +e
(cd "$ROOT" && "${cmd[@]}") 2>&1 | tee "$OUT/gpu.log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" = 0 ] && [ ! -s "$OUT/gpu.json" ]; then echo "gpu_check: no gpu.json written" >&2; rc=1; fi
[ "$rc" != 124 ] || echo "gpu_check: bench.gpu ran past ${LAMINAR_GPU_CHECK_TIMEOUT:-}s" >&2
if [ "$rc" = 0 ]; then verdict=PASSED; else verdict="FAILED (exit $rc)"; fi
shopt -s nullglob
results=("$OUT"/*)
echo "gpu_check: $verdict; results in $OUT: ${results[*]##*/}"
exit "$rc"
