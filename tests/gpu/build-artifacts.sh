#!/usr/bin/env bash
# Builds the five files tests/gpu/run.sh needs on a GPU machine (no cargo
# there) against glibc 2.17, as the interposer ships (cuda-shim/README.md,
# "glibc floor"; the GPU machine's glibc may be older than this one's):
# libvcuda.so, vdriver-mirror, examples/test_manager, and the QoS case's
# c/qos_latency and c/shim_compute, all in target/x86_64-unknown-linux-gnu/release. Checks that none needs a glibc
# symbol version above 2.17 and prints the device tool's `carry` list (JSON)
# as its last line.
#
#   bash tests/gpu/build-artifacts.sh
#
# Tools, pinned as tests/run.sh pins them: zig from PyPI's ziglang (the
# linker; installed with pip when `python3 -m ziglang` is missing) and
# cargo-zigbuild (on PATH, else the copy tests/run.sh caches in
# /var/cache/vcuda/cargo-zigbuild-<version>, else built there once).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

ZIGLANG_VERSION=0.15.2
CARGO_ZIGBUILD_VERSION=0.24.1
TARGET=x86_64-unknown-linux-gnu.2.17
OUT=target/x86_64-unknown-linux-gnu/release
FLOOR=2.17
TOOL_FLOOR=2.28
VCUDA_CACHE=${VCUDA_CACHE:-/var/cache/vcuda}

if ! python3 -c 'import ziglang' 2>/dev/null; then
  python3 -m pip install -q --disable-pip-version-check "ziglang==$ZIGLANG_VERSION"
fi
if ! command -v cargo-zigbuild >/dev/null; then
  root="$VCUDA_CACHE/cargo-zigbuild-$CARGO_ZIGBUILD_VERSION"
  if [ ! -x "$root/bin/cargo-zigbuild" ]; then
    cargo install -q --locked cargo-zigbuild --version "$CARGO_ZIGBUILD_VERSION" --root "$root"
  fi
  export PATH="$root/bin:$PATH"
fi

t0=$SECONDS
cargo zigbuild --release --target "$TARGET" -p cuda-shim --lib
cargo zigbuild --release --target "$TARGET" -p vdriver --bin vdriver-mirror
# The registration stand-in hands out QoS pages (memfd_create: glibc 2.27); it
# is a test tool, so its floor is 2.28 (the interposer's stays 2.17).
cargo zigbuild --release --target "${TARGET%.2.17}.$TOOL_FLOOR" -p cuda-shim --example test_manager
# The QoS case's tenants (tests/c, cases_qos.py), linked against the
# interposer as libcuda.so.1 (its soname) with zig's cc at the same floor.
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
ln -s "$PWD/$OUT/libvcuda.so" "$stub/libcuda.so"
mkdir -p "$OUT/c"
for prog in qos_latency shim_compute; do
  python3 -m ziglang cc -target x86_64-linux-gnu.2.17 -O2 -I tests/c "tests/c/$prog.c" \
    -o "$OUT/c/$prog" -L "$stub" -lcuda
done
echo "built in $((SECONDS - t0)) s" >&2

files=("$OUT/libvcuda.so" "$OUT/vdriver-mirror" "$OUT/examples/test_manager" "$OUT/c/qos_latency"
  "$OUT/c/shim_compute")
status=0
for f in "${files[@]}"; do
  [ -f "$f" ] || { echo "build-artifacts.sh: no $f" >&2; exit 1; }
  # Required symbol versions (what ld.so checks): none above the floor.
  floor=$FLOOR
  [ "$f" = "$OUT/examples/test_manager" ] && floor=$TOOL_FLOOR
  newest=$(objdump -p "$f" | awk '/GLIBC_[0-9]/ {print $NF}' | sed 's/GLIBC_//' | sort -V | tail -1)
  if [ -n "$newest" ] && [ "$(printf '%s\n%s\n' "$newest" "$floor" | sort -V | tail -1)" != "$floor" ]; then
    echo "build-artifacts.sh: $f needs GLIBC_$newest (> $floor)" >&2
    status=1
  fi
  printf '%-55s %8d bytes, needs GLIBC_%s\n' "$f" "$(stat -c %s "$f")" "${newest:-none}" >&2
done
[ "$status" = 0 ] || exit 1
# The device tool's `carry` argument (ignored paths, relative to the root).
printf 'carry: ["%s", "%s", "%s", "%s", "%s"]\n' "${files[@]}"
