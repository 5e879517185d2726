# Sourced by tests/run.sh, and usable by hand: NVIDIA's real user-space
# driver, the oracle the interposer and the simulator are checked against
# (tests/nvidia_oracle.rs, tests/nvidia/README.md). Debian's `non-free`
# component carries NVIDIA's own binaries; two driver branches:
#
#   bookworm  535.261.03   libcuda1 libnvidia-ml1 nvidia-smi libnvidia-ptxjitcompiler1 nvidia-alternative
#   trixie    550.163.01   the same, plus libcudart12 (CUDA 12.4's runtime)
#
# Each .deb is downloaded once, its SHA256 checked against the suite's
# Packages index, and unpacked (dpkg-deb -x, never installed) into
# $VCUDA_CACHE/nvidia-<suite>-<version>/, a root with Debian's own layout
# (usr/lib/x86_64-linux-gnu/nvidia/current/, usr/lib/nvidia/current/nvidia-smi).
# Nothing on the host changes.
#
#   VCUDA_NVIDIA_MIRROR   default http://deb.debian.org/debian
# Exports VCUDA_NVIDIA_ROOTS: the unpacked roots, colon-separated.

VCUDA_NVIDIA_MIRROR=${VCUDA_NVIDIA_MIRROR:-http://deb.debian.org/debian}

# vcuda_nvidia_root SUITE PACKAGE... : prints the unpacked root, fetching it
# the first time. The directory is keyed by the driver's Debian version.
vcuda_nvidia_root() {
  local suite=$1
  shift
  local cache=${VCUDA_CACHE:-/var/cache/vcuda}
  local have
  have=$(ls -d "$cache/nvidia-$suite-"* 2>/dev/null | grep -v '\.partial$' | sort -V | tail -n1) || true
  if [ -n "$have" ] && [ -f "$have/.complete" ]; then
    echo "$have"
    return 0
  fi
  local tmp index version dir p stanza file sha
  tmp=$(mktemp -d)
  index="$VCUDA_NVIDIA_MIRROR/dists/$suite/non-free/binary-amd64/Packages.xz"
  if ! curl -fsSL --retry 3 -o "$tmp/Packages.xz" "$index"; then
    echo "tests/nvidia/fetch.sh: cannot fetch $index" >&2
    rm -rf "$tmp"
    return 1
  fi
  xz -dc "$tmp/Packages.xz" >"$tmp/Packages"
  version=$(awk '/^Package: libcuda1$/{p=1} p&&/^Version: /{print $2; exit}' "$tmp/Packages")
  if [ -z "$version" ]; then
    echo "tests/nvidia/fetch.sh: no libcuda1 in $suite's non-free index" >&2
    rm -rf "$tmp"
    return 1
  fi
  dir="$cache/nvidia-$suite-$version"
  rm -rf "$dir.partial"
  mkdir -p "$dir.partial"
  for p in "$@"; do
    stanza=$(awk -v P="Package: $p" '$0==P{p=1} p&&/^$/{exit} p' "$tmp/Packages")
    file=$(awk '/^Filename: /{print $2}' <<<"$stanza")
    sha=$(awk '/^SHA256: /{print $2}' <<<"$stanza")
    if [ -z "$file" ] || [ -z "$sha" ]; then
      echo "tests/nvidia/fetch.sh: no $p in $suite's non-free index" >&2
      rm -rf "$tmp" "$dir.partial"
      return 1
    fi
    if ! curl -fsSL --retry 3 -o "$tmp/$p.deb" "$VCUDA_NVIDIA_MIRROR/$file"; then
      echo "tests/nvidia/fetch.sh: cannot download $VCUDA_NVIDIA_MIRROR/$file" >&2
      rm -rf "$tmp" "$dir.partial"
      return 1
    fi
    if [ "$(sha256sum "$tmp/$p.deb" | cut -d' ' -f1)" != "$sha" ]; then
      echo "tests/nvidia/fetch.sh: $file does not match the SHA256 $suite's index gives ($sha)" >&2
      rm -rf "$tmp" "$dir.partial"
      return 1
    fi
    dpkg-deb -x "$tmp/$p.deb" "$dir.partial"
    echo "$p $(awk '/^Version: /{print $2}' <<<"$stanza")" >>"$dir.partial/.packages"
  done
  rm -rf "$tmp"
  touch "$dir.partial/.complete"
  # Renamed when complete: a cut-off run leaves no half copy.
  rm -rf "$dir"
  mv "$dir.partial" "$dir"
  echo "$dir"
}

fetch_nvidia_drivers() {
  local drv="libcuda1 libnvidia-ml1 nvidia-smi libnvidia-ptxjitcompiler1 nvidia-alternative"
  local r535 r550
  # shellcheck disable=SC2086
  r535=$(vcuda_nvidia_root bookworm $drv) || return 1
  # shellcheck disable=SC2086
  r550=$(vcuda_nvidia_root trixie $drv libcudart12) || return 1
  VCUDA_NVIDIA_ROOTS="$r535:$r550"
  export VCUDA_NVIDIA_ROOTS
  echo "NVIDIA user-space drivers: $VCUDA_NVIDIA_ROOTS"
}
