#!/usr/bin/env bash
# The compute cases with every CUDA process a client of an MPS server: the
# server runs all clients' kernels under its own PID, so NVML never names a
# container's process and the interposer's controller works blind (cuda-shim
# throttle/controller.rs, "Blind feedback"). Shows whether the quota holds
# there. Run on a GPU machine, from the repository root, with the artifacts
# tests/gpu/run.sh uses:
#
#   bash tests/gpu/probes/mps.sh [suite options, e.g. --quick --json FILE]
set -uo pipefail
ctl=$(command -v nvidia-cuda-mps-control) || { echo "mps.sh: no nvidia-cuda-mps-control here" >&2; exit 3; }
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mps-pipe.XXXXXX)
export CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mps-log.XXXXXX)
"$ctl" -d || { echo "mps.sh: starting the MPS control daemon failed" >&2; exit 3; }
trap 'echo quit | "$ctl"; sleep 1; for f in "$CUDA_MPS_LOG_DIRECTORY"/*.log; do echo "== $f" >&2; tail -n 5 "$f" >&2; done' EXIT
bash tests/gpu/run.sh --only graph30,kmix30 "$@"
rc=$?
# The server really ran the clients (its log names them).
echo "MPS log lines naming clients: $(cat "$CUDA_MPS_LOG_DIRECTORY"/*.log | grep -ci client)" >&2
exit $rc
