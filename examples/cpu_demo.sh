#!/usr/bin/env bash
# Laminar-mode RL on the CPU demo task; extra arguments are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONWARNINGS=ignore .venv/bin/python -m laminar_mcore.launch experiment=cpu_demo "$@"
