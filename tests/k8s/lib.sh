# Shell functions tests/k8s/cluster.sh (the 1.20 node) and
# tests/k8s/cluster-modern.sh (the 1.37 node) share: processes by pid file,
# waiting, the PKI's leaf certificates and kubeconfigs, one-layer images,
# the node's address on lo, clean-ups. Sourced after each sets D, NODE_IP,
# API_PORT, log and die.

pidfile() { echo "$D/run/$1.pid"; }

running() { local p; p=$(cat "$(pidfile "$1")" 2>/dev/null) && kill -0 "$p" 2>/dev/null; }

# start NAME CMD...: in the background, logs in $D/log/NAME.log.
start() {
  local name=$1; shift
  if running "$name"; then return; fi
  nohup "$@" >>"$D/log/$name.log" 2>&1 &
  echo $! >"$(pidfile "$name")"
}

stop() {
  local name=$1 p i
  p=$(cat "$(pidfile "$name")" 2>/dev/null) || return 0
  if kill -0 "$p" 2>/dev/null; then
    kill "$p" 2>/dev/null || true
    for i in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  fi
  rm -f "$(pidfile "$name")"
}

# wait_for WHAT SECONDS LOG CMD...: polls CMD once a second.
wait_for() {
  local what=$1 secs=$2 logf=$3 i; shift 3
  for i in $(seq 1 "$secs"); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  log "$what not up after ${secs}s; last lines of $logf:"
  tail -n 40 "$logf" >&2 || true
  return 1
}

cert() { # cert NAME CN O [SAN]
  local name=$1 cn=$2 o=$3 san=${4:-}
  [ -f "$D/pki/$name.crt" ] && return
  local subj="/CN=$cn"
  [ -n "$o" ] && subj="/O=$o/CN=$cn"
  openssl req -new -newkey rsa:2048 -nodes -keyout "$D/pki/$name.key" -subj "$subj" \
    -out "$D/pki/$name.csr" 2>/dev/null
  local ext="$D/pki/$name.ext"
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    if [ -n "$san" ]; then
      echo "extendedKeyUsage=serverAuth,clientAuth"
      echo "subjectAltName=$san"
    else
      echo "extendedKeyUsage=clientAuth"
    fi
  } >"$ext"
  openssl x509 -req -in "$D/pki/$name.csr" -CA "$D/pki/ca.crt" -CAkey "$D/pki/ca.key" \
    -CAcreateserial -days 365 -sha256 -extfile "$ext" -out "$D/pki/$name.crt" 2>/dev/null
}

kubeconfig() { # kubeconfig NAME
  local name=$1
  cat >"$D/$name.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: vcuda
  cluster:
    certificate-authority: $D/pki/ca.crt
    server: https://$NODE_IP:$API_PORT
users:
- name: $name
  user:
    client-certificate: $D/pki/$name.crt
    client-key: $D/pki/$name.key
contexts:
- name: vcuda
  context: {cluster: vcuda, user: $name}
current-context: vcuda
EOF
}

# A docker-archive (what `ctr images import` reads) of one layer: the
# directory $2, tagged $1, entrypoint $3...
image_tar() {
  local tag=$1 rootfs=$2 out=$3; shift 3
  local tmp entry=""
  tmp=$(mktemp -d)
  tar --numeric-owner --owner=0 --group=0 -C "$rootfs" -cf "$tmp/layer.tar" .
  local diff
  diff=$(sha256sum "$tmp/layer.tar" | cut -d' ' -f1)
  local a
  for a in "$@"; do entry="$entry${entry:+,}\"$a\""; done
  printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":[%s],"Env":["PATH=/bin:/usr/bin"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$entry" "$diff" >"$tmp/config.json"
  printf '[{"Config":"config.json","RepoTags":["%s"],"Layers":["layer.tar"]}]' "$tag" >"$tmp/manifest.json"
  tar -C "$tmp" -cf "$out" manifest.json config.json layer.tar
  rm -rf "$tmp"
}

lo_address() {
  ip -4 addr show dev lo | grep -q " $NODE_IP/" || ip addr add "$NODE_IP/32" dev lo
}

unmount_under() { # unmount everything below $1, deepest first
  local m
  { awk '{print $5}' /proc/self/mountinfo | grep -E "^$1(/|$)" || true; } | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
}

# kill_node_processes SOCKET CGROUP: what a node's pods left running: the
# containerd-shims of the containerd at SOCKET (their -address names it),
# then every process in the node's cgroup tree CGROUP (kubelet's
# cgroupRoot, or kubepods).
kill_node_processes() {
  local sock=$1 root=$2 p cg
  for p in $(pgrep -f "containerd-shim-runc-v2 .*-address $sock" || true); do
    kill -9 "$p" 2>/dev/null || true
  done
  for cg in "/sys/fs/cgroup/pids/$root" "/sys/fs/cgroup/unified/$root"; do
    [ -d "$cg" ] || continue
    { find "$cg" -name cgroup.procs -exec cat {} + 2>/dev/null || true; } | while read -r p; do
      kill -9 "$p" 2>/dev/null || true
    done
  done
}

# kill_strays: once the node is down, any process still naming $D/ on its
# command line: what a killed test run started on the host and never
# stopped (a gpu-manager, the webhook, each with the cluster's kubeconfig).
# One that survived a killed run answered the next run's kubelet. This
# shell and its callers are spared.
kill_strays() {
  local p q=$$ spare=" $$ " cmd
  while q=$(ps -o ppid= -p "$q" 2>/dev/null | tr -d ' ') && [ -n "$q" ] && [ "$q" -gt 1 ]; do
    spare+="$q "
  done
  # Listed first: the subshell running pgrep names $D/ too, and is gone.
  local listed
  listed=$(pgrep -f -- "$D/" || true)
  for p in $listed; do
    case "$spare" in *" $p "*) continue ;; esac
    cmd=$(tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | cut -c1-160)
    [ -n "$cmd" ] || continue
    log "killing pid $p, left running by an earlier run: $cmd"
    kill -9 "$p" 2>/dev/null || true
  done
}

# remove_cgroups CGROUP: the (empty) cgroup tree CGROUP in every hierarchy.
remove_cgroups() {
  local c
  for c in /sys/fs/cgroup/*/"$1"; do
    [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
}

# node_ready NAME: kubelet has marked node NAME Ready (this script's node,
# or one `node-up K` added: each script's node_vars K sets KN, KIP, KD,
# KSOCK, KBRIDGE and KCGROUP).
node_ready() {
  "$BIN/kubectl" --kubeconfig "$D/admin.kubeconfig" get node "$1" \
    -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null | grep -qx True
}

# node_prepare K CIDR: node K's directories, address, client certificate,
# kubeconfig, cgroup roots, and its containerd and CNI configurations made
# from the first node's (pod CIDR CIDR).
node_prepare() {
  local k=$1 cidr=$2 c
  mkdir -p "$KD/kubelet-root/device-plugins" "$KD/containerd" "$KD/cni/net.d" "$KD/cni/ipam" \
    "$KD/kubelet/pki" "$KD/log/pods"
  ip -4 addr show dev lo | grep -q " $KIP/" || ip addr add "$KIP/32" dev lo
  cert "kubelet-$k" "system:node:$KN" system:nodes
  kubeconfig "kubelet-$k"
  for c in /sys/fs/cgroup/*/; do
    [ -L "${c%/}" ] || mkdir -p "$c$KCGROUP" 2>/dev/null || true
  done
  sed -e "s|$D/containerd|$KD/containerd|g" -e "s|$D/cni|$KD/cni|g" \
    "$D/containerd/config.toml" >"$KD/containerd/config.toml"
  sed -e "s|\"$BRIDGE\"|\"$KBRIDGE\"|" -e "s|$POD_CIDR|$cidr|" -e "s|$D/cni|$KD/cni|g" \
    "$D/cni/net.d/10-vcuda.conflist" >"$KD/cni/net.d/10-vcuda.conflist"
}

# node-down K: what node-up K started, and its pods' processes.
node_down() {
  node_vars "$1"
  stop "node-$1"
  kill_node_processes "$KSOCK" "$KCGROUP"
  stop "containerd-$1"
  ip link del "$KBRIDGE" 2>/dev/null || true
  ip addr del "$KIP/32" dev lo 2>/dev/null || true
  remove_cgroups "$KCGROUP"
}

# ---------------------------------------------------------------- the node
# What both nodes do the same way. Each script sets, before sourcing this:
# CLUSTER (etcd's member, the CA's and the CNI network's name), NODE,
# NODE_IP, API_PORT, ETCD_PORT, SERVICE_CIDR, POD_CIDR, BRIDGE, POD_CGROUP
# (the cgroup tree kubelet puts pods in), KUBELET_ROOT, PAUSE_IMAGE, TOOLS
# and APT (the host tools it needs, the packages that bring them),
# NEEDED_BINS and BUILD_SCRIPT (what $BIN must hold, and what builds it),
# and the flags only the 1.20 components take (OLD_APISERVER_FLAGS,
# OLD_COMPONENT_FLAGS: their insecure ports off; later releases removed
# them). It defines find_bin, ctr_bin (the ctr that speaks to its
# containerd), start_containerd, start_kubelet, write_env, versions (for
# the log), run_state (what a reboot empties, beyond containerd's state)
# and down_more (its own clean-ups once everything stopped).

need_tools() {
  local missing=() t
  for t in "${TOOLS[@]}"; do
    command -v "$t" >/dev/null 2>&1 || missing+=("$t")
  done
  [ -x /usr/lib/cni/bridge ] || missing+=("/usr/lib/cni/bridge (containernetworking-plugins)")
  [ ${#missing[@]} -eq 0 ] || die "missing: ${missing[*]} (apt-get install $APT)"
}

pki() {
  mkdir -p "$D/pki"
  if [ ! -f "$D/pki/ca.crt" ]; then
    openssl req -x509 -new -newkey rsa:2048 -nodes -keyout "$D/pki/ca.key" -days 365 \
      -subj "/CN=$CLUSTER-ca" -out "$D/pki/ca.crt" 2>/dev/null
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

CTR() { "$(ctr_bin)" --address "$D/containerd/containerd.sock" "$@"; }

import_image() { # import_image TAR [CONTAINERD_SOCKET]
  "$(ctr_bin)" --address "${2:-$D/containerd/containerd.sock}" -n k8s.io images import "$1" >/dev/null
}

# The sandbox image: a static binary that waits for a signal.
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

start_etcd() {
  start etcd etcd --name "$CLUSTER" --data-dir "$D/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" \
    --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT + 10))" \
    --initial-cluster "$CLUSTER=http://127.0.0.1:$((ETCD_PORT + 10))" \
    --listen-metrics-urls "" --log-level warn
  wait_for etcd 60 "$D/log/etcd.log" curl -sf "http://127.0.0.1:$ETCD_PORT/health"
}

start_apiserver() {
  start kube-apiserver "$BIN/kube-apiserver" \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address "$NODE_IP" --advertise-address "$NODE_IP" --secure-port "$API_PORT" \
    "${OLD_APISERVER_FLAGS[@]}" \
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
    --leader-elect=false "${OLD_COMPONENT_FLAGS[@]}" --secure-port 0 --v 1
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
      --leader-elect=false "${OLD_COMPONENT_FLAGS[@]}" --secure-port 0 --v 1
  else
    start kube-scheduler "$BIN/kube-scheduler" --config "$config" \
      --authentication-kubeconfig "$D/scheduler.kubeconfig" \
      --authorization-kubeconfig "$D/scheduler.kubeconfig" \
      "${OLD_COMPONENT_FLAGS[@]}" --secure-port 0 --v 2
  fi
}

# The pods' network: one bridge, host-local addresses from POD_CIDR.
write_cni_config() {
  mkdir -p "$D/cni/net.d" "$D/cni/ipam"
  cat >"$D/cni/net.d/10-vcuda.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "$CLUSTER",
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
}

# kubelet's configuration: what both nodes set, then this node's own
# lines ($1, one per line), then kubelet itself with this node's flags
# ($2...). node-up rewrites its keys by name for the nodes it adds.
start_kubelet_with() {
  local own=$1
  shift
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
healthzPort: $HEALTHZ_PORT
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
$own
EOF
  start kubelet "$BIN/kubelet" \
    --config "$D/kubelet/config.yaml" \
    --kubeconfig "$D/kubelet.kubeconfig" \
    --root-dir "$KUBELET_ROOT" --cert-dir "$D/kubelet/pki" \
    --node-ip "$NODE_IP" --hostname-override "$NODE" \
    "$@" --v 2
}

up() {
  [ "$(id -u)" = 0 ] || die "run as root"
  need_tools
  BIN=$(find_bin)
  local b
  for b in "${NEEDED_BINS[@]}"; do
    [ -x "$BIN/$b" ] || die "$BIN/$b missing ($BUILD_SCRIPT builds it)"
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
  wait_for "node $NODE Ready" 180 "$D/log/kubelet.log" node_ready "$NODE"
  # The cluster's default ServiceAccount comes from the controller-manager.
  wait_for "default ServiceAccount" 60 "$D/log/kube-controller-manager.log" \
    "$BIN/kubectl" --kubeconfig "$D/admin.kubeconfig" -n kube-system get serviceaccount default
  write_env
  log "node $NODE Ready in $((SECONDS - t0)) s ($(versions)); env: $D/env"
}

kill_pod_processes() {
  kill_node_processes "$D/containerd/containerd.sock" "$POD_CGROUP"
}

# node-reboot: what a reboot does to the node, the control plane aside:
# kubelet and containerd stop, every pod process dies, the runtime's state
# (tmpfs /run on a real node: containerd's task state, sockets under
# /var/run, what run_state names) is gone; disk (images, /etc/gpu-manager,
# kubelet's checkpoints) stays. Then containerd and kubelet start again.
node_reboot() {
  stop kubelet
  stop containerd
  kill_pod_processes
  unmount_under "$D/containerd/state"
  rm -rf "$D/containerd/state"
  rm -f /var/run/gpu-manager.sock
  run_state
  start_containerd
  start_kubelet
  wait_for "node $NODE Ready" 180 "$D/log/kubelet.log" node_ready "$NODE"
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
  down_more
  ip link del "$BRIDGE" 2>/dev/null || true
  ip addr del "$NODE_IP/32" dev lo 2>/dev/null || true
  # Never into a mount that survived the unmounts (a pod volume, a host path).
  rm -rf --one-file-system "$KUBELET_ROOT" "$D"
  # kubelet's cgroup tree
  remove_cgroups "$POD_CGROUP"
  log "down"
}

# The commands both scripts take (cluster.sh's usage names them).
command_line() {
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
}
