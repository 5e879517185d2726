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
NODE=${VCUDA_K8S_NODE:-vcuda-k8s-node}
NODE_IP=198.51.100.1
API_PORT=26443
ETCD_PORT=23790
POD_CIDR=10.244.77.0/24
BRIDGE=vcudak8s0
KUBELET_ROOT=/var/lib/kubelet
PAUSE_IMAGE=docker.io/vcuda-test/pause:local

log() { printf '[k8s-cluster] %s\n' "$*" >&2; }
die() { printf '[k8s-cluster] error: %s\n' "$*" >&2; exit 1; }
# shellcheck source=tests/k8s/lib.sh
. "$HERE/lib.sh"

find_bin() {
  if [ -n "${VCUDA_K8S_BIN:-}" ]; then echo "$VCUDA_K8S_BIN"; return; fi
  local d
  d=$(ls -d /var/cache/vcuda/k8s-*/bin 2>/dev/null | sort | tail -n1 || true)
  [ -n "$d" ] || die "no Kubernetes binaries: set VCUDA_K8S_BIN or run tests/k8s/build-kubernetes.sh"
  echo "$d"
}




need_tools() {
  local missing=()
  for t in etcd containerd runc ctr openssl gcc curl ip pgrep; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
  done
  [ -x /usr/lib/cni/bridge ] || missing+=("/usr/lib/cni/bridge (containernetworking-plugins)")
  [ ${#missing[@]} -eq 0 ] || die "missing: ${missing[*]} (apt-get install etcd-server containerd runc containernetworking-plugins openssl gcc libc6-dev curl iproute2 procps)"
}

# ---------------------------------------------------------------- PKI


pki() {
  mkdir -p "$D/pki"
  if [ ! -f "$D/pki/ca.crt" ]; then
    openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$D/pki/ca.key" -days 365 \
      -subj "/CN=vcuda-k8s-ca" -out "$D/pki/ca.crt" 2>/dev/null
  fi
  [ -f "$D/pki/sa.key" ] || {
    openssl genrsa -out "$D/pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$D/pki/sa.key" -pubout -out "$D/pki/sa.pub" 2>/dev/null
  }
  cert apiserver kube-apiserver "" \
    "IP:$NODE_IP,IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
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

import_image() { # import_image TAR [CONTAINERD_SOCKET]
  ctr --address "${2:-$D/containerd/containerd.sock}" -n k8s.io images import "$1" >/dev/null
}

pause_image() {
  if ctr --address "$D/containerd/containerd.sock" -n k8s.io images ls -q | grep -qx "$PAUSE_IMAGE"; then
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
  start etcd etcd --name vcuda-k8s --data-dir "$D/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" \
    --initial-cluster "vcuda-k8s=http://127.0.0.1:$((ETCD_PORT + 10))" \
    --listen-metrics-urls "" --log-level warn
  wait_for etcd 60 "$D/log/etcd.log" curl -sf "http://127.0.0.1:$ETCD_PORT/health"
}

start_apiserver() {
  start kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$NODE_IP" --advertise-address "$NODE_IP" --secure-port "$API_PORT" \
    --insecure-port 0 \
    --service-cluster-ip-range 10.0.0.0/24 \
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
  wait_for kube-apiserver 120 "$D/log/kube-apiserver.log" \
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
    --leader-elect=false --port 0 --secure-port 0 --v 1
  start_scheduler ""
}

# start_scheduler CONFIG: kube-scheduler with its flags, or with the
# KubeSchedulerConfiguration file CONFIG (its clientConnection and
# leaderElection then come from the file: write_scheduler_config).
start_scheduler() {
  local config=$1
  if [ -z "$config" ]; then
    start kube-scheduler "$BIN/kube-scheduler" \
      --kubeconfig "$D/scheduler.kubeconfig" \
      --authentication-kubeconfig "$D/scheduler.kubeconfig" \
      --authorization-kubeconfig "$D/scheduler.kubeconfig" \
      --leader-elect=false --port 0 --secure-port 0 --v 1
  else
    start kube-scheduler "$BIN/kube-scheduler" --config "$config" \
      --authentication-kubeconfig "$D/scheduler.kubeconfig" \
      --authorization-kubeconfig "$D/scheduler.kubeconfig" \
      --port 0 --secure-port 0 --v 2
  fi
}

start_containerd() {
  mkdir -p "$D/containerd" "$D/cni/net.d" "$D/cni/ipam"
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
  cat >"$D/cni/net.d/10-vcuda.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "vcuda-k8s",
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
  start containerd containerd --config "$D/containerd/config.toml"
  wait_for containerd 60 "$D/log/containerd.log" \
    ctr --address "$D/containerd/containerd.sock" version
  pause_image
}

start_kubelet() {
  mkdir -p "$KUBELET_ROOT/device-plugins" "$D/kubelet"
  cat >"$D/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $D/pki/ca.crt}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
# This machine withholds CAP_SYS_RESOURCE: kubelet may not lower its own score.
oomScoreAdj: 0
failSwapOn: false
makeIPTablesUtilChains: false
readOnlyPort: 0
healthzPort: 20248
healthzBindAddress: 127.0.0.1
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
    --container-runtime remote \
    --container-runtime-endpoint "unix://$D/containerd/containerd.sock" \
    --root-dir "$KUBELET_ROOT" --cert-dir "$D/kubelet/pki" \
    --node-ip "$NODE_IP" --hostname-override "$NODE" \
    --v 2
}

node_ready() {
  "$BIN/kubectl" --kubeconfig "$D/admin.kubeconfig" get node "$NODE" \
    -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True
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

up() {
  [ "$(id -u)" = 0 ] || die "run as root"
  need_tools
  BIN=$(find_bin)
  local b
  for b in kubelet kube-apiserver kube-scheduler kube-controller-manager kubectl; do
    [ -x "$BIN/$b" ] || die "$BIN/$b missing (tests/k8s/build-kubernetes.sh builds it)"
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
  log "node $NODE Ready in $((SECONDS - t0)) s ($("$BIN/kubelet" --version)); env: $D/env"
}

kill_pod_processes() {
  kill_node_processes "$D/containerd/containerd.sock" kubepods
}

# node-reboot: what a reboot does to the node, the control plane aside:
# kubelet and containerd stop, every pod process dies, the runtime's state
# (tmpfs /run on a real node: containerd's task state, sockets under
# /var/run) is gone; disk (images, /etc/gpu-manager, kubelet's checkpoints)
# stays. Then containerd and kubelet start again.
node_reboot() {
  stop kubelet
  stop containerd
  kill_pod_processes
  unmount_under "$D/containerd/state"
  rm -rf "$D/containerd/state"
  rm -f /var/run/gpu-manager.sock
  start_containerd
  start_kubelet
  wait_for "node $NODE Ready" 180 "$D/log/kubelet.log" node_ready
  log "node rebooted"
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
  wait_for "node $KN Ready" 180 "$D/log/node-$k.log" node_ready_k
  log "node $KN Ready"
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
  local ns
  for ns in /var/run/netns/cni-*; do
    [ -e "$ns" ] || continue
    umount "$ns" 2>/dev/null || true
    rm -f "$ns"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  ip addr del "$NODE_IP/32" dev lo 2>/dev/null || true
  # Never into a mount that survived the unmounts (a pod volume, a host path).
  rm -rf --one-file-system "$KUBELET_ROOT" "$D"
  # kubelet's QoS cgroups
  remove_cgroups kubepods
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
  import) import_image "$2" "${3:-}" ;;
  image-tar) shift; image_tar "$@" ;;
  *) echo "usage: $0 up|down|kubelet-restart|node-reboot|kubelet-stop|kubelet-start|scheduler-restart [CONFIG]|node-up K|node-down K|import TAR [SOCKET]|image-tar TAG ROOTFS OUT ENTRY..." >&2; exit 2 ;;
esac
