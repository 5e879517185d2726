#!/usr/bin/env bash
# The whole test suite, runnable on a fresh Debian machine as root (what CI
# runs through .ci/run): installs what the tests need, starts a private Docker
# engine on its own socket, builds the workspace once and runs every test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD

# `--soak N [pattern]`: the same set-up and builds (lints aside), then every
# integration-test binary N times with the other core loaded instead of the
# suite (tests/soak.sh).
SOAK_RUNS=0
SOAK_PATTERN=.
if [ "${1:-}" = --soak ]; then
  SOAK_RUNS=${2:?"usage: tests/run.sh [--soak N [pattern]]"}
  SOAK_PATTERN=${3:-.}
  [[ "$SOAK_RUNS" =~ ^[1-9][0-9]*$ ]] || { echo "tests/run.sh: --soak wants a number of runs, not '$SOAK_RUNS'" >&2; exit 2; }
elif [ $# -gt 0 ]; then
  echo "tests/run.sh: unknown arguments '$*' (usage: tests/run.sh [--soak N [pattern]])" >&2
  exit 2
fi

# Every `log` line starts a phase. At exit, however the run ended, the
# phases' times, the slowest test binaries and one summary line of what
# failed are printed: test phases record a failure and the run goes on (a
# red Rust binary must not hide the Python tests), a failed install or
# build stops it and is named as what stopped it.
RUN_T0=$SECONDS
phase=""
phase_t0=$SECONDS
phase_times=()
failed=()
TEST_LOGS=$REPO/target/test-logs
rm -rf "$TEST_LOGS"
mkdir -p "$TEST_LOGS"
end_phase() {
  if [ -n "$phase" ]; then
    phase_times+=("$(printf '%6d s  %s' $((SECONDS - phase_t0)) "$phase")")
  fi
  phase=""
}
log() {
  end_phase
  phase=$*
  phase_t0=$SECONDS
  printf '%s\n' "$*" > "$TEST_LOGS/phase"
  printf '\n==> %s\n' "$*"
}
# A full disk or memory shows up as odd failures anywhere (a container
# SIGKILLed, a pip install that stops): sample both every 5 s and name the
# lowest each reached, and in which phase, at the end.
# The CPUs' idle and total ticks too (/proc/stat): how much of the two
# cores each phase left idle, for whoever lays the phases out next.
watch_resources() {
  while sleep 5; do
    printf '%s\t%s\t%s\t%s\n' \
      "$(df -Pk "$REPO" | awk 'NR == 2 { print $4 }')" \
      "$(awk '/^MemAvailable:/ { print $2 }' /proc/meminfo)" \
      "$(cat "$TEST_LOGS/phase" 2>/dev/null)" \
      "$(awk '$1 == "cpu" { t = 0; for (i = 2; i <= NF; i++) t += $i; print $5 + $6 "\t" t; exit }' /proc/stat)" \
      >> "$TEST_LOGS/resources.tsv"
  done
}
watch_resources &
RESOURCE_WATCH=$!
# One awk, no `sort | head`: under pipefail, head leaving a long sort's
# output unread is SIGPIPE (141), and `set -e` then ended the report there
# (a 67-min run's samples at 54d301d).
lowest() {
  local col=$1 what=$2
  [ -s "$TEST_LOGS/resources.tsv" ] || return 0
  awk -F'\t' -v c="$col" -v w="$what" '
    $c != "" && (min == "" || $c + 0 < min) { min = $c + 0; in_phase = $3 }
    END { if (min != "") printf "%7.1f GiB  lowest %s (in: %s)\n", min / 1048576, w, in_phase }' \
    "$TEST_LOGS/resources.tsv"
}
# In the order the phases first appear; a phase's share is its samples'
# idle ticks over their total ticks.
idle_by_phase() {
  [ -s "$TEST_LOGS/resources.tsv" ] || return 0
  awk -F'\t' '
    NF >= 5 && $5 > 0 {
      if (t0 != "" && $5 > t0) {
        if (!($3 in tot)) order[n++] = $3
        idle[$3] += $4 - i0; tot[$3] += $5 - t0
      }
      i0 = $4; t0 = $5
    }
    END { for (k = 0; k < n; k++) { p = order[k]; printf "%5.1f %%  %s\n", 100 * idle[p] / tot[p], p } }' \
    "$TEST_LOGS/resources.tsv"
}
kill_tree() { # kill_tree <pid>: it and its descendants, leaves first
  local c
  for c in $(pgrep -P "$1"); do kill_tree "$c"; done
  kill "$1" 2>/dev/null || true
}
report() {
  local rc=$? stopped=$phase
  # The report must reach its verdict: no step of it may end the run early.
  set +e
  if [ -n "${SOAK_HOG:-}" ]; then kill "$SOAK_HOG" 2>/dev/null || true; fi
  kill "$RESOURCE_WATCH" 2>/dev/null || true
  # A build still going (a set-up step failed while it ran).
  local b
  for b in "${!BUILD_PID[@]}"; do
    [ -s "$(build_rc "$b")" ] || kill_tree "${BUILD_PID[$b]}"
  done
  if [ -n "${BESIDE_PID:-}" ]; then
    # Ended already (its status file written), the PID may be another's.
    if [ ! -s "$BESIDE_OUT.rc" ]; then kill "$BESIDE_PID" 2>/dev/null || true; fi
    failed+=("$BESIDE_LABEL (stopped unfinished: the run ended first)")
  fi
  end_phase
  printf '\n==> phase times\n'
  printf '%s\n' "${phase_times[@]}"
  printf '\n==> CPU left idle, by phase (of all cores, over its samples)\n'
  idle_by_phase
  printf '\n==> disk and memory\n'
  lowest 1 "free disk on the checkout's file system"
  lowest 2 "available memory"
  if compgen -G "$TEST_LOGS/*.cargo.log" >/dev/null; then
    printf '\n==> slowest test binaries\n'
    awk '/^ +Running / { n = $NF; gsub(/[()]/, "", n); sub(/.*\//, "", n); sub(/-[0-9a-f]+$/, "", n) }
         /^ +Doc-tests / { n = "doc-tests " $2 }
         /^test result: / { t = $NF; sub(/s$/, "", t); printf "%8.1f s  %s\n", t, n }' \
      "$TEST_LOGS"/*.cargo.log | sort -rn | head -15 || true
  fi
  if [ "$rc" -ne 0 ]; then
    failed+=("${stopped:-start} (exit $rc, the run stopped here)")
  fi
  local total=$((SECONDS - RUN_T0))
  if [ ${#failed[@]} -gt 0 ]; then
    # A full disk shows up as odd errors anywhere: show what is free now.
    printf '\n==> disk at the end\n'
    df -h "$REPO" "$VCUDA_CACHE" 2>/dev/null | awk 'NR == 1 || !seen[$1]++' || true
    local IFS=';'
    printf '\ntests/run.sh: FAILED after %d s: %s\n' "$total" "${failed[*]}" | sed 's/;/; /g'
    exit 1
  fi
  printf '\ntests/run.sh: all phases passed in %d s\n' "$total"
}
trap report EXIT
# Stopped by a signal, the run must not end in "all phases passed".
trap 'exit 143' TERM
trap 'exit 130' INT

# run_tests <label> <command...>: runs a test phase, its output also in
# target/test-logs/<label>.cargo.log or .pytest.log; a failure is recorded
# with what failed (cargo's rerun hints, pytest's FAILED lines) and the run
# goes on.
test_log() { # test_log <label> <kind>: where a phase's output is kept
  printf '%s/%s.%s.log' "$TEST_LOGS" "$(printf '%s' "$1" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9' '-')" "$2"
}
record_failure() { # record_failure <label> <log>: what failed, from the log
  local what
  what=$( { sed -n 's/^.*to rerun pass `\(.*\)`$/\1/p; s/^ *`\(-p .*\)`$/\1/p' "$2"
            sed -n 's/^FAILED \([^ ]*\).*$/\1/p' "$2"; } | sort -u | paste -sd, - | sed 's/,/, /g')
  failed+=("$1${what:+ ($what)}")
}
run_tests() {
  local label=$1 kind=cargo
  shift
  [ "$1" = python3 ] && kind=pytest
  local out
  out=$(test_log "$label" "$kind")
  if "$@" 2>&1 | tee "$out"; then
    return 0
  fi
  record_failure "$label" "$out"
}
# with_status <file> <command...>, run as a background job: the command's
# exit status written to <file> when it ends; status_of <file> <pid> waits
# while the job lives and prints that status (nothing: it was killed first).
# Not `wait`: bash forgets a finished job's status once a later child is
# given its PID, and a fresh machine's builds go through PIDs fast (a run
# at c5b42dc lost the helm build's, 15 min after it ended: "wait: pid 19479
# is not a child of this shell").
with_status() {
  local file=$1 rc=0
  shift
  rm -f "$file"
  "$@" || rc=$?
  echo "$rc" >"$file"
}
status_of() {
  while [ ! -s "$1" ] && kill -0 "$2" 2>/dev/null; do sleep 2; done
  if [ -s "$1" ]; then cat "$1"; fi
}
# start_beside <label> <command...>: a test phase that mostly waits (a real
# node's pods) run in the background beside the phases that compute, its
# output only in its log until finish_beside prints it and records how it
# ended. One at a time.
start_beside() {
  BESIDE_LABEL=$1
  shift
  BESIDE_OUT=$(test_log "$BESIDE_LABEL" cargo)
  BESIDE_T0=$SECONDS
  with_status "$BESIDE_OUT.rc" "$@" >"$BESIDE_OUT" 2>&1 &
  BESIDE_PID=$!
  printf '(%s: started in the background, its output at the end)\n' "$BESIDE_LABEL"
}
finish_beside() {
  local rc
  rc=$(status_of "$BESIDE_OUT.rc" "$BESIDE_PID")
  [ -n "$rc" ] || { echo "tests/run.sh: $BESIDE_LABEL ended without saying how (killed?)"; rc=1; }
  BESIDE_PID=
  cat "$BESIDE_OUT"
  phase_times+=("$(printf '%6d s  %s (in the background, beside the phases above)' $((SECONDS - BESIDE_T0)) "$BESIDE_LABEL")")
  [ "$rc" -eq 0 ] || record_failure "$BESIDE_LABEL" "$BESIDE_OUT"
}

# The interposer ships linked against glibc 2.17 (cuda-shim/README.md, "glibc
# floor"): `cargo zigbuild` with zig from PyPI's ziglang as the linker. Same
# pins as deploy/Dockerfile (tests/glibc_floor.rs checks they agree). Tools
# and the old distribution root are cached outside the checkout, keyed by
# version, so only a machine's first run pays for them (4 to 5 minutes on 2
# busy cores: cargo-zigbuild from PyPI a few s, the release zig build 1.3 min,
# debootstrap 1 min, ziglang 15 s; later runs: an incremental zig build).
ZIGLANG_VERSION=0.15.2
CARGO_ZIGBUILD_VERSION=0.24.1
VCUDA_CACHE=${VCUDA_CACHE:-/var/cache/vcuda}
GLIBC_217_TARGET=x86_64-unknown-linux-gnu.2.17
# An old glibc to load the shipped interposer under (bullseye: 2.31, as
# Ubuntu 20.04); VCUDA_OLD_GLIBC_MIRROR if bullseye leaves the main mirror.
OLD_GLIBC_SUITE=bullseye
VCUDA_OLD_GLIBC_MIRROR=${VCUDA_OLD_GLIBC_MIRROR:-http://deb.debian.org/debian}

if [ "$(id -u)" != 0 ]; then
  echo "tests/run.sh: run as root: it installs Debian packages, creates device nodes and starts dockerd" >&2
  exit 2
fi
mkdir -p "$VCUDA_CACHE"

# Disk: a clean run's target dir is ~7 GiB with incremental compilation off
# (on, it adds ~3.5 GiB that a one-shot build never reads back); images, pods
# and pytest's files add ~1 GiB; the cache, filled once, ~16 GiB. A CI run
# at 0c9897b began with 6 GiB free and ended with 0.4 GiB and four failures
# that named nothing: refuse at once instead, saying what is missing.
export CARGO_INCREMENTAL=0
df -h "$REPO" "$VCUDA_CACHE" | awk 'NR == 1 || !seen[$1]++'
VCUDA_MIN_FREE_GIB=${VCUDA_MIN_FREE_GIB:-10}
cache_gib=$(du -sk "$VCUDA_CACHE" 2>/dev/null | awk '{ print int($1 / 1048576) }')
cache_need=$(( cache_gib < 16 ? 16 - cache_gib : 0 ))
free_gib=$(df -Pk "$REPO" | awk 'NR == 2 { print int($4 / 1048576) }')
if [ "$free_gib" -lt $((VCUDA_MIN_FREE_GIB + cache_need)) ]; then
  echo "tests/run.sh: only $free_gib GiB free on the file system of $REPO; a run needs $VCUDA_MIN_FREE_GIB GiB (the target dir ~7 GiB, images, pods and pytest the rest) and $cache_need GiB more to fill $VCUDA_CACHE (holds $cache_gib of ~16 GiB): free some space (or set VCUDA_MIN_FREE_GIB)" >&2
  exit 2
fi

log "system packages"
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
[ -x /bin/busybox ] || need+=(busybox-static)
command -v strace >/dev/null 2>&1 || need+=(strace)
command -v gcc >/dev/null 2>&1 || need+=(gcc)
# nvcc's host compiler (tests/sim_cudart.rs builds a CUDA C++ program).
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
# CRI recovery (tests/manager_cri.rs) against a private containerd.
command -v containerd >/dev/null 2>&1 || need+=(containerd)
command -v runc >/dev/null 2>&1 || need+=(runc)
# trixie's containerd 1.7 (CDI) is unpacked from its .deb (tests/containerd/cdi.sh).
command -v xz >/dev/null 2>&1 || need+=(xz-utils)
command -v curl >/dev/null 2>&1 || need+=(curl)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# start_build <script> <log>: a build run beside the downloads, its exit
# status in $TEST_LOGS (with_status; await_build).
declare -A BUILD_PID=()
build_rc() { printf '%s/build-%s.rc' "$TEST_LOGS" "$(basename "$1" .sh)"; }
start_build() {
  with_status "$(build_rc "$1")" bash "$1" >"$2" 2>&1 &
  BUILD_PID[$1]=$!
}

log "kubernetes (the real-node suite, tests/k8s)"
# A real single node (tests/k8s_node/): Debian's etcd, containerd, runc and
# CNI plugins, and kubelet/apiserver/scheduler/controller-manager/kubectl
# built from Debian's kubernetes source package, cached by version outside
# the checkout (/var/cache/vcuda/k8s-<version>; a cold build is ~10 min on
# 2 cores): built beside the downloads below, awaited before the workspace
# build. The three Go builds are CPU, the downloads network: a fresh
# machine's run overlapped nothing before (78.8 min, 9.4 of them the 1.20
# build alone).
k8s_need=()
command -v etcd >/dev/null 2>&1 || k8s_need+=(etcd-server)
command -v containerd >/dev/null 2>&1 || k8s_need+=(containerd)
command -v runc >/dev/null 2>&1 || k8s_need+=(runc)
[ -x /usr/lib/cni/bridge ] || k8s_need+=(containernetworking-plugins)
command -v openssl >/dev/null 2>&1 || k8s_need+=(openssl)
command -v curl >/dev/null 2>&1 || k8s_need+=(curl)
command -v ip >/dev/null 2>&1 || k8s_need+=(iproute2)
command -v pgrep >/dev/null 2>&1 || k8s_need+=(procps)
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || k8s_need+=(libc6-dev)
if [ ${#k8s_need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${k8s_need[@]}" >/dev/null
fi
mkdir -p "$VCUDA_CACHE"
start_build tests/k8s/build-kubernetes.sh "$VCUDA_CACHE/k8s-build.log"
export VCUDA_REQUIRE_K8S=1

# helm 3 from its Go module (tests/deploy/helm.rs renders and lints the
# chart with it), cached by version (/var/cache/vcuda/helm-<version>; a
# cold build is ~4 min on 2 cores): built beside the downloads below,
# awaited before the workspace build.
mkdir -p "$VCUDA_CACHE"
start_build deploy/helm/build-helm.sh "$VCUDA_CACHE/helm-build.log"
# Kubernetes 1.37 and containerd 2 from their Go modules (tests/k8s/modern)
# for the DRA real-node suite (tests/k8s_dra_node), cached by version
# (/var/cache/vcuda/k8s-go-<version>, containerd-go-<version>; Go's caches in
# /var/cache/vcuda/go; a cold build is 15-35 min on 2 cores): built beside
# the downloads below, awaited before the workspace build. Not later at
# idle priority: the phases before the DRA suite leave little idle CPU
# (a fresh run at 6a6c296 still waited on it there; tests/soak.md).
start_build tests/k8s/build-modern.sh "$VCUDA_CACHE/k8s-modern-build.log"

log "python packages"
python3 -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt
# NVIDIA's CUDA runtimes from PyPI (libcudart.so.12 of the newest 12.x and
# libcudart.so.13), CUDA 13's nvcc (nvcc, cicc, the crt headers) and CuPy
# over CUDA 13 with NVRTC: tests/sim_cudart.rs and tests/python/test_cupy.py
# run them on the simulated node; the wheels and their dependencies (about
# 250 MB) cached in $VCUDA_CACHE/wheels.
wheel_install() {
  python3 -m pip install -q --disable-pip-version-check --no-index \
    --find-links "$VCUDA_CACHE/wheels" "$1"
}
for wheel in "nvidia-cuda-runtime-cu12==12.9.79" "nvidia-cuda-runtime==13.5.37" \
    "nvidia-cuda-nvcc==13.5.37" "nvidia-nvvm==13.5.37" "nvidia-cuda-crt==13.5.37" \
    "nvidia-cuda-nvrtc==13.5.37" "cupy-cuda13x==14.2.0"; do
  if ! wheel_install "$wheel" 2>/dev/null; then
    python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
      -d "$VCUDA_CACHE/wheels" "$wheel"
    wheel_install "$wheel"
  fi
done
# PyTorch from PyPI (torch 2.15.0 over CUDA 13.2: NVIDIA's runtime, cuBLAS,
# cuDNN, NCCL ... wheels, 3.0 GB in 29 wheels, cached in $VCUDA_CACHE/wheels)
# for tests/python/test_torch.py. In a directory of its own, put on
# PYTHONPATH by the test: torch pins NVIDIA's 13.2 wheels, CuPy's above are
# 13.5. Installed once per version (~40 s, 5.3 GB; renamed when complete).
TORCH_VERSION=2.15.0
export VCUDA_TORCH_SITE="$VCUDA_CACHE/torch-$TORCH_VERSION-site"
if [ ! -f "$VCUDA_TORCH_SITE/torch/version.py" ]; then
  t0=$SECONDS
  torch_install() {
    rm -rf --one-file-system "$VCUDA_TORCH_SITE.partial"
    python3 -m pip install -q --disable-pip-version-check --no-index \
      --find-links "$VCUDA_CACHE/wheels" --target "$VCUDA_TORCH_SITE.partial" "torch==$TORCH_VERSION"
  }
  if ! torch_install 2>/dev/null; then
    python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
      -d "$VCUDA_CACHE/wheels" "torch==$TORCH_VERSION"
    torch_install
  fi
  rm -rf --one-file-system "$VCUDA_TORCH_SITE"
  mv "$VCUDA_TORCH_SITE.partial" "$VCUDA_TORCH_SITE"
  echo "torch $TORCH_VERSION installed in $((SECONDS - t0)) s into $VCUDA_TORCH_SITE"
fi
# zig, the linker of the glibc-2.17 interposer build (cargo-zigbuild runs it
# as `python3 -m ziglang` when no zig is on PATH; so does tests/glibc_floor.rs).
python3 -m pip install -q --disable-pip-version-check "ziglang==$ZIGLANG_VERSION"

log "cargo-zigbuild $CARGO_ZIGBUILD_VERSION"
zigbuild_root="$VCUDA_CACHE/cargo-zigbuild-$CARGO_ZIGBUILD_VERSION"
if [ ! -x "$zigbuild_root/bin/cargo-zigbuild" ]; then
  t0=$SECONDS
  # Its own release binary, as PyPI serves it (a wheel holding only the
  # executable): a fresh machine spent 232 s of both cores building it
  # from crates.io, beside the Kubernetes builds. Built from source if
  # PyPI lacks that version.
  zigbuild_tmp=$(mktemp -d)
  if python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      -d "$zigbuild_tmp" "cargo-zigbuild==$CARGO_ZIGBUILD_VERSION" 2>/dev/null \
    && python3 -m zipfile -e "$zigbuild_tmp"/cargo_zigbuild-*.whl "$zigbuild_tmp/x" \
    && install -D -m 755 "$zigbuild_tmp"/x/cargo_zigbuild-*.data/scripts/cargo-zigbuild "$zigbuild_tmp/bin/cargo-zigbuild" \
    && "$zigbuild_tmp/bin/cargo-zigbuild" --version >/dev/null; then
    install -D -m 755 "$zigbuild_tmp/bin/cargo-zigbuild" "$zigbuild_root/bin/cargo-zigbuild"
    echo "cargo-zigbuild $CARGO_ZIGBUILD_VERSION from PyPI in $((SECONDS - t0)) s (cached in $zigbuild_root)"
  else
    cargo install -q --locked cargo-zigbuild --version "$CARGO_ZIGBUILD_VERSION" --root "$zigbuild_root"
    echo "built cargo-zigbuild in $((SECONDS - t0)) s (cached in $zigbuild_root)"
  fi
  rm -rf "$zigbuild_tmp"
fi
export PATH="$zigbuild_root/bin:$PATH"

log "old glibc root ($OLD_GLIBC_SUITE)"
old_root="$VCUDA_CACHE/debian-$OLD_GLIBC_SUITE-minbase"
if [ ! -x "$old_root/usr/bin/ldd" ]; then
  t0=$SECONDS
  rm -rf --one-file-system "$old_root.partial"
  # Into .partial, renamed when complete: a cut-off run never leaves a
  # half-made root that later runs would take for a good one.
  if ! debootstrap --variant=minbase "$OLD_GLIBC_SUITE" "$old_root.partial" "$VCUDA_OLD_GLIBC_MIRROR" \
      >"$VCUDA_CACHE/debootstrap.log" 2>&1; then
    tail -20 "$VCUDA_CACHE/debootstrap.log" >&2
    echo "tests/run.sh: debootstrap $OLD_GLIBC_SUITE from $VCUDA_OLD_GLIBC_MIRROR failed; tests/glibc_floor.rs needs it (set VCUDA_OLD_GLIBC_MIRROR, e.g. to an archive mirror)" >&2
    exit 1
  fi
  mv "$old_root.partial" "$old_root"
  echo "debootstrapped $OLD_GLIBC_SUITE in $((SECONDS - t0)) s"
fi
export VCUDA_OLD_GLIBC_ROOT="$old_root"

log "NVIDIA's user-space drivers 535 and 550 (Debian non-free; the oracle, tests/nvidia)"
source tests/nvidia/fetch.sh
fetch_nvidia_drivers

log "docker engine"
source tests/docker/engine.sh
start_docker_engine
export VCUDA_REQUIRE_DOCKER=1

log "containerd (CRI recovery tests)"
# Its own socket, state, root and runc root (/run/vcuda-test-containerd),
# apart from any containerd kubelet or Docker uses.
source tests/containerd/start.sh
start_test_containerd

log "containerd 1.7 with CDI (the DRA driver's specs, injected)"
# A second private containerd (/run/vcuda-test-containerd-cdi): trixie's 1.7,
# unpacked into $VCUDA_CACHE/containerd-<version> (bookworm's 1.6 has no
# CDI), enable_cdi on its own spec directory (crates/node/dra-driver/tests/cdi_containerd.rs).
source tests/containerd/cdi.sh
start_test_containerd_cdi
export VCUDA_REQUIRE_CONTAINERD=1

# Every test must run here: one that cannot (not root, no unshare, no
# second filesystem at /dev/shm) fails instead of skipping.
export VCUDA_REQUIRE_ALL=1

# await_build <label> <log> <script>: a build started beside the
# downloads (start_build), awaited (its own phase: the time waited); a
# failure shows its log and stops the run.
await_build() {
  log "$1 ($3, started beside the downloads)"
  local rc
  rc=$(status_of "$(build_rc "$3")" "${BUILD_PID[$3]}")
  if [ "$rc" != 0 ]; then
    tail -n 30 "$2" >&2
    echo "tests/run.sh: $3 failed (${rc:+exit }${rc:-killed before it said}; log above)" >&2
    exit 1
  fi
}
await_build "kubernetes 1.20" "$VCUDA_CACHE/k8s-build.log" tests/k8s/build-kubernetes.sh
VCUDA_K8S_BIN=$(tail -n1 "$VCUDA_CACHE/k8s-build.log")
export VCUDA_K8S_BIN
await_build helm "$VCUDA_CACHE/helm-build.log" deploy/helm/build-helm.sh
VCUDA_HELM_BIN=$(tail -n1 "$VCUDA_CACHE/helm-build.log")
export VCUDA_HELM_BIN
await_build "kubernetes 1.37" "$VCUDA_CACHE/k8s-modern-build.log" tests/k8s/build-modern.sh
VCUDA_K8S_MODERN_BIN=$(tail -n1 "$VCUDA_CACHE/k8s-modern-build.log")
export VCUDA_K8S_MODERN_BIN

log "build"
cargo build --workspace --all-targets

log "the shipped interposer"
# The interposer as shipped (deploy/Dockerfile): release, glibc 2.17. Same
# target dir; it lands in target/x86_64-unknown-linux-gnu/release/.
t0=$SECONDS
cargo zigbuild -p cuda-shim --release --target "$GLIBC_217_TARGET"
shipped_interposer="$REPO/target/x86_64-unknown-linux-gnu/release/libvcuda.so"
[ -f "$shipped_interposer" ] || { echo "tests/run.sh: cargo zigbuild left no $shipped_interposer" >&2; exit 1; }
echo "glibc-2.17 interposer built in $((SECONDS - t0)) s"

if [ "$SOAK_RUNS" -gt 0 ]; then
  log "soak"
  source tests/soak.sh
  soak "$SOAK_RUNS" "$SOAK_PATTERN"
  exit 0
fi

log "cargo tests"
# The 1.20 real-node suite (~18 min, mostly waiting on pods: load ~1 of 2
# cores) runs beside every phase that only computes: the other test
# binaries (~10 min, each green 5 of 5 with the other core loaded:
# tests/soak.md), the glibc-2.17 interposer tests, the Python tests and the
# lints. `--skip` keeps it out of the workspace run, and the other test that
# takes the machine lock (dra-driver's cdi_containerd: it would wait the
# suite out) runs after.
start_beside "device-plugin real-node suite on Kubernetes 1.20 (tests/k8s_node)" \
  cargo test -p vcuda-tests --test k8s_node -- --nocapture
# vcuda-tests' tests in a `quiet_host` module time the sim's device against a second
# process (shim_qos): the cluster beside them moved those figures (a batch
# share's 88 % fell to 64 at 924d6db), so they run after it, with no
# cluster up.
run_tests "cargo tests" cargo test --workspace --no-fail-fast -- \
  --skip real_node_suite --skip containerd_injects_the_prepared_cdi_device --skip quiet_host::

log "interposer tests again, on the shipped glibc-2.17 build"
# test-support (crates/testing/test-support/src/shim/simnode.rs) mirrors $VCUDA_INTERPOSER
# instead of this profile's host build: the same memory, compute and graph
# quota tests and entry-point tests, on the library containers actually get;
# and NVIDIA's real nvidia-smi, libcudart and drivers over it (nvidia_real,
# nvidia_oracle: exports and cuGetProcAddress). shim_qos's `quiet_host`
# tests run at the end, once no cluster runs, as the host build's do: their
# tenants run at nice -10, yet beside the 1.20 suite's pods the short-kernel
# batch share fell to 64.4 % of 72 (the host 1.95 of 2 cores busy, 0.30 of
# them the workloads; clean-clone run at 0bc0202, tests/soak.md).
VCUDA_INTERPOSER="$shipped_interposer" run_tests "interposer tests (glibc 2.17)" \
  cargo test -p vcuda-tests --no-fail-fast --test shim_quota --test shim_compute --test shim_qos --test shim_graph --test shim_capture --test shim_entry \
  --test nvidia_real --test nvidia_oracle --test sim_cudart -- --skip quiet_host::

log "python tests"
export VCUDA_TARGET_DIR="$REPO/target/debug"
run_tests "python tests" python3 -m pytest -q tests/python
# NVIDIA's own clients (pynvml, cuda-bindings) and PyTorch on the shipped
# glibc-2.17 build.
log "python clients (glibc 2.17)"
VCUDA_INTERPOSER="$shipped_interposer" run_tests "python clients (glibc 2.17)" \
  python3 -m pytest -q tests/python/test_shim_clients.py tests/python/test_torch.py

log "format and lints"
# The style the code is reviewed in: rustfmt's, and clippy with warnings
# as errors over every target (~3 min on 2 cores after the build).
run_tests "rustfmt" cargo fmt --all --check
run_tests "clippy" cargo clippy -q --workspace --all-targets -- -D warnings

log "the device-plugin real-node suite on Kubernetes 1.20 (its end)"
finish_beside
run_tests "cdi_containerd" cargo test -p dra-driver --test cdi_containerd
run_tests "tests that want a quiet host" cargo test -p vcuda-tests --tests --no-fail-fast -- quiet_host::
VCUDA_INTERPOSER="$shipped_interposer" run_tests "tests that want a quiet host (glibc 2.17)" \
  cargo test -p vcuda-tests --no-fail-fast --test shim_qos -- quiet_host::

log "the DRA real-node suite (Kubernetes 1.37, tests/k8s_dra_node)"
# After the 1.20 suite: the two nodes share /var/lib/kubelet, so one at a
# time. The node's env names the suite's kubeconfig, containerd, kubelet
# restart and reboot commands (tests/k8s/README.md).
bash tests/k8s/cluster-modern.sh down || true
if bash tests/k8s/cluster-modern.sh up; then
  run_tests "DRA real-node suite" bash -c 'source /tmp/vcuda-k8s-modern/env &&
    PATH="$VCUDA_K8S_MODERN_BIN:$PATH" exec cargo test -p vcuda-tests --test k8s_dra_node -- --ignored --nocapture'
else
  failed+=("DRA real-node suite (tests/k8s/cluster-modern.sh up)")
fi
bash tests/k8s/cluster-modern.sh down || failed+=("tests/k8s/cluster-modern.sh down")

log "the device-plugin real-node suite on Kubernetes 1.37"
# The suite the 1.20 node ran, now on the modern node (it brings
# cluster-modern.sh up and down itself: VCUDA_K8S_MODERN=1, test-support's
# k8s::util::Flavor). Last: every phase that computes ran beside the 1.20
# suite.
VCUDA_K8S_MODERN=1 run_tests "device-plugin real-node suite on Kubernetes 1.37 (tests/k8s_node)" \
  cargo test -p vcuda-tests --test k8s_node -- --nocapture
