#!/usr/bin/env bash
# The three modes side by side on a long-tailed response-length replay.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONWARNINGS=ignore .venv/bin/python -m laminar_mcore.bench.modes --json outputs/modes.json "$@"
