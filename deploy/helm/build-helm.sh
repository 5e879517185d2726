#!/usr/bin/env bash
# Builds the helm CLI from its Go module (helm.sh/helm/v3) for the chart's
# tests (tests/deploy/helm.rs: `helm lint`, `helm template`), cached outside
# the checkout, keyed by the helm version:
#   ${VCUDA_HELM_CACHE:-/var/cache/vcuda}/helm-<version>/bin/helm
# with Go's module and build caches beside it (go/mod, and go/build-<go
# version>, so a new Go never reuses an old one's objects). A warm machine
# does nothing here. Prints the bin directory on the last line.
#
# Helm 3, not 4: the chart is apiVersion v2, which both read; Helm 3 is what
# most clusters' tooling runs today, and its `lint`/`template` are all the
# tests use.
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-3.22.0}
CACHE_ROOT=${VCUDA_HELM_CACHE:-/var/cache/vcuda}
DEST="$CACHE_ROOT/helm-$HELM_VERSION"

log() { printf '[helm-build] %s\n' "$*" >&2; }

if [ -x "$DEST/bin/helm" ]; then
  log "cached: $DEST/bin"
  echo "$DEST/bin"
  exit 0
fi

command -v go >/dev/null 2>&1 || { log "needs Go (https://go.dev/dl/, or apt-get install golang)"; exit 1; }
GO_VERSION=$(go env GOVERSION)
export GOMODCACHE="$CACHE_ROOT/go/mod"
export GOCACHE="$CACHE_ROOT/go/build-$GO_VERSION"
export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0
mkdir -p "$GOMODCACHE" "$GOCACHE"

WORK=$(mktemp -d "$CACHE_ROOT/helm-build.XXXXXX")
trap 'rm -rf --one-file-system "$WORK"' EXIT
t0=$SECONDS
log "go mod download helm.sh/helm/v3@v$HELM_VERSION ($GO_VERSION)"
# The versions helm's own Makefile stamps in: its version, and the
# Kubernetes version `helm template` assumes without --kube-version (that of
# the client-go it is built with; unstamped it would say 1.20).
GOMOD=$(go mod download -json "helm.sh/helm/v3@v$HELM_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p')
[ -f "$GOMOD" ] || { log "no go.mod for helm v$HELM_VERSION"; exit 1; }
CLIENT_GO=$(awk '$1 == "k8s.io/client-go" { print $2; exit }' "$GOMOD")
K8S_MINOR=$(echo "$CLIENT_GO" | sed -n 's/^v0\.\([0-9]*\)\..*/\1/p')
[ -n "$K8S_MINOR" ] || { log "no k8s.io/client-go in $GOMOD"; exit 1; }
LDFLAGS="-s -w -X helm.sh/helm/v3/internal/version.version=v$HELM_VERSION"
LDFLAGS="$LDFLAGS -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  LDFLAGS="$LDFLAGS -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$K8S_MINOR"
done
log "go install helm.sh/helm/v3/cmd/helm@v$HELM_VERSION (client-go $CLIENT_GO)"
GOBIN="$WORK/bin" go install -trimpath -ldflags "$LDFLAGS" "helm.sh/helm/v3/cmd/helm@v$HELM_VERSION"
"$WORK/bin/helm" version --short >&2
# Renamed into place when complete: a cut-off build never leaves a helm
# that later runs would take for a good one.
mkdir -p "$DEST"
rm -rf --one-file-system "$DEST/bin"
mv "$WORK/bin" "$DEST/bin"
log "built in $((SECONDS - t0)) s: $DEST/bin"
echo "$DEST/bin"
