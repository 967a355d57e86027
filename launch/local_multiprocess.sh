#!/usr/bin/env bash
# N rljax processes on this machine, one JAX process each, CPU collectives between them.
#   launch/local_multiprocess.sh NUM_PROCESSES [rljax.launch arguments...]
# e.g. launch/local_multiprocess.sh 2 --mesh=dp4 --run-dir runs/mp trainer.total_steps=5
# Each process gets (mesh devices / NUM_PROCESSES) virtual CPU devices. Process 0 writes
# the run outputs; the exit status is the first non-zero status of any process.
set -u
n=${1:?usage: $0 NUM_PROCESSES [rljax.launch args...]}
shift
port=${RLJAX_COORDINATOR_PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
pids=()
for ((i = 0; i < n; i++)); do
  python3 -m rljax.launch --coordinator "127.0.0.1:${port}" --num-processes "$n" --process-id "$i" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || { rc=$?; [ "$status" -eq 0 ] && status=$rc; }
done
exit "$status"
