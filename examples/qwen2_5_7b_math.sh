#!/usr/bin/env bash
# Qwen2.5-Math-7B on GPUs (pip install -e .[gpu]). Usage:
#   bash examples/qwen2_5_7b_math.sh model.path=/ckpt/Qwen2.5-Math-7B data.train_files=[/data/dapo.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
python -m laminar_mcore.launch experiment=qwen2_5_7b_math cluster.controller_addr=127.0.0.1 "$@"
