#!/usr/bin/env bash
# A Cloud TPU pod slice: the same command on every worker; JAX finds its peers itself.
#   launch/tpu_pod.sh TPU_NAME ZONE [rljax.launch arguments...]
# e.g. launch/tpu_pod.sh my-v5e-32 us-west4-a --mesh=dp8,tp4 --config configs/qwen2_5_0_5b_gsm8k.yaml ...
# Assumes the repository is checked out at ~/rljax on every worker with the package installed.
set -euo pipefail
tpu=${1:?usage: $0 TPU_NAME ZONE [rljax.launch args...]}
zone=${2:?usage: $0 TPU_NAME ZONE [rljax.launch args...]}
shift 2
args=$(printf '%q ' "$@")
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all \
  --command "cd ~/rljax && python3 -m rljax.launch --distributed ${args}"
