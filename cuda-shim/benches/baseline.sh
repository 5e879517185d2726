#!/usr/bin/env bash
# Builds the interposer of another commit (release), for the overhead
# bench's side-by-side column: prints the path of its libvcuda.so.
#   VCUDA_BENCH_BASELINE=$(bash cuda-shim/benches/baseline.sh dd9e239) \
#     cargo bench -p cuda-shim --bench overhead
# Kept in target/baseline-<sha> (a worktree and its own target dir), so a
# second run of the same commit builds nothing.
set -euo pipefail
ref=${1:?usage: baseline.sh <git ref>}
repo=$(cd "$(dirname "$0")/../.." && pwd)
sha=$(git -C "$repo" rev-parse --short=12 "$ref^{commit}")
dir="$repo/target/baseline-$sha"
if [ ! -f "$dir/target/release/libvcuda.so" ]; then
  [ -d "$dir/src" ] || git -C "$repo" worktree add --detach "$dir/src" "$sha" >&2
  CARGO_TARGET_DIR="$dir/target" cargo build --release -q -p cuda-shim \
    --manifest-path "$dir/src/Cargo.toml" >&2
fi
echo "$dir/target/release/libvcuda.so"
