#!/usr/bin/env bash
# Megatron-Core at TP=2 x PP=2 on CPU, checked against transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONWARNINGS=ignore .venv/bin/python -m laminar_mcore.launch experiment=cpu_tp2_pp2 "$@"
