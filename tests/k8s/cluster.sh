#!/usr/bin/env bash
# A real single-node Kubernetes 1.20 cluster on this machine, for the
# real-node suite (tests/k8s_node/main.rs): etcd, kube-apiserver (Node,RBAC),
# kube-controller-manager, kube-scheduler, containerd (CRI) with runc and a
# CNI bridge, and kubelet. Everything lives in $VCUDA_K8S_DIR except what
# kubelet 1.20 fixes: /var/lib/kubelet (its device-plugin directory is always
# /var/lib/kubelet/device-plugins) and an address on lo.
#
#   tests/k8s/cluster.sh up      start (idempotent: a running cluster is kept)
#   tests/k8s/cluster.sh down    stop everything it started, unmount, clean
#   tests/k8s/cluster.sh kubelet-restart   stop kubelet and start it again
#   tests/k8s/cluster.sh kubelet-stop | kubelet-start
#   tests/k8s/cluster.sh node-reboot       kubelet and containerd down, every pod process killed, /run state gone, both up again
#   tests/k8s/cluster.sh import TAR        ctr images import into k8s.io
#
# Environment:
#   VCUDA_K8S_BIN   kubelet, kube-apiserver, kube-scheduler,
#                   kube-controller-manager, kubectl (tests/k8s/build-kubernetes.sh
#                   prints it) [default: the newest /var/cache/vcuda/k8s-*/bin]
#   VCUDA_K8S_DIR   state, logs, certificates [default: /tmp/vcuda-k8s]
#   VCUDA_K8S_NODE  node name [default: vcuda-k8s-node]
# Writes $VCUDA_K8S_DIR/admin.kubeconfig and $VCUDA_K8S_DIR/env (sourceable).
# Needs root and Debian's etcd-server, containerd, runc,
# containernetworking-plugins, openssl and gcc (libc.a, for the pause binary).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
D=${VCUDA_K8S_DIR:-/tmp/vcuda-k8s}
CLUSTER=vcuda-k8s
NODE=${VCUDA_K8S_NODE:-vcuda-k8s-node}
NODE_IP=198.51.100.1
API_PORT=26443
ETCD_PORT=23790
HEALTHZ_PORT=20248
SERVICE_CIDR=10.0.0.0/24
POD_CIDR=10.244.77.0/24
BRIDGE=vcudak8s0
POD_CGROUP=kubepods
KUBELET_ROOT=/var/lib/kubelet
PAUSE_IMAGE=docker.io/vcuda-test/pause:local
TOOLS=(etcd containerd runc ctr openssl gcc curl ip pgrep)
APT="etcd-server containerd runc containernetworking-plugins openssl gcc libc6-dev curl iproute2 procps"
NEEDED_BINS=(kubelet kube-apiserver kube-scheduler kube-controller-manager kubectl)
BUILD_SCRIPT=tests/k8s/build-kubernetes.sh
OLD_APISERVER_FLAGS=(--insecure-port 0)
OLD_COMPONENT_FLAGS=(--port 0)

log() { printf '[k8s-cluster] %s\n' "$*" >&2; }
die() { printf '[k8s-cluster] error: %s\n' "$*" >&2; exit 1; }
# shellcheck source=tests/k8s/lib.sh
. "$HERE/lib.sh"

find_bin() {
  if [ -n "${VCUDA_K8S_BIN:-}" ]; then echo "$VCUDA_K8S_BIN"; return; fi
  local d
  # k8s-1.*: the modern node's builds are k8s-go-*.
  d=$(ls -d /var/cache/vcuda/k8s-1.*/bin 2>/dev/null | sort -V | tail -n1 || true)
  [ -n "$d" ] || die "no Kubernetes binaries: set VCUDA_K8S_BIN or run tests/k8s/build-kubernetes.sh"
  echo "$d"
}

# Debian's containerd 1.6/1.7 and its ctr.
ctr_bin() { echo ctr; }

versions() { "$BIN/kubelet" --version; }

run_state() { :; }

down_more() {
  local ns
  for ns in /var/run/netns/cni-*; do
    [ -e "$ns" ] || continue
    umount "$ns" 2>/dev/null || true
    rm -f "$ns"
  done
}

# ---------------------------------------------------------------- parts

start_containerd() {
  mkdir -p "$D/containerd"
  cat >"$D/containerd/config.toml" <<EOF
version = 2
root = "$D/containerd/root"
state = "$D/containerd/state"
disabled_plugins = ["io.containerd.internal.v1.opt"]
[grpc]
  address = "$D/containerd/containerd.sock"
[ttrpc]
  address = "$D/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # This machine withholds CAP_SYS_RESOURCE: no oom_score_adj below the parent's.
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$D/cni/net.d"
EOF
  write_cni_config
  start containerd containerd --config "$D/containerd/config.toml"
  wait_for containerd 60 "$D/log/containerd.log" CTR version
  pause_image
}

start_kubelet() {
  start_kubelet_with "" \
    --container-runtime remote --container-runtime-endpoint "unix://$D/containerd/containerd.sock"
}

write_env() {
  cat >"$D/env" <<EOF
export VCUDA_K8S_DIR=$D
export VCUDA_K8S_BIN=$BIN
export VCUDA_K8S_NODE=$NODE
export VCUDA_K8S_NODE_IP=$NODE_IP
export VCUDA_K8S_API=https://$NODE_IP:$API_PORT
export VCUDA_K8S_CONTAINERD=$D/containerd/containerd.sock
export KUBECONFIG=$D/admin.kubeconfig
EOF
}

# ---------------------------------------------------------------- more nodes
# node-up K (K = 2..9): another node of the same cluster, $NODE-K at
# 198.51.100.K, with its own client certificate, containerd (socket, root,
# state in $D/node-K), CNI bridge (vcudak8sK, 10.244.(77+K).0/24), cgroup
# root (/vcuda-node-K: kubelets sharing one cgroupfs tree would remove each
# other's pod cgroups) and kubelet ports (10250+K, healthz 20248+K). Its
# containerd and kubelet run in a mount namespace of their own where
# /var/lib/kubelet is $D/node-K/kubelet-root: kubelet 1.20's device-plugin
# directory is fixed, and containerd must see the pods' volumes where that
# kubelet put them. A manager for the node runs in the same namespace
# (nsenter --mount --target "$(cat $D/run/node-K.pid)").
node_vars() {
  KN="$NODE-$1"
  KIP="198.51.100.$1"
  KD="$D/node-$1"
  KSOCK="$KD/containerd/containerd.sock"
  KBRIDGE="vcudak8s$1"
  KCGROUP="vcuda-node-$1"
}

node_up() {
  local k=$1
  node_vars "$k"
  if running "node-$k"; then return; fi
  node_prepare "$k" "10.244.$((77 + k)).0/24"
  sed -e "s|^healthzPort: .*|healthzPort: $((20248 + k))|" -e "s|^podCIDR: .*|podCIDR: 10.244.$((77 + k)).0/24|" \
    "$D/kubelet/config.yaml" >"$KD/kubelet.yaml"
  printf 'port: %s\ncgroupRoot: /%s\n' "$((10250 + k))" "$KCGROUP" >>"$KD/kubelet.yaml"
  {
    echo 'set -e'
    echo "mount --bind '$KD/kubelet-root' /var/lib/kubelet"
    echo "containerd --config '$KD/containerd/config.toml' >>'$D/log/containerd-$k.log' 2>&1 &"
    echo "echo \$! >'$(pidfile "containerd-$k")'"
    echo "for i in \$(seq 1 60); do [ -S '$KSOCK' ] && break; sleep 1; done"
    echo "ctr --address '$KSOCK' -n k8s.io images import '$D/pause.tar' >/dev/null"
    echo "exec '$BIN/kubelet' --config '$KD/kubelet.yaml' --kubeconfig '$D/kubelet-$k.kubeconfig' \\"
    echo "  --container-runtime remote --container-runtime-endpoint 'unix://$KSOCK' \\"
    echo "  --root-dir /var/lib/kubelet --cert-dir '$KD/kubelet/pki' \\"
    echo "  --node-ip '$KIP' --hostname-override '$KN' --v 2"
  } >"$KD/run.sh"
  start "node-$k" unshare --mount --propagation private bash "$KD/run.sh"
  wait_for "node $KN Ready" 180 "$D/log/node-$k.log" node_ready "$KN"
  log "node $KN Ready"
}

command_line "$@"
