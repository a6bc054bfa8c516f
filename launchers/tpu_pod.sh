#!/bin/bash
# Cloud TPU pod launch: the same command on every worker of the slice; no shared filesystem needed.
#
#   TPU=my-v5p-64 ZONE=us-east5-a RUN_DIR=gs://my-bucket/runs/gsm8k \
#   STAGE="gs://my-bucket/models/Qwen2.5-1.5B-Instruct=/tmp/model gs://my-bucket/gsm8k=/tmp/gsm8k" \
#     launchers/tpu_pod.sh --config=configs/gsm8k_qwen.py --config.model.path=/tmp/model \
#       --config.data.train_path=/tmp/gsm8k/train.jsonl --config.data.test_path=/tmp/gsm8k/test.jsonl
#
# jax.distributed.initialize() discovers the pod's workers from TPU metadata on its own;
# areal_jax.runtime.distributed calls it with no arguments when it sees the TPU worker variables, and
# peer failures are detected by JAX's coordination service (no heartbeat files).
# RUN_DIR: where the run writes (metrics, samples, summary, timeline, checkpoints): a gs:// URL, read
#   and written through etils.epath + gcsfs and orbax's own GCS driver; only process 0 writes the shared
#   files, per-process files carry the process index. Resuming = launching again with the same RUN_DIR.
# STAGE: optional "SRC=DST" pairs copied to every worker's local disk first (model, data), since
#   model.path and data paths are read locally.
# The compile cache stays on each worker's own disk ($AREAL_JAX_COMPILE_CACHE, default
# ~/.cache/areal_jax/xla); so does the scratch space for the logs' local mirrors ($AREAL_JAX_SCRATCH).
# The repository must exist at $REPO_DIR on every worker (e.g. `--worker=all --command "git clone ..."`).
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}"
: "${ZONE:?set ZONE to its zone}"
: "${RUN_DIR:?set RUN_DIR to a gs:// run directory, e.g. gs://my-bucket/runs/gsm8k}"
REPO_DIR=${REPO_DIR:-'~/areal_jax'}  # expanded on each worker
STAGE=${STAGE:-}
ARGS=$(printf ' %q' "$@" "--config.run_dir=$RUN_DIR")
COPY=""
for pair in $STAGE; do
  COPY+="mkdir -p $(dirname "${pair#*=}") && gcloud storage cp -r ${pair%%=*} ${pair#*=} && "
done
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command \
  "cd $REPO_DIR && pip install -q -e . 'jax[tpu]' gcsfs && ${COPY}python -m areal_jax.main$ARGS"
