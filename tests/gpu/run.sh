#!/usr/bin/env bash
# The real-GPU suite: one command on a machine with an NVIDIA GPU, its driver
# and (for the full table) PyTorch and nvcc; no network, no cargo. See
# tests/gpu/README.md.
#
#   bash tests/gpu/run.sh [--artifacts DIR] [suite options]   # the GPU of this machine
#   bash tests/gpu/run.sh --sim [suite options]               # a simulated node (gpu-sim)
#
# --artifacts: where libvcuda.so, vdriver-mirror and examples/test_manager are
# (default: the first of target/x86_64-unknown-linux-gnu/release (glibc 2.17,
# as shipped), target/release, target/debug that has all three). --sim installs
# config/nodes/sim-1gpu.toml with <artifacts>/gpu-sim into a temporary root
# (its gpu-sim, else target/debug/gpu-sim) and runs what needs no PyTorch/nvcc
# there (those rows: NOT RUN, allowed).
# Other options go to suite.py (--only, --compute-seconds, --json, --keep;
# `--help`). PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

artifacts="" sim=0 rest=()
while [ $# -gt 0 ]; do
  case "$1" in
    --artifacts) [ $# -ge 2 ] || { echo "run.sh: --artifacts needs a directory" >&2; exit 2; }
                 artifacts=$2; shift 2 ;;
    --sim) sim=1; shift ;;
    *) rest+=("$1"); shift ;;
  esac
done
if [ -z "$artifacts" ]; then
  # The first with all three: the shipped glibc-2.17 build, a release build, a
  # debug build (for --sim: the debug build first, where gpu-sim is).
  dirs="target/x86_64-unknown-linux-gnu/release target/release target/debug"
  [ "$sim" = 1 ] && dirs="target/debug target/release"
  for d in $dirs; do
    if [ -f "$d/libvcuda.so" ] && [ -f "$d/vdriver-mirror" ] && [ -f "$d/examples/test_manager" ]; then
      artifacts=$d
      break
    fi
  done
  [ -n "$artifacts" ] || { echo "run.sh: no directory with libvcuda.so, vdriver-mirror and examples/test_manager; see tests/gpu/README.md" >&2; exit 2; }
fi
python=${PYTHON:-python3}
command -v "$python" >/dev/null || { echo "run.sh: $python not found" >&2; exit 2; }

if [ "$sim" = 1 ]; then
  gpu_sim=$artifacts/gpu-sim
  [ -x "$gpu_sim" ] || gpu_sim=target/debug/gpu-sim
  [ -x "$gpu_sim" ] || { echo "run.sh: no gpu-sim in $artifacts or target/debug (cargo build -p gpu-sim)" >&2; exit 2; }
  root=$(mktemp -d /tmp/vcuda-gpu-suite-sim-XXXXXX)
  trap 'rm -rf "$root"' EXIT
  "$gpu_sim" install --node config/nodes/sim-1gpu.toml --root "$root" >/dev/null ||
    { echo "run.sh: gpu-sim install failed" >&2; exit 2; }
  "$python" tests/gpu/suite.py --artifacts "$artifacts" --host-root "$root" --sim --allow-not-run "${rest[@]}"
  exit $?
fi
if ! command -v nvidia-smi >/dev/null && [ ! -e /dev/nvidiactl ]; then
  echo "run.sh: no NVIDIA driver here (no nvidia-smi, no /dev/nvidiactl); use --sim for the simulated node" >&2
  exit 2
fi
# The mirror (like the manager) finds the driver through ld.so.cache. GPU
# containers often reach it only through LD_LIBRARY_PATH (/usr/local/nvidia/
# lib64, mounted by the runtime): as root, add that directory to the cache
# (what the host's driver install does) rather than fail the whole run.
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 .*x86-64'; then
  for d in ${LD_LIBRARY_PATH//:/ } /usr/local/nvidia/lib64 /usr/lib64 /usr/local/cuda/compat; do
    if [ -e "$d/libcuda.so.1" ]; then
      if [ "$(id -u)" = 0 ] && echo "$d" >/etc/ld.so.conf.d/zz-vcuda-gpu-suite.conf && ldconfig; then
        echo "run.sh: libcuda.so.1 was not in ld.so.cache; added $d (/etc/ld.so.conf.d/zz-vcuda-gpu-suite.conf)" >&2
      else
        echo "run.sh: libcuda.so.1 is in $d but not in ld.so.cache, which the mirror reads; run ldconfig $d as root" >&2
      fi
      break
    fi
  done
fi
"$python" tests/gpu/suite.py --artifacts "$artifacts" "${rest[@]}"
