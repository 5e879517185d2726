# Sourced by tests/run.sh for `bash tests/run.sh --soak N [pattern]`: after
# the same set-up and build as a normal run, every integration-test binary
# (or those whose `package/test` name matches the extended regex `pattern`)
# runs N times in a row with the other core loaded, and a table of passes
# and times is printed. Flakes that a quiet machine hides show up here; a
# failed run's output is kept in target/test-logs/soak/.
#
# Two streams run side by side, each the other's load: the binaries that
# take the machine lock (the real-node suite, the longest by far, and
# cdi_containerd, which makes host /dev/nvidia* nodes) and every other
# binary. When one stream ends, a busy loop takes its core until the other
# ends too.

# Every `package test` pair of the workspace's integration tests, the
# #[ignore]d-only ones (k8s_dra_node: a node you bring up) left out.
soak_targets() {
  cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    for t in p["targets"]:
        if "test" in t["kind"] and t["name"] != "k8s_dra_node":
            print(p["name"], t["name"])
' | sort
}

# soak_stream N DIR < "package test" lines: each binary N times; one table
# line per binary on stdout ("package/test  passes/N  times").
soak_stream() {
  local n=$1 dir=$2 pkg test
  while read -r pkg test; do
    local pass=0 times=() i
    # Built first, untimed: `-p` resolves features for that package alone,
    # so a binary can need a build the workspace build did not make.
    cargo test -q -p "$pkg" --test "$test" --no-run </dev/null >/dev/null 2>&1 || true
    for ((i = 1; i <= n; i++)); do
      local t0=$SECONDS log=$dir/$test-$i.log
      if cargo test -q -p "$pkg" --test "$test" </dev/null >"$log" 2>&1; then
        pass=$((pass + 1))
        rm -f "$log"
      else
        {
          echo "soak: $pkg/$test run $i of $n FAILED; output kept in $log"
          grep -E '^(test .* FAILED|---- |thread .* panicked)' "$log" | head -5 || true
        } >&2
      fi
      times+=($((SECONDS - t0)))
    done
    printf '%-32s %d/%d   %s s\n' "$pkg/$test" "$pass" "$n" \
      "$(printf '%s\n' "${times[@]}" | sort -n | paste -sd' ' -)"
  done
}

soak() {
  local n=$1 pattern=${2:-.} dir=$TEST_LOGS/soak
  mkdir -p "$dir"
  local all
  all=$(soak_targets | while read -r pkg test; do
    if [[ "$pkg/$test" =~ $pattern ]]; then echo "$pkg $test"; fi
  done)
  [ -n "$all" ] || { failed+=("soak: no test binary matches '$pattern'"); return; }
  local long rest
  local locked=' (k8s_node|cdi_containerd)$'
  long=$(grep -E "$locked" <<<"$all" || true)
  rest=$(grep -vE "$locked" <<<"$all" || true)
  local pids=()
  if [ -n "$long" ]; then
    soak_stream "$n" "$dir" <<<"$long" | tee "$dir/long.table" &
    pids+=($!)
  fi
  if [ -n "$rest" ]; then
    soak_stream "$n" "$dir" <<<"$rest" | tee "$dir/rest.table" &
    pids+=($!)
  fi
  # Killed by run.sh's exit report if the soak is cut off.
  if [ ${#pids[@]} = 2 ]; then wait -n "${pids[@]}" || true; fi
  bash -c 'while :; do :; done' &
  SOAK_HOG=$!
  wait "${pids[@]}" || true
  kill "$SOAK_HOG" 2>/dev/null || true
  printf '\n==> soak: %d runs of each binary, the other core loaded\n' "$n"
  cat "$dir"/*.table | sort
  local bad
  bad=$(cat "$dir"/*.table | awk '{ split($2, r, "/"); if (r[1] != r[2]) print $1 }' | paste -sd, - | sed 's/,/, /g')
  if [ -n "$bad" ]; then
    failed+=("soak: failed at least once: $bad (target/test-logs/soak)")
  fi
}
