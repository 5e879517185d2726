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
# there): one of the two nodes per mount namespace at a time.
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
KUBELET_ROOT=/var/lib/kubelet
PAUSE_IMAGE=docker.io/vcuda-test/pause:local

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




need_tools() {
  local missing=()
  for t in etcd runc openssl gcc curl ip pgrep; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
  done
  [ -x /usr/lib/cni/bridge ] || missing+=("/usr/lib/cni/bridge (containernetworking-plugins)")
  [ ${#missing[@]} -eq 0 ] || die "missing: ${missing[*]} (apt-get install etcd-server runc containernetworking-plugins openssl gcc libc6-dev curl iproute2 procps)"
}

# ---------------------------------------------------------------- PKI


pki() {
  mkdir -p "$D/pki"
  if [ ! -f "$D/pki/ca.crt" ]; then
    openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$D/pki/ca.key" -days 365 \
      -subj "/CN=vcuda-k8s-modern-ca" -out "$D/pki/ca.crt" 2>/dev/null
  fi
  [ -f "$D/pki/sa.key" ] || {
    openssl genrsa -out "$D/pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$D/pki/sa.key" -pubout -out "$D/pki/sa.pub" 2>/dev/null
  }
  cert apiserver kube-apiserver "" \
    "IP:$NODE_IP,IP:127.0.0.1,IP:${SERVICE_CIDR%.0/*}.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  cert admin admin system:masters
  cert apiserver-kubelet apiserver-kubelet-client system:masters
  cert kubelet "system:node:$NODE" system:nodes
  cert controller-manager system:kube-controller-manager ""
  cert scheduler system:kube-scheduler ""
  kubeconfig admin
  kubeconfig kubelet
  kubeconfig controller-manager
  kubeconfig scheduler
}

# ---------------------------------------------------------------- images

CTR() { "$BIN/ctr" --address "$D/containerd/containerd.sock" "$@"; }

import_image() { # import_image TAR [CONTAINERD_SOCKET]
  "$BIN/ctr" --address "${2:-$D/containerd/containerd.sock}" -n k8s.io images import "$1" >/dev/null
}

pause_image() {
  # (ctr 2.x warns on stderr that cgroup v1 is deprecated, every call)
  if CTR -n k8s.io images ls -q 2>/dev/null | grep -qx "$PAUSE_IMAGE"; then
    return
  fi
  local tmp
  tmp=$(mktemp -d)
  mkdir -p "$tmp/rootfs"
  cat >"$tmp/pause.c" <<'EOF'
#include <signal.h>
#include <unistd.h>
static void quit(int s) { (void)s; _exit(0); }
int main(void) {
  signal(SIGINT, quit);
  signal(SIGTERM, quit);
  for (;;) pause();
}
EOF
  gcc -static -O2 -o "$tmp/rootfs/pause" "$tmp/pause.c"
  image_tar "$PAUSE_IMAGE" "$tmp/rootfs" "$tmp/pause.tar" /pause
  import_image "$tmp/pause.tar"
  # Kept for the nodes node-up adds.
  cp "$tmp/pause.tar" "$D/pause.tar"
  rm -rf "$tmp"
}

# ---------------------------------------------------------------- parts

start_etcd() {
  start etcd etcd --name vcuda-k8s-modern --data-dir "$D/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" \
    --initial-cluster "vcuda-k8s-modern=http://127.0.0.1:$((ETCD_PORT + 10))" \
    --listen-metrics-urls "" --log-level warn
  wait_for etcd 60 "$D/log/etcd.log" curl -sf "http://127.0.0.1:$ETCD_PORT/health"
}

start_apiserver() {
  start kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$NODE_IP" --advertise-address "$NODE_IP" --secure-port "$API_PORT" \
    --service-cluster-ip-range "$SERVICE_CIDR" \
    --client-ca-file "$D/pki/ca.crt" \
    --tls-cert-file "$D/pki/apiserver.crt" --tls-private-key-file "$D/pki/apiserver.key" \
    --kubelet-client-certificate "$D/pki/apiserver-kubelet.crt" \
    --kubelet-client-key "$D/pki/apiserver-kubelet.key" \
    --kubelet-preferred-address-types InternalIP,Hostname \
    --service-account-key-file "$D/pki/sa.pub" \
    --service-account-signing-key-file "$D/pki/sa.key" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --authorization-mode Node,RBAC \
    --enable-admission-plugins NodeRestriction \
    --allow-privileged=true \
    --cert-dir "$D/pki/apiserver-certs" \
    --v 1
  wait_for kube-apiserver 180 "$D/log/kube-apiserver.log" \
    "$BIN/kubectl" --kubeconfig "$D/admin.kubeconfig" get --raw /readyz
}

start_controllers() {
  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig "$D/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$D/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$D/controller-manager.kubeconfig" \
    --service-account-private-key-file "$D/pki/sa.key" \
    --root-ca-file "$D/pki/ca.crt" \
    --use-service-account-credentials=true \
    --leader-elect=false --secure-port 0 --v 1
  start_scheduler ""
}

# start_scheduler CONFIG: kube-scheduler with its flags, or with the
# KubeSchedulerConfiguration file CONFIG (its clientConnection and
# leaderElection then come from the file).
start_scheduler() {
  local config=$1
  if [ -z "$config" ]; then
    start kube-scheduler "$BIN/kube-scheduler" \
      --kubeconfig "$D/scheduler.kubeconfig" \
      --authentication-kubeconfig "$D/scheduler.kubeconfig" \
      --authorization-kubeconfig "$D/scheduler.kubeconfig" \
      --leader-elect=false --secure-port 0 --v 1
  else
    start kube-scheduler "$BIN/kube-scheduler" --config "$config" \
      --authentication-kubeconfig "$D/scheduler.kubeconfig" \
      --authorization-kubeconfig "$D/scheduler.kubeconfig" \
      --secure-port 0 --v 2
  fi
}

start_containerd() {
  mkdir -p "$D/containerd" "$D/cni/net.d" "$D/cni/ipam"
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
  cat >"$D/cni/net.d/10-vcuda.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "vcuda-k8s-modern",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$POD_CIDR"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$D/cni/ipam"
      }
    }
  ]
}
EOF
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
  mkdir -p "$KUBELET_ROOT/device-plugins" "$D/kubelet" "$D/log/pods"
  cgroup_root
  cat >"$D/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $D/pki/ca.crt}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$D/containerd/containerd.sock
# This machine's cgroups are v1: kubelet >= 1.35 refuses them unless told.
failCgroupV1: false
cgroupDriver: cgroupfs
# Its own cgroup tree: the 1.20 node's clean-up empties /kubepods.
cgroupRoot: /$CGROUP_ROOT
# This machine withholds CAP_SYS_RESOURCE: kubelet may not lower its own score.
oomScoreAdj: 0
failSwapOn: false
makeIPTablesUtilChains: false
readOnlyPort: 0
port: $KUBELET_PORT
healthzPort: $HEALTHZ_PORT
healthzBindAddress: 127.0.0.1
podLogsDir: $D/log/pods
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
podCIDR: $POD_CIDR
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
syncFrequency: 10s
fileCheckFrequency: 10s
nodeStatusUpdateFrequency: 5s
EOF
  start kubelet "$BIN/kubelet" \
    --config "$D/kubelet/config.yaml" \
    --kubeconfig "$D/kubelet.kubeconfig" \
    --root-dir "$KUBELET_ROOT" --cert-dir "$D/kubelet/pki" \
    --node-ip "$NODE_IP" --hostname-override "$NODE" \
    --v 2
}

node_ready() {
  "$BIN/kubectl" --kubeconfig "$D/admin.kubeconfig" get node "$NODE" \
    -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True
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

up() {
  [ "$(id -u)" = 0 ] || die "run as root"
  need_tools
  BIN=$(find_bin)
  local b
  for b in kubelet kube-apiserver kube-scheduler kube-controller-manager kubectl containerd ctr containerd-shim-runc-v2; do
    [ -x "$BIN/$b" ] || die "$BIN/$b missing (tests/k8s/build-modern.sh builds it)"
  done
  mkdir -p "$D/run" "$D/log"
  local t0=$SECONDS
  lo_address
  pki
  start_etcd
  start_apiserver
  start_controllers
  start_containerd
  start_kubelet
  wait_for "node $NODE Ready" 180 "$D/log/kubelet.log" node_ready
  # The cluster's default ServiceAccount comes from the controller-manager.
  wait_for "default ServiceAccount" 60 "$D/log/kube-controller-manager.log" \
    "$BIN/kubectl" --kubeconfig "$D/admin.kubeconfig" -n kube-system get serviceaccount default
  write_env
  log "node $NODE Ready in $((SECONDS - t0)) s ($("$BIN/kubelet" --version), containerd $("$BIN/containerd" --version | awk '{print $3}')); env: $D/env"
}

kill_pod_processes() {
  kill_node_processes "$D/containerd/containerd.sock" "$CGROUP_ROOT"
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
  wait_for "node $KN Ready" 180 "$D/log/node-$k.log" node_ready_k
  log "node $KN Ready"
}

# node-reboot: what a reboot does to the node, the control plane aside:
# kubelet and containerd stop, every pod process dies, the runtime's state
# (tmpfs /run on a real node: containerd's task state and the pods'
# network namespaces, sockets under /var/run, the CDI specs in
# /var/run/cdi) is gone; disk (images, /etc/gpu-manager, kubelet's
# checkpoints) stays. Then containerd and kubelet start again.
node_reboot() {
  stop kubelet
  stop containerd
  kill_pod_processes
  unmount_under "$D/containerd/state"
  rm -rf "$D/containerd/state"
  rm -f /var/run/gpu-manager.sock
  rm -rf /var/run/cdi/*
  start_containerd
  start_kubelet
  wait_for "node $NODE Ready" 180 "$D/log/kubelet.log" node_ready
  log "node rebooted"
}

down() {
  BIN=$(find_bin 2>/dev/null || echo /nonexistent)
  local f
  for f in "$D"/run/node-*.pid; do
    [ -e "$f" ] || continue
    f=${f##*/node-}
    node_down "${f%.pid}"
  done
  stop kubelet
  kill_pod_processes
  stop containerd
  stop kube-scheduler
  stop kube-controller-manager
  stop kube-apiserver
  stop etcd
  kill_strays
  unmount_under "$KUBELET_ROOT"
  unmount_under "$D"
  ip link del "$BRIDGE" 2>/dev/null || true
  ip addr del "$NODE_IP/32" dev lo 2>/dev/null || true
  # kubelet's links to this node's container logs
  local l
  for l in /var/log/containers/*.log; do
    [ -L "$l" ] || continue
    case "$(readlink "$l")" in "$D"/*) rm -f "$l" ;; esac
  done
  # Never into a mount that survived the unmounts (a pod volume, a host path).
  rm -rf --one-file-system "$KUBELET_ROOT" "$D"
  # kubelet's cgroup tree
  remove_cgroups "$CGROUP_ROOT"
  log "down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  kubelet-stop) BIN=$(find_bin); stop kubelet ;;
  kubelet-start) BIN=$(find_bin); start_kubelet ;;
  kubelet-restart) BIN=$(find_bin); stop kubelet; start_kubelet ;;
  node-reboot) BIN=$(find_bin); node_reboot ;;
  # scheduler-restart [CONFIG]: kube-scheduler again, with the
  # KubeSchedulerConfiguration CONFIG (extenders, profiles) or its flags.
  scheduler-restart) BIN=$(find_bin); stop kube-scheduler; start_scheduler "${2:-}" ;;
  node-up) BIN=$(find_bin); node_up "$2" ;;
  node-down) BIN=$(find_bin); node_down "$2" ;;
  import) BIN=$(find_bin); import_image "$2" "${3:-}" ;;
  image-tar) shift; image_tar "$@" ;;
  *) echo "usage: $0 up|down|kubelet-restart|node-reboot|kubelet-stop|kubelet-start|scheduler-restart [CONFIG]|node-up K|node-down K|import TAR [SOCKET]|image-tar TAG ROOTFS OUT ENTRY..." >&2; exit 2 ;;
esac
