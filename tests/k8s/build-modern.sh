#!/usr/bin/env bash
# Builds a modern Kubernetes node's binaries from Go modules (the DRA
# real-node suite, tests/k8s_dra_node, needs Kubernetes >= 1.34 and a
# containerd with CDI; Debian has neither):
#   kubelet, kube-apiserver, kube-scheduler, kube-controller-manager, kubectl
#     from k8s.io/kubernetes (tests/k8s/modern/go.mod pins the release and
#     its staging modules),
#   containerd, ctr, containerd-shim-runc-v2
#     from github.com/containerd/containerd/v2 (tests/k8s/modern/containerd/go.mod).
# Static (CGO_ENABLED=0), -trimpath, stripped, the version stamped the way
# the upstream release does (hack/lib/version.sh; the containerd Makefile).
# Cached outside the checkout, keyed by the versions in those go.mod files:
#   ${VCUDA_K8S_CACHE:-/var/cache/vcuda}/k8s-go-<k8s version>/bin/        Kubernetes
#   ${VCUDA_K8S_CACHE:-/var/cache/vcuda}/containerd-go-<version>/bin/      containerd
# and containerd's three linked into the first, so that one directory holds
# the node's binaries. Go's module cache and build cache live in
# $CACHE/go/mod and $CACHE/go/build-<go version>. A warm machine does
# nothing here. Prints the bin directory on the last line.
# Needs go >= 1.26.6 on PATH (GOTOOLCHAIN=local: no toolchain download) and
# the Go module proxy (or a warm module cache). Cold: about 35 min on 2
# busy cores, 1 min of it downloading (tests/k8s/README.md).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MOD="$HERE/modern"
CACHE_ROOT=${VCUDA_K8S_CACHE:-/var/cache/vcuda}
K8S_BINS=(kubelet kube-apiserver kube-scheduler kube-controller-manager kubectl)
CD_BINS=(containerd ctr containerd-shim-runc-v2)

log() { printf '[k8s-build-modern] %s\n' "$*" >&2; }
die() { printf '[k8s-build-modern] error: %s\n' "$*" >&2; exit 1; }

# modver GOMOD MODULE: the version GOMOD requires of MODULE.
modver() {
  awk -v m="$2" '$1 == m && $2 ~ /^v/ {print $2; exit} $1 == "require" && $2 == m {print $3; exit}' "$1"
}
K8S_V=$(modver "$MOD/go.mod" k8s.io/kubernetes)
CD_V=$(modver "$MOD/containerd/go.mod" github.com/containerd/containerd/v2)
[ -n "$K8S_V" ] && [ -n "$CD_V" ] || die "no k8s.io/kubernetes or containerd version in $MOD"
DEST="$CACHE_ROOT/k8s-go-${K8S_V#v}"
CD_DEST="$CACHE_ROOT/containerd-go-${CD_V#v}"

have_all() {
  local b
  for b in "${K8S_BINS[@]}"; do [ -x "$DEST/bin/$b" ] || return 1; done
  for b in "${CD_BINS[@]}"; do
    [ -x "$CD_DEST/bin/$b" ] || return 1
    [ "$(readlink "$DEST/bin/$b" 2>/dev/null)" = "$CD_DEST/bin/$b" ] || return 1
  done
}

if have_all; then
  log "cached: $DEST/bin (Kubernetes $K8S_V, containerd $CD_V)"
  echo "$DEST/bin"
  exit 0
fi

command -v go >/dev/null 2>&1 || die "no go on PATH (Go >= 1.26.6: /usr/local/go/bin)"
GO_V=$(go env GOVERSION)
export GOTOOLCHAIN=local
export CGO_ENABLED=0
export GOFLAGS="-mod=mod -buildvcs=false"
export GOMODCACHE="$CACHE_ROOT/go/mod"
export GOCACHE="$CACHE_ROOT/go/build-$GO_V"
mkdir -p "$GOMODCACHE" "$GOCACHE" "$DEST/bin" "$CD_DEST/bin"

WORK=$(mktemp -d "$CACHE_ROOT/build-go.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS

# Kubernetes: the version hack/lib/version.sh would stamp for the tag.
ver=${K8S_V#v}
MAJOR=${ver%%.*}
MINOR=${ver#*.}
MINOR=${MINOR%%.*}
DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)
LDFLAGS="-s -w"
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  LDFLAGS="$LDFLAGS -X $pkg.gitVersion=$K8S_V -X $pkg.gitMajor=$MAJOR -X $pkg.gitMinor=$MINOR"
  LDFLAGS="$LDFLAGS -X $pkg.gitTreeState=clean -X $pkg.buildDate=$DATE"
done
pkgs=()
for b in "${K8S_BINS[@]}"; do
  [ -x "$DEST/bin/$b" ] || pkgs+=("k8s.io/kubernetes/cmd/$b")
done
if [ ${#pkgs[@]} -gt 0 ]; then
  log "go build ${pkgs[*]##*/} (Kubernetes $K8S_V, $GO_V)"
  (cd "$MOD" && go build -trimpath -tags selinux,notest -ldflags "$LDFLAGS" -o "$WORK/" "${pkgs[@]}")
  for p in "${pkgs[@]}"; do mv "$WORK/${p##*/}" "$DEST/bin/"; done
fi

# containerd 2
CD_PKG=github.com/containerd/containerd/v2
CD_LDFLAGS="-s -w -X $CD_PKG/version.Version=$CD_V -X $CD_PKG/version.Package=$CD_PKG -X $CD_PKG/version.Revision=module"
pkgs=()
for b in "${CD_BINS[@]}"; do
  [ -x "$CD_DEST/bin/$b" ] || pkgs+=("$CD_PKG/cmd/$b")
done
if [ ${#pkgs[@]} -gt 0 ]; then
  log "go build ${pkgs[*]##*/} (containerd $CD_V, $GO_V)"
  (cd "$MOD/containerd" && go build -trimpath -ldflags "$CD_LDFLAGS" -o "$WORK/" "${pkgs[@]}")
  for p in "${pkgs[@]}"; do mv "$WORK/${p##*/}" "$CD_DEST/bin/"; done
fi
for b in "${CD_BINS[@]}"; do ln -sfn "$CD_DEST/bin/$b" "$DEST/bin/$b"; done

have_all || die "built, yet $DEST/bin is incomplete"
log "built in $((SECONDS - t0)) s: $DEST/bin ($(du -shL "$DEST/bin" | cut -f1))"
echo "$DEST/bin"
