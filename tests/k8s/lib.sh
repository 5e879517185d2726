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

# The nodes `node-up K` adds (each script's node_vars K sets KN, KIP, KD,
# KSOCK, KBRIDGE and KCGROUP).
node_ready_k() {
  "$BIN/kubectl" --kubeconfig "$D/admin.kubeconfig" get node "$KN" \
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
