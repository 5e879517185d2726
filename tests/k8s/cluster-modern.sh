#!/usr/bin/env bash
# A real single-node modern Kubernetes (1.37) cluster on this machine, for
# the DRA real-node suite (tests/k8s_dra_node/main.rs; docs/dra.md,
# "Verifying on a real node"): Debian's etcd, kube-apiserver (Node,RBAC;
# resource.k8s.io/v1, DRAConsumableCapacity on by default),
# kube-controller-manager, kube-scheduler, containerd 2 (CRI, CDI from
# /etc/cdi and /var/run/cdi) with Debian's runc and a CNI bridge, and
# kubelet, all built by tests/k8s/build-modern.sh. The sibling of
# tests/k8s/cluster.sh (the 1.20 node, left as it is): its own directory,
# address (198.51.100.36), ports, bridge, pod CIDR, cgroup root
# (/vcuda-modern) and pod-log directory, so the two share no process,
# socket or port. They do share the kubelet root /var/lib/kubelet (the DRA
# suite and the device plugins' /var/lib/kubelet/device-plugins are fixed
# there) and the manager's and sim's host paths: one of the two nodes per
# mount namespace at a time (tests/k8s/isolated.sh makes one).
#
#   tests/k8s/cluster-modern.sh up      start (idempotent: a running cluster is kept)
#   tests/k8s/cluster-modern.sh down    stop everything it started, unmount, clean
#   tests/k8s/cluster-modern.sh kubelet-restart   stop kubelet and start it again
#   tests/k8s/cluster-modern.sh kubelet-stop | kubelet-start
#   tests/k8s/cluster-modern.sh node-reboot       kubelet and containerd down, every pod process
#                                killed, /run state and /var/run/cdi gone, both up again
#   tests/k8s/cluster-modern.sh scheduler-restart [CONFIG]
#   tests/k8s/cluster-modern.sh node-up K | node-down K   another node (K = 2..9)
#   tests/k8s/cluster-modern.sh import TAR        ctr images import into k8s.io
#   tests/k8s/cluster-modern.sh image-tar TAG ROOTFS OUT ENTRY...
#
# Environment (names of their own: tests/run.sh exports the 1.20 node's
# VCUDA_K8S_BIN):
#   VCUDA_K8S_MODERN_BIN   kubelet, kube-apiserver, kube-scheduler,
#                          kube-controller-manager, kubectl, containerd, ctr,
#                          containerd-shim-runc-v2 (tests/k8s/build-modern.sh
#                          prints it) [default: the newest /var/cache/vcuda/k8s-go-*/bin]
#   VCUDA_K8S_MODERN_DIR   state, logs, certificates [default: /tmp/vcuda-k8s-modern]
#   VCUDA_K8S_MODERN_NODE  node name [default: vcuda-k8s-modern]
# Writes $DIR/admin.kubeconfig and $DIR/env (sourceable: KUBECONFIG and the
# VCUDA_DRA_* variables the DRA suite reads).
# Needs root and Debian's etcd-server, runc, containernetworking-plugins,
# openssl, gcc (libc.a, for the pause binary), curl, iproute2, procps.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
D=${VCUDA_K8S_MODERN_DIR:-/tmp/vcuda-k8s-modern}
CLUSTER=vcuda-k8s-modern
NODE=${VCUDA_K8S_MODERN_NODE:-vcuda-k8s-modern}
NODE_IP=198.51.100.36
API_PORT=36443
ETCD_PORT=23836
KUBELET_PORT=10336
HEALTHZ_PORT=20336
SERVICE_CIDR=10.0.36.0/24
POD_CIDR=10.244.136.0/24
BRIDGE=vcudak8sm0
CGROUP_ROOT=vcuda-modern
POD_CGROUP=$CGROUP_ROOT
KUBELET_ROOT=/var/lib/kubelet
PAUSE_IMAGE=docker.io/vcuda-test/pause:local
TOOLS=(etcd runc openssl gcc curl ip pgrep)
APT="etcd-server runc containernetworking-plugins openssl gcc libc6-dev curl iproute2 procps"
NEEDED_BINS=(kubelet kube-apiserver kube-scheduler kube-controller-manager kubectl containerd ctr containerd-shim-runc-v2)
BUILD_SCRIPT=tests/k8s/build-modern.sh
OLD_APISERVER_FLAGS=()
OLD_COMPONENT_FLAGS=()

log() { printf '[k8s-modern] %s\n' "$*" >&2; }
die() { printf '[k8s-modern] error: %s\n' "$*" >&2; exit 1; }
# shellcheck source=tests/k8s/lib.sh
. "$HERE/lib.sh"

find_bin() {
  if [ -n "${VCUDA_K8S_MODERN_BIN:-}" ]; then echo "$VCUDA_K8S_MODERN_BIN"; return; fi
  local d
  d=$(ls -d /var/cache/vcuda/k8s-go-*/bin 2>/dev/null | sort -V | tail -n1 || true)
  [ -n "$d" ] || die "no Kubernetes binaries: set VCUDA_K8S_MODERN_BIN or run tests/k8s/build-modern.sh"
  echo "$d"
}

# containerd 2's own ctr, built beside it.
ctr_bin() { echo "${BIN:-$(find_bin)}/ctr"; }

versions() {
  echo "$("$BIN/kubelet" --version), containerd $("$BIN/containerd" --version | awk '{print $3}')"
}

# The CDI specs the DRA driver wrote live in tmpfs on a real node.
run_state() { rm -rf /var/run/cdi/*; }

# kubelet's links to this node's container logs
down_more() {
  local l
  for l in /var/log/containers/*.log; do
    [ -L "$l" ] || continue
    case "$(readlink "$l")" in "$D"/*) rm -f "$l" ;; esac
  done
}

# ---------------------------------------------------------------- parts

start_containerd() {
  mkdir -p "$D/containerd"
  # containerd 2's configuration (version 3). CDI is always on in 2.x.
  # The shim by its absolute path: Debian's containerd package (the 1.20
  # node's) puts a 1.x containerd-shim-runc-v2 in /usr/bin.
  cat >"$D/containerd/config.toml" <<EOF
version = 3
root = "$D/containerd/root"
state = "$D/containerd/state"
# opt: no /opt/containerd; nri: no /var/run/nri/nri.sock shared with
# another containerd on the machine.
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.nri.v1.nri"]
[grpc]
  address = "$D/containerd/containerd.sock"
[ttrpc]
  address = "$D/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "$PAUSE_IMAGE"
[plugins."io.containerd.cri.v1.runtime"]
  # This machine withholds CAP_SYS_RESOURCE: no oom_score_adj below the parent's.
  restrict_oom_score_adj = true
  enable_selinux = false
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  # Pod network namespaces under the state directory, not /var/run/netns
  # (which the 1.20 node's down clears).
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "$(readlink -f "$BIN/containerd-shim-runc-v2")"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$D/cni/net.d"
EOF
  write_cni_config
  start containerd env PATH="$BIN:$PATH" "$BIN/containerd" --config "$D/containerd/config.toml"
  wait_for containerd 60 "$D/log/containerd.log" CTR version
  pause_image
}

cgroup_root() {
  local c
  for c in /sys/fs/cgroup/*/; do
    [ -L "${c%/}" ] || mkdir -p "$c$CGROUP_ROOT" 2>/dev/null || true
  done
}

start_kubelet() {
  mkdir -p "$D/log/pods"
  cgroup_root
  # failCgroupV1: this machine's cgroups are v1, which kubelet >= 1.35
  # refuses unless told. cgroupRoot: a tree of its own (the 1.20 node's
  # clean-up empties /kubepods).
  start_kubelet_with "containerRuntimeEndpoint: unix://$D/containerd/containerd.sock
failCgroupV1: false
cgroupRoot: /$CGROUP_ROOT
port: $KUBELET_PORT
podLogsDir: $D/log/pods"
}

write_env() {
  local me="VCUDA_K8S_MODERN_DIR=$D VCUDA_K8S_MODERN_BIN=$BIN VCUDA_K8S_MODERN_NODE=$NODE bash $HERE/cluster-modern.sh"
  cat >"$D/env" <<EOF
export VCUDA_K8S_MODERN_DIR=$D
export VCUDA_K8S_MODERN_BIN=$BIN
export VCUDA_K8S_MODERN_NODE=$NODE
export VCUDA_K8S_MODERN_NODE_IP=$NODE_IP
export VCUDA_K8S_MODERN_API=https://$NODE_IP:$API_PORT
export KUBECONFIG=$D/admin.kubeconfig
export VCUDA_DRA_KUBECONFIG=$D/admin.kubeconfig
export VCUDA_DRA_CONTAINERD=$D/containerd/containerd.sock
export VCUDA_DRA_KUBECTL_DIR=$BIN
export VCUDA_DRA_KUBELET_RESTART="$me kubelet-restart"
export VCUDA_DRA_NODE_REBOOT="$me node-reboot"
EOF
}

# node-up K (K = 2..9): another node of this cluster, for the device-plugin
# suite's three-node phase (tests/k8s_node/phase_nodes.rs), as
# tests/k8s/cluster.sh does it for 1.20: its own address (198.51.100.36+K),
# client certificate, containerd, bridge, pod CIDR (10.244.136+K.0/24),
# ports and cgroup root, and /var/lib/kubelet bound to $D/node-K/kubelet-root
# in a mount namespace of its own (the device-plugin directory is fixed; a
# manager for the node runs there: nsenter --mount --target
# "$(cat $D/run/node-K.pid)").
node_vars() {
  KN="$NODE-$1"
  KIP="198.51.100.$((36 + $1))"
  KD="$D/node-$1"
  KSOCK="$KD/containerd/containerd.sock"
  KBRIDGE="$BRIDGE-$1"
  KCGROUP="$CGROUP_ROOT-node-$1"
}

node_up() {
  local k=$1
  node_vars "$k"
  if running "node-$k"; then return; fi
  node_prepare "$k" "10.244.$((136 + k)).0/24"
  sed -e "s|^port: .*|port: $((KUBELET_PORT + k))|" -e "s|^healthzPort: .*|healthzPort: $((HEALTHZ_PORT + k))|" \
    -e "s|^podCIDR: .*|podCIDR: 10.244.$((136 + k)).0/24|" -e "s|^cgroupRoot: .*|cgroupRoot: /$KCGROUP|" \
    -e "s|$D/containerd|$KD/containerd|g" -e "s|^podLogsDir: .*|podLogsDir: $KD/log/pods|" \
    "$D/kubelet/config.yaml" >"$KD/kubelet.yaml"
  {
    echo 'set -e'
    echo "mount --bind '$KD/kubelet-root' /var/lib/kubelet"
    echo "PATH='$BIN':\$PATH '$BIN/containerd' --config '$KD/containerd/config.toml' >>'$D/log/containerd-$k.log' 2>&1 &"
    echo "echo \$! >'$(pidfile "containerd-$k")'"
    echo "for i in \$(seq 1 60); do [ -S '$KSOCK' ] && break; sleep 1; done"
    echo "'$BIN/ctr' --address '$KSOCK' -n k8s.io images import '$D/pause.tar' >/dev/null 2>&1"
    echo "exec '$BIN/kubelet' --config '$KD/kubelet.yaml' --kubeconfig '$D/kubelet-$k.kubeconfig' \\"
    echo "  --root-dir /var/lib/kubelet --cert-dir '$KD/kubelet/pki' \\"
    echo "  --node-ip '$KIP' --hostname-override '$KN' --v 2"
  } >"$KD/run.sh"
  start "node-$k" unshare --mount --propagation private bash "$KD/run.sh"
  wait_for "node $KN Ready" 180 "$D/log/node-$k.log" node_ready "$KN"
  log "node $KN Ready"
}

command_line "$@"
