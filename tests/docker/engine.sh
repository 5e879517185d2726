# Sourced by tests/run.sh (and usable by hand): starts a private Docker engine
# on its own socket and data root, and imports the busybox test image.
#
#   VCUDA_DOCKER_DIR   where the engine keeps its socket, data and logs
#                      (default /tmp/vcuda-docker)
# Exports DOCKER_HOST and VCUDA_TEST_IMAGE.

VCUDA_DOCKER_DIR=${VCUDA_DOCKER_DIR:-/tmp/vcuda-docker}
VCUDA_TEST_IMAGE=vcuda-test/busybox:latest

docker_cli() {
  # Debian's client matches Debian's engine; another client may be first on PATH.
  if [ -x /usr/bin/docker ]; then /usr/bin/docker "$@"; else docker "$@"; fi
}

start_docker_engine() {
  local sock="$VCUDA_DOCKER_DIR/docker.sock"
  mkdir -p "$VCUDA_DOCKER_DIR"
  export DOCKER_HOST="unix://$sock"
  if ! docker_cli info >/dev/null 2>&1; then
    # No network is needed (tests run containers with --network none), so no
    # bridge and no iptables: fewer things that differ between machines.
    nohup dockerd \
      --host "unix://$sock" \
      --data-root "$VCUDA_DOCKER_DIR/data" \
      --exec-root "$VCUDA_DOCKER_DIR/exec" \
      --pidfile "$VCUDA_DOCKER_DIR/dockerd.pid" \
      --bridge none --iptables=false --ip6tables=false --ip-masq=false \
      >"$VCUDA_DOCKER_DIR/dockerd.log" 2>&1 &
    local i
    for i in $(seq 1 60); do
      docker_cli info >/dev/null 2>&1 && break
      sleep 1
    done
    if ! docker_cli info >/dev/null 2>&1; then
      echo "dockerd did not come up within 60 s; its log ($VCUDA_DOCKER_DIR/dockerd.log):" >&2
      tail -n 30 "$VCUDA_DOCKER_DIR/dockerd.log" >&2
      return 1
    fi
  fi
  if ! docker_cli image inspect "$VCUDA_TEST_IMAGE" >/dev/null 2>&1; then
    # A one-binary rootfs: busybox-static and its applet links.
    local rootfs
    rootfs=$(mktemp -d)
    mkdir -p "$rootfs"/{bin,dev,etc,proc,sys,tmp,usr/local,run}
    cp /bin/busybox "$rootfs/bin/busybox"
    local applet
    for applet in sh ls cat echo sleep env mount test true false grep head; do
      ln -s busybox "$rootfs/bin/$applet"
    done
    tar -C "$rootfs" -c . | docker_cli import - "$VCUDA_TEST_IMAGE" >/dev/null
    rm -rf "$rootfs"
  fi
  export VCUDA_TEST_IMAGE
  echo "docker engine ready at $DOCKER_HOST ($(docker_cli version --format '{{.Server.Version}}')), image $VCUDA_TEST_IMAGE"
}
