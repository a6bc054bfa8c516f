#!/bin/bash
# Cloud TPU pod launch: the same command on every worker of the slice.
#
#   TPU=my-v5p-64 ZONE=us-east5-a launchers/tpu_pod.sh --config=configs/gsm8k_qwen.py
#
# jax.distributed.initialize() discovers the pod's workers from TPU metadata on its own;
# areal_jax.system.distributed calls it with no arguments when it sees the TPU worker variables.
# The repository (and the checkpoint / data paths in the config) must exist on every worker, e.g.
# on a shared GCS-fuse or NFS mount.
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}"
: "${ZONE:?set ZONE to its zone}"
REPO_DIR=${REPO_DIR:-~/areal_jax}
ARGS=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command \
  "cd $REPO_DIR && pip install -q -e . 'jax[tpu]' && python -m areal_jax.main$ARGS"
