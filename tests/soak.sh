# Sourced by tests/run.sh for `bash tests/run.sh --soak N [pattern]`: after
# the same set-up and build as a normal run, every integration-test binary
# (or those whose `package/test` name matches the extended regex `pattern`)
# runs N times in a row while a busy loop keeps the other core loaded, and a
# table of passes and times is printed. Flakes that a quiet machine hides
# show up here; a failed run's output is kept in target/test-logs/soak/.
#
# VCUDA_SOAK_HOG=0 runs without the busy loop (when two soaks share the
# machine, each is the other's load).

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

soak() {
  local n=$1 pattern=${2:-.} dir=$TEST_LOGS/soak
  mkdir -p "$dir"
  if [ "${VCUDA_SOAK_HOG:-1}" = 1 ]; then
    # One busy loop: the tests get one core and share the other. Killed
    # by run.sh's exit report if the soak is cut off.
    bash -c 'while :; do :; done' &
    SOAK_HOG=$!
  fi
  local table=() bad=0 pkg test
  while read -r pkg test; do
    [[ "$pkg/$test" =~ $pattern ]] || continue
    local pass=0 times=() i
    for ((i = 1; i <= n; i++)); do
      local t0=$SECONDS log=$dir/$test-$i.log
      if cargo test -q -p "$pkg" --test "$test" >"$log" 2>&1; then
        pass=$((pass + 1))
        rm -f "$log"
      else
        echo "soak: $pkg/$test run $i of $n FAILED; output kept in $log" >&2
        grep -E '^(test .* FAILED|---- |thread .* panicked)' "$log" | head -5 >&2 || true
      fi
      times+=($((SECONDS - t0)))
    done
    local sorted
    sorted=$(printf '%s\n' "${times[@]}" | sort -n | paste -sd' ' -)
    table+=("$(printf '%-32s %d/%d   %s s' "$pkg/$test" "$pass" "$n" "$sorted")")
    echo "${table[-1]}"
    [ "$pass" = "$n" ] || bad=$((bad + 1))
  done < <(soak_targets)
  printf '\n==> soak: %d runs of each binary%s\n' "$n" "${SOAK_HOG:+, the other core busy}"
  printf '%s\n' "${table[@]}"
  if [ "$bad" -gt 0 ]; then
    failed+=("soak: $bad binaries failed at least once (target/test-logs/soak)")
  fi
}
