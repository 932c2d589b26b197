#!/usr/bin/env bash
# Train on every worker of a Cloud TPU VM pod (e.g. v5p-64 = 8 hosts) with one command.
#
#   TPU_NAME=my-pod ZONE=us-central2-b trainers/launch/scripts/tpu_pod.sh gpt-350m --mesh fsdp=-1 --set run.steps=2000
#
# Every worker runs the same `spmd-train` command; jax asks the TPU metadata server for the
# coordinator, process count and id, so no SPMD_* variables are needed. Multi-slice: add
# `--dcn data=N` (N slices) and create the slices as one multislice queued resource.
# Setup once per pod (same on every worker):
#   gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all \
#     --command='git clone REPO spmd && cd spmd && pip install -e ".[tpu]"'
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
: "${ZONE:?set ZONE to its zone, e.g. us-central2-b}"
WORKDIR="${WORKDIR:-~/spmd}"
if [[ $# -lt 1 ]]; then
  echo "usage: TPU_NAME=NAME ZONE=ZONE $0 RECIPE [spmd-train options ...]" >&2
  exit 2
fi

remote="cd ${WORKDIR} && spmd-train $(printf '%q ' "$@")"
project_flag=()
if [[ -n "${PROJECT:-}" ]]; then
  project_flag=(--project="${PROJECT}")
fi
exec gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --zone="${ZONE}" --worker=all "${project_flag[@]}" \
  --command="${remote}"
