# Sourced by tests/run.sh after tests/containerd/start.sh (whose image
# helpers it uses), and usable by hand: a SECOND private containerd, Debian
# trixie's 1.7 (bookworm's 1.6 has no CDI), with CDI injection on
# (`enable_cdi`) reading one spec directory of its own. It backs
# crates/node/dra-driver/tests/cdi_containerd.rs: the DRA driver writes its CDI
# specs there and a real runtime injects them.
#
# trixie's containerd .deb is downloaded once (its SHA256 checked against
# trixie's Packages index) and its binaries unpacked, not installed, into
# $VCUDA_CACHE/containerd-<version>/: the system containerd 1.6 the other
# tests use stays as it is. Bookworm's runc (1.1.5) runs its containers.
#
#   VCUDA_CDI_CONTAINERD_DIR   socket, state, root, logs, cdi/
#                              (default /run/vcuda-test-containerd-cdi)
#   VCUDA_TRIXIE_MIRROR        default http://deb.debian.org/debian
# Exports VCUDA_CDI_CONTAINERD_ENDPOINT (unix://.../containerd.sock) and
# VCUDA_CDI_SPEC_DIR (the one directory it reads CDI specs from).

VCUDA_CDI_CONTAINERD_DIR=${VCUDA_CDI_CONTAINERD_DIR:-/run/vcuda-test-containerd-cdi}
VCUDA_TRIXIE_MIRROR=${VCUDA_TRIXIE_MIRROR:-http://deb.debian.org/debian}

# Prints the directory holding trixie's containerd, containerd-shim-runc-v2
# and ctr, fetching and unpacking them the first time.
vcuda_trixie_containerd() {
  local cache=${VCUDA_CACHE:-/var/cache/vcuda}
  local have
  # A cached copy of any version: no network needed on later runs.
  have=$(ls -d "$cache"/containerd-1.7* 2>/dev/null | grep -v '\.partial$' | sort -V | tail -n1) || true
  if [ -n "$have" ] && [ -x "$have/containerd" ] && [ -x "$have/containerd-shim-runc-v2" ] && [ -x "$have/ctr" ]; then
    echo "$have"
    return 0
  fi
  local tmp stanza file sha version dir
  tmp=$(mktemp -d)
  if ! curl -fsSL --retry 3 -o "$tmp/Packages.xz" "$VCUDA_TRIXIE_MIRROR/dists/trixie/main/binary-amd64/Packages.xz"; then
    echo "tests/containerd/cdi.sh: cannot fetch trixie's Packages index from $VCUDA_TRIXIE_MIRROR" >&2
    rm -rf "$tmp"
    return 1
  fi
  stanza=$(xz -dc "$tmp/Packages.xz" | awk '/^Package: containerd$/{p=1} p&&/^$/{exit} p')
  version=$(awk '/^Version: /{print $2}' <<<"$stanza")
  file=$(awk '/^Filename: /{print $2}' <<<"$stanza")
  sha=$(awk '/^SHA256: /{print $2}' <<<"$stanza")
  if [ -z "$version" ] || [ -z "$file" ] || [ -z "$sha" ]; then
    echo "tests/containerd/cdi.sh: no containerd in trixie's Packages index" >&2
    rm -rf "$tmp"
    return 1
  fi
  dir="$cache/containerd-$version"
  if ! curl -fsSL --retry 3 -o "$tmp/containerd.deb" "$VCUDA_TRIXIE_MIRROR/$file"; then
    echo "tests/containerd/cdi.sh: cannot download $VCUDA_TRIXIE_MIRROR/$file" >&2
    rm -rf "$tmp"
    return 1
  fi
  if [ "$(sha256sum "$tmp/containerd.deb" | cut -d' ' -f1)" != "$sha" ]; then
    echo "tests/containerd/cdi.sh: $file does not match the SHA256 trixie's index gives ($sha)" >&2
    rm -rf "$tmp"
    return 1
  fi
  dpkg-deb -x "$tmp/containerd.deb" "$tmp/x"
  # Into .partial, renamed when complete: a cut-off run leaves no half copy.
  rm -rf "$dir.partial"
  mkdir -p "$dir.partial"
  cp "$tmp/x/usr/bin/containerd" "$tmp/x/usr/bin/containerd-shim-runc-v2" "$tmp/x/usr/bin/ctr" "$dir.partial/"
  rm -rf "$tmp"
  if ! "$dir.partial/containerd" --version >/dev/null; then
    echo "tests/containerd/cdi.sh: trixie's containerd $version does not run here" >&2
    return 1
  fi
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
  echo "$dir"
}

vcuda_cdi_ctr() {
  "$VCUDA_CDI_CONTAINERD_BIN/ctr" --address "$VCUDA_CDI_CONTAINERD_DIR/containerd.sock" -n k8s.io "$@"
}

start_test_containerd_cdi() {
  local d=$VCUDA_CDI_CONTAINERD_DIR
  VCUDA_CDI_CONTAINERD_BIN=$(vcuda_trixie_containerd) || return 1
  mkdir -p "$d/cdi"
  export VCUDA_CDI_CONTAINERD_ENDPOINT="unix://$d/containerd.sock"
  export VCUDA_CDI_SPEC_DIR="$d/cdi"
  export VCUDA_CRI_IMAGE
  # CDI: devices named in CreateContainer (the CDI_devices field or
  # cdi.k8s.io/ annotations) are resolved against this directory only.
  vcuda_containerd_up "$d" "$VCUDA_CDI_CONTAINERD_BIN" "  enable_cdi = true
  cdi_spec_dirs = [\"$d/cdi\"]" || return 1
  echo "containerd with CDI ready at $VCUDA_CDI_CONTAINERD_ENDPOINT ($(vcuda_cdi_ctr version 2>/dev/null | awk '/Server/{s=1} s&&/Version/{print $2; exit}')), CDI specs from $VCUDA_CDI_SPEC_DIR"
}

# Stops the containerd start_test_containerd_cdi started (by its pid file).
stop_test_containerd_cdi() {
  local p
  p=$(cat "$VCUDA_CDI_CONTAINERD_DIR/containerd.pid" 2>/dev/null) || return 0
  kill "$p" 2>/dev/null || true
  rm -f "$VCUDA_CDI_CONTAINERD_DIR/containerd.pid"
}
