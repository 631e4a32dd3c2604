#!/usr/bin/env bash
# Qwen2.5-72B on a cluster: run this script on every node with its role.
#   controller:  bash examples/multinode_72b.sh controller
#   rollout:     bash examples/multinode_72b.sh rollout      (each rollout node)
#   trainer:     bash examples/multinode_72b.sh trainer      (each trainer node)
# Set CONTROLLER (the controller's address), TRAINER0 (the first trainer node, torchrun's
# rendezvous), MODEL (a local Hugging Face checkpoint) and the same LAMINAR_RUN_TOKEN everywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CONTROLLER:?set CONTROLLER to the controller's address}"
: "${LAMINAR_RUN_TOKEN:?export the same LAMINAR_RUN_TOKEN on every node}"
role="${1:?role: controller | rollout | trainer}"; shift
PY="${PYTHON:-python}"
RUN=(experiment=qwen2_5_72b_math cluster=multinode "cluster.controller_addr=$CONTROLLER"
     cluster.controller_port=8500 "model.path=${MODEL:?set MODEL to the checkpoint directory}")
case "$role" in
  controller) exec "$PY" -m laminar_mcore.launch job=controller "${RUN[@]}" "$@" ;;
  rollout)    exec "$PY" -m laminar_mcore.launch job=rollout "${RUN[@]}" "rollout.host=$(hostname -i | cut -d' ' -f1)" "$@" ;;
  trainer)    exec "$PY" -m torch.distributed.run --nnodes "${NNODES:-4}" --nproc-per-node 8 \
                --rdzv-backend c10d --rdzv-endpoint "${TRAINER0:?set TRAINER0}:29400" \
                -m laminar_mcore.launch job=trainer "${RUN[@]}" "cluster.trainer.nnodes=${NNODES:-4}" "$@" ;;
  *) echo "unknown role $role (controller | rollout | trainer)" >&2; exit 2 ;;
esac
