#!/usr/bin/env bash
# tests/k8s/isolated.sh CMD [ARG...]: CMD in mount and network namespaces of
# its own, where the host state a real node and its suites write is private,
# so that the 1.37 node's suites (cluster-modern.sh) run beside the 1.20
# node's (cluster.sh) on one machine (tests/run.sh). Both nodes use the same
# fixed paths: kubelet's /var/lib/kubelet/device-plugins, the manager's
# /etc/gpu-manager and /var/run/gpu-manager.sock, /var/run/cdi, the sim's
# /dev/nvidia* nodes; and their suites take /tmp/vcuda-k8s.lock.
#
# Private, fresh: /run (tmpfs), /dev (a tmpfs copy of the host's, without
# nvidia*; its own /dev/shm), /etc (a tmpfs copy, without gpu-manager),
# /var/lib (a tmpfs; the host's entries bound back, all but kubelet and
# cni), the machine lock, the network (lo only: the node's address, ports,
# bridge and iptables rules stay inside) and /sys (mounted for that
# network; the host's cgroup trees bound back: each node has its own root).
# Shared: /tmp (each node's state directory, the Docker engine), the
# checkout, everything else. Private trees are tmpfs or bind mounts made
# over directories the other node never removes (a host `rm -rf` of a
# mountpoint would detach it here).
#
# The namespaces end with the last process in them: CMD should bring its
# node down (cluster-modern.sh down, from inside or from the host, ends
# what a killed CMD left).
set -euo pipefail

if [ "${1:-}" != --inside ]; then
  [ $# -gt 0 ] || { echo "usage: $0 CMD [ARG...]" >&2; exit 2; }
  [ "$(id -u)" = 0 ] || { echo "$0: run as root (it makes namespaces and mounts)" >&2; exit 2; }
  touch /tmp/vcuda-k8s.lock
  exec unshare --mount --net --propagation private -- bash "$0" --inside "$@"
fi
shift

fail() { echo "tests/k8s/isolated.sh: $*" >&2; exit 1; }

# What the other node mounted (pod volumes, network namespaces, containerd's
# state), copied into this namespace by unshare: let go of it here, so the
# other node's unmounts and removals are not held up by copies.
mounts_below() { # mounts_below REGEX: mount points matching it, deepest first
  awk '{print $5}' /proc/self/mountinfo | grep -E "$1" | sort -r || true
}
for m in $(mounts_below '^(/var/lib/kubelet|/tmp/vcuda-k8s|/run/.+)(/|$)'); do
  umount -l "$m" 2>/dev/null || true
done

S=$(mktemp -d /tmp/vcuda-isolated.XXXXXX)
stage() { # stage NAME: a fresh tmpfs at $S/NAME to fill and move into place
  mkdir -p "$S/$1"
  mount -t tmpfs -o mode=755 "vcuda-isolated-$1" "$S/$1"
}

# /run: empty, as after a boot.
mount -t tmpfs -o mode=755,nosuid "vcuda-isolated-run" /run
touch /run/vcuda-k8s.lock
mount --bind /run/vcuda-k8s.lock /tmp/vcuda-k8s.lock

# /etc
stage etc
cp -a /etc/. "$S/etc/" || fail "copying /etc failed"
rm -rf "$S/etc/gpu-manager" "$S/etc/vcuda"
mount --move "$S/etc" /etc

# /var/lib
stage var-lib
for e in /var/lib/* /var/lib/.[!.]*; do
  [ -e "$e" ] || continue
  n=${e##*/}
  case "$n" in kubelet | cni) continue ;; esac
  if [ -d "$e" ]; then mkdir "$S/var-lib/$n"; else touch "$S/var-lib/$n"; fi
  mount --rbind "$e" "$S/var-lib/$n"
done
mount --move "$S/var-lib" /var/lib

# /dev: the host's device nodes (devtmpfs only: -x), the sim's none.
stage dev
cp -ax /dev/. "$S/dev/" || fail "copying /dev failed"
rm -rf "$S"/dev/nvidia*
mkdir -p "$S/dev/shm"
mount -t tmpfs -o mode=1777,nosuid,nodev "vcuda-isolated-shm" "$S/dev/shm"
for m in pts mqueue; do
  if mountpoint -q "/dev/$m"; then mount --rbind "/dev/$m" "$S/dev/$m"; fi
done
mount --move "$S/dev" /dev

# The network: lo alone; sysfs again so /sys/class/net shows this one.
ip link set lo up
mkdir -p "$S/cgroup"
mount --rbind /sys/fs/cgroup "$S/cgroup"
mount -t sysfs "vcuda-isolated-sys" /sys
mount --move "$S/cgroup" /sys/fs/cgroup

rmdir "$S"/* "$S"
exec "$@"
