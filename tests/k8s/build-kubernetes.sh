#!/usr/bin/env bash
# Builds kubelet, kube-apiserver, kube-scheduler, kube-controller-manager and
# kubectl # from Debian bookworm's source package `kubernetes` (the upstream tree with
# vendor/) using Debian's golang-1.19-go in GOPATH mode, offline. The binaries
# are cached outside the checkout, keyed by the package version:
#   ${VCUDA_K8S_CACHE:-/var/cache/vcuda}/k8s-<version>/bin/
# A warm machine does nothing here. Prints the bin directory on the last line.
# Run as root (apt-get).
set -euo pipefail

K8S_SRC_VERSION=${K8S_SRC_VERSION:-1.20.5+really1.20.2-1.1+deb12u1}
CACHE_ROOT=${VCUDA_K8S_CACHE:-/var/cache/vcuda}
DEST="$CACHE_ROOT/k8s-$K8S_SRC_VERSION"
BINS=(kubelet kube-apiserver kube-scheduler kube-controller-manager kubectl)

log() { printf '[k8s-build] %s\n' "$*" >&2; }

have_all() {
  for b in "${BINS[@]}"; do [ -x "$DEST/bin/$b" ] || return 1; done
}

if have_all; then
  log "cached: $DEST/bin"
  echo "$DEST/bin"
  exit 0
fi

export DEBIAN_FRONTEND=noninteractive
need=()
[ -x /usr/lib/go-1.19/bin/go ] || need+=(golang-1.19-go)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v dpkg-source >/dev/null 2>&1 || need+=(dpkg-dev)
command -v make >/dev/null 2>&1 || need+=(make)
command -v gcc >/dev/null 2>&1 || need+=(gcc)
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The source package through a deb-src line for bookworm on Debian's usual
# mirror, in a private apt configuration (the system's sources stay as they are).
APTDIR="$CACHE_ROOT/apt-src"
mkdir -p "$APTDIR/lists/partial"
cat >"$APTDIR/sources.list" <<'SRC'
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-updates main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
SRC
APT_SRC_OPTS=(-o "Dir::Etc::SourceList=$APTDIR/sources.list" -o "Dir::Etc::SourceParts=-"
  -o "Dir::State::Lists=$APTDIR/lists" -o "APT::Get::List-Cleanup=0")
apt-get "${APT_SRC_OPTS[@]}" update -qq

WORK=$(mktemp -d "$CACHE_ROOT/build.XXXXXX" 2>/dev/null || { mkdir -p "$CACHE_ROOT"; mktemp -d "$CACHE_ROOT/build.XXXXXX"; })
trap 'rm -rf "$WORK"' EXIT
log "fetching source package kubernetes=$K8S_SRC_VERSION into $WORK"
(cd "$WORK" && apt-get "${APT_SRC_OPTS[@]}" source -qq --only-source "kubernetes=$K8S_SRC_VERSION" >/dev/null)
SRCDIR=$(find "$WORK" -mindepth 1 -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)
[ -n "$SRCDIR" ] || { log "apt-get source produced no kubernetes-* directory"; exit 1; }

export GOPATH="$WORK/gopath"
mkdir -p "$GOPATH/src/k8s.io"
ln -s "$SRCDIR" "$GOPATH/src/k8s.io/kubernetes"
export PATH=/usr/lib/go-1.19/bin:$PATH
export GO111MODULE=off GOFLAGS=-mod=vendor GOCACHE="$WORK/gocache" GOPROXY=off
unset GOFLAGS
cd "$GOPATH/src/k8s.io/kubernetes"
log "make generated_files ($(go version))"
make generated_files >"$WORK/generated.log" 2>&1 || { tail -n 40 "$WORK/generated.log" >&2; exit 1; }
# The version the binaries report (node.status.nodeInfo.kubeletVersion,
# /version), as hack/lib/version.sh sets it: the upstream release inside
# the Debian version ("+really1.20.2").
UPSTREAM=${K8S_SRC_VERSION##*really}
UPSTREAM=${UPSTREAM%%-*}
MAJOR=${UPSTREAM%%.*}
MINOR=${UPSTREAM#*.}
MINOR=${MINOR%%.*}
LDFLAGS=""
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  v="k8s.io/kubernetes/vendor/$pkg"
  LDFLAGS="$LDFLAGS -X $v.gitVersion=v$UPSTREAM -X $v.gitMajor=$MAJOR -X $v.gitMinor=$MINOR"
  LDFLAGS="$LDFLAGS -X $v.gitTreeState=archive -X $v.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
done
# One `go build` for every binary missing: its links run side by side (one
# at a time they left a core idle for minutes on a fresh machine), and -s -w
# leaves out the symbol table and DWARF nobody reads here (as
# build-modern.sh does); panics still print their stacks.
mkdir -p "$DEST/bin" "$WORK/out"
pkgs=()
for b in "${BINS[@]}"; do
  [ -x "$DEST/bin/$b" ] || pkgs+=("./cmd/$b")
done
log "go build ${pkgs[*]##*/} (v$UPSTREAM)"
go build -ldflags "-s -w $LDFLAGS" -o "$WORK/out/" "${pkgs[@]}"
for p in "${pkgs[@]}"; do
  mv "$WORK/out/${p##*/}" "$DEST/bin/${p##*/}"
done
log "built: $DEST/bin"
echo "$DEST/bin"
