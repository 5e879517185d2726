# Sourced by tests/run.sh (and usable by hand): starts a private containerd
# (Debian's 1.6, CRI plugin, runc) on its own socket, state, root and runc
# root, so it never meets a containerd that kubelet or Docker uses, and
# imports the test images into its k8s.io namespace (what CRI sees).
#
#   VCUDA_CONTAINERD_DIR   socket, state, root, logs
#                          (default /run/vcuda-test-containerd)
# Exports VCUDA_CONTAINERD_ENDPOINT (unix://.../containerd.sock) and
# VCUDA_CRI_IMAGE (busybox-static in one layer; its sleep is also the pod
# sandbox's "pause", so no compiler and no registry are needed).
#
# Pods run on the host network (tests create sandboxes with
# NamespaceOption.network = NODE): no CNI configuration is needed.

VCUDA_CONTAINERD_DIR=${VCUDA_CONTAINERD_DIR:-/run/vcuda-test-containerd}
VCUDA_CRI_IMAGE=docker.io/vcuda-test/busybox:cri
VCUDA_CRI_PAUSE=docker.io/vcuda-test/pause:cri

vcuda_ctr() {
  ctr --address "$VCUDA_CONTAINERD_DIR/containerd.sock" -n k8s.io "$@"
}

# A docker-archive (what `ctr images import` reads) of one layer: the
# directory ROOTFS tagged TAG, with ENTRYPOINT...
vcuda_image_tar() {
  local tag=$1 rootfs=$2 out=$3; shift 3
  local tmp entry="" a diff
  tmp=$(mktemp -d)
  tar --numeric-owner --owner=0 --group=0 -C "$rootfs" -cf "$tmp/layer.tar" .
  diff=$(sha256sum "$tmp/layer.tar" | cut -d' ' -f1)
  for a in "$@"; do entry="$entry${entry:+,}\"$a\""; done
  printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":[%s],"Env":["PATH=/bin"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
    "$entry" "$diff" >"$tmp/config.json"
  printf '[{"Config":"config.json","RepoTags":["%s"],"Layers":["layer.tar"]}]' "$tag" >"$tmp/manifest.json"
  tar -C "$tmp" -cf "$out" manifest.json config.json layer.tar
  rm -rf "$tmp"
}

# Starts a private containerd in DIR (socket, state, root, runc root, CNI
# and config of its own) unless one answers there, and imports the test
# images into its k8s.io namespace:
#   vcuda_containerd_up DIR BINDIR "EXTRA CRI TOML"
# BINDIR holds containerd, its shim and ctr ("" for the system's); the
# extra lines go into the CRI plugin's table (e.g. enable_cdi).
vcuda_containerd_up() {
  local d=$1 bin=$2 extra=$3
  local sock="$d/containerd.sock"
  local ctr=(ctr --address "$sock" -n k8s.io)
  [ -z "$bin" ] || ctr=("$bin/ctr" --address "$sock" -n k8s.io)
  mkdir -p "$d"
  if ! "${ctr[@]}" version >/dev/null 2>&1; then
    cat >"$d/config.toml" <<EOF
version = 2
root = "$d/root"
state = "$d/state"
# The opt plugin wants /opt/containerd; nothing here uses it.
disabled_plugins = ["io.containerd.internal.v1.opt"]
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[debug]
  level = "info"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$VCUDA_CRI_PAUSE"
  # This machine withholds CAP_SYS_RESOURCE: no oom_score_adj below the parent's.
  restrict_oom_score_adj = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
$extra
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        # Not /run/containerd/runc, which another containerd may use.
        Root = "$d/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$d/cni"
EOF
    mkdir -p "$d/cni"
    # BINDIR first in this process's PATH only, for its shim; runc is the system's.
    PATH="${bin:+$bin:}$PATH" nohup "${bin:+$bin/}containerd" --config "$d/config.toml" \
      >"$d/containerd.log" 2>&1 &
    echo $! >"$d/containerd.pid"
    local i
    for i in $(seq 1 60); do
      "${ctr[@]}" version >/dev/null 2>&1 && break
      sleep 1
    done
    if ! "${ctr[@]}" version >/dev/null 2>&1; then
      echo "containerd in $d did not come up within 60 s; its log ($d/containerd.log):" >&2
      tail -n 30 "$d/containerd.log" >&2
      return 1
    fi
  fi
  local have
  have=$("${ctr[@]}" images ls -q)
  if ! grep -qx "$VCUDA_CRI_IMAGE" <<<"$have" || ! grep -qx "$VCUDA_CRI_PAUSE" <<<"$have"; then
    local tmp applet
    tmp=$(mktemp -d)
    mkdir -p "$tmp/rootfs"/{bin,dev,etc,proc,sys,tmp,run}
    cp /bin/busybox "$tmp/rootfs/bin/busybox"
    for applet in sh ls cat echo sleep env test true false grep head wc stat; do
      ln -s busybox "$tmp/rootfs/bin/$applet"
    done
    vcuda_image_tar "$VCUDA_CRI_IMAGE" "$tmp/rootfs" "$tmp/busybox.tar" /bin/sh
    vcuda_image_tar "$VCUDA_CRI_PAUSE" "$tmp/rootfs" "$tmp/pause.tar" /bin/sleep 2147483647
    "${ctr[@]}" images import "$tmp/busybox.tar" >/dev/null
    "${ctr[@]}" images import "$tmp/pause.tar" >/dev/null
    rm -rf "$tmp"
  fi
}

start_test_containerd() {
  export VCUDA_CONTAINERD_ENDPOINT="unix://$VCUDA_CONTAINERD_DIR/containerd.sock"
  export VCUDA_CRI_IMAGE
  vcuda_containerd_up "$VCUDA_CONTAINERD_DIR" "" "" || return 1
  echo "containerd ready at $VCUDA_CONTAINERD_ENDPOINT ($(vcuda_ctr version 2>/dev/null | awk '/Server/{s=1} s&&/Version/{print $2; exit}')), images $VCUDA_CRI_IMAGE, $VCUDA_CRI_PAUSE"
}

# Stops the containerd start_test_containerd started (by its pid file).
stop_test_containerd() {
  local p
  p=$(cat "$VCUDA_CONTAINERD_DIR/containerd.pid" 2>/dev/null) || return 0
  kill "$p" 2>/dev/null || true
  rm -f "$VCUDA_CONTAINERD_DIR/containerd.pid"
}
