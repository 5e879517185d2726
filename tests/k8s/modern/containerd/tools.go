//go:build tools

// The commands tests/k8s/build-modern.sh builds, imported so that
// `go mod tidy` keeps every module they need in go.mod and go.sum.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
