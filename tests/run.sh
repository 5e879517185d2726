#!/usr/bin/env bash
# The whole test suite, runnable on a fresh Debian machine as root (what CI
# runs through .ci/run): installs what the tests need, starts a private Docker
# engine on its own socket, builds the workspace once and runs every test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD

log() { printf '\n==> %s\n' "$*"; }

if [ "$(id -u)" != 0 ]; then
  echo "tests/run.sh: run as root: it installs Debian packages, creates device nodes and starts dockerd" >&2
  exit 2
fi

log "system packages"
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
[ -x /bin/busybox ] || need+=(busybox-static)
command -v strace >/dev/null 2>&1 || need+=(strace)
command -v gcc >/dev/null 2>&1 || need+=(gcc)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

log "python packages"
python3 -m pip install -q --disable-pip-version-check -r tests/python/requirements.txt

log "docker engine"
source tests/docker/engine.sh
start_docker_engine
export VCUDA_REQUIRE_DOCKER=1

log "build"
cargo build --workspace --all-targets

log "cargo tests"
cargo test --workspace --no-fail-fast

log "python tests"
export VCUDA_TARGET_DIR="$REPO/target/debug"
python3 -m pytest -q tests/python
