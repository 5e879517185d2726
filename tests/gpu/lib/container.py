"""A shared container for the suite: a vm directory served by the registration
stand-in (cuda-shim's `test_manager` example), its `vcuda.config`, and the
environment that puts a process "in the share" (the mirror's nvidia/lib64 on
LD_LIBRARY_PATH, VCUDA_CONFIG_DIR = the vm directory).
"""

import os
import pathlib
import struct
import subprocess
import threading
import time

# resource_data_t (crates/formats/quota-config): packed, 8240 bytes, native endian.
CONFIG_SIZE = 8240
_STR_FIELDS = {"pod_uid": (0, 48), "container_name": (4096, 4096), "bus_id": (8192, 16)}
_LIMIT, _GPU_MEMORY, _UTILIZATION, _HARD, _MAJOR, _MINOR, _ENABLE = 48, 8208, 8216, 8220, 8224, 8228, 8232


def resource_data(*, pod_uid, container_name, bus_id, gpu_memory, utilization, hard_limit, limit,
                  driver_version, enable) -> bytes:
    """The bytes quota-config's ResourceData::to_bytes writes (checked against
    test_manager's own file by tests/python/test_gpu_suite.py)."""
    b = bytearray(CONFIG_SIZE)
    for name, (off, size) in _STR_FIELDS.items():
        raw = {"pod_uid": pod_uid, "container_name": container_name, "bus_id": bus_id}[name].encode()
        if len(raw) >= size or b"\0" in raw:
            raise ValueError(f"{name} {raw!r} does not fit {size - 1} bytes")
        b[off:off + len(raw)] = raw
    if not 0 <= utilization <= 100:
        raise ValueError(f"utilization {utilization} not in 0..=100")
    struct.pack_into("=i", b, _LIMIT, limit)
    struct.pack_into("=Q", b, _GPU_MEMORY, gpu_memory)
    struct.pack_into("=iiiii", b, _UTILIZATION, utilization, int(hard_limit), driver_version[0],
                     driver_version[1], int(enable))
    return bytes(b)


class Container:
    """`quota` bytes of memory and a compute quota (`utilization` percent; 0 =
    no compute limit), served by a test_manager until `close()`. `tier`
    (plain, latency, batch) gives the share a QoS tier and one QoS page for
    the GPU; each of `peers`, (name, tier, utilization, hard, limit), is
    another container on that page served by the same test_manager, as the
    node agent hands one page to every share of a GPU (`self.peers`)."""

    def __init__(self, node, name, quota, utilization=0, hard=True, limit=100, tier=None, peers=()):
        self.node, self.name, self.quota = node, name, quota
        self.dir = self._mkdir(node, name)
        self.peers = [Container._peer(node, p[0], quota) for p in peers]
        major, minor = node.driver_version.split(".")[:2]
        qos = ["--qos", tier, *(f"{c.dir}={p[1]}" for c, p in zip(self.peers, peers))] if tier else []
        self.proc = subprocess.Popen(
            [str(node.test_manager), str(self.dir), str(quota), f"{major}.{minor}", *qos],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines, ready = [], threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                if line.strip() == "ready":
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(15) or "ready" not in self.lines:
            self.close()
            raise RuntimeError(f"test_manager for {name} did not get ready: {self.proc.stderr.read()[-500:]}")
        # test_manager wrote a config for its own tests; ours replaces it (atomic
        # rename) before any process of this container starts.
        self.write_config(utilization, hard, limit)
        for c, p in zip(self.peers, peers):
            c.write_config(*p[2:])

    @staticmethod
    def _mkdir(node, name):
        d = pathlib.Path(node.work) / f"vm-{name}"
        d.mkdir(parents=True, exist_ok=False)
        return d

    @classmethod
    def _peer(cls, node, name, quota):
        c = cls.__new__(cls)
        c.node, c.name, c.quota, c.proc, c.peers = node, name, quota, None, []
        c.dir = cls._mkdir(node, name)
        return c

    def write_config(self, utilization, hard, limit):
        major, minor = self.node.driver_version.split(".")[:2]
        data = resource_data(pod_uid=f"gpu-suite-{self.name}", container_name="main", bus_id=self.node.bus_id,
                             gpu_memory=self.quota, utilization=utilization, hard_limit=hard, limit=limit,
                             driver_version=(int(major), int(minor)), enable=True)
        tmp = self.dir / "vcuda.config.tmp"
        tmp.write_bytes(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.dir / "vcuda.config")

    def env(self, extra=None):
        e = dict(os.environ)
        for k in ("LD_PRELOAD", "LOGGER_LEVEL", "PYTORCH_CUDA_ALLOC_CONF", "GPU_SIM_ROOT"):
            e.pop(k, None)
        rest = e.get("LD_LIBRARY_PATH")
        e["LD_LIBRARY_PATH"] = str(self.node.lib64) + (":" + rest if rest else "")
        e["VCUDA_CONFIG_DIR"] = str(self.dir)
        e["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        e["PYTHONPATH"] = str(self.node.libdir) + (":" + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
        e.update(extra or {})
        return e

    def pids(self):
        """Host PIDs registered now (pids.config)."""
        try:
            raw = (self.dir / "pids.config").read_bytes()
        except FileNotFoundError:
            return []
        return list(struct.unpack(f"={len(raw) // 4}i", raw[: len(raw) // 4 * 4]))

    def wait_pids(self, pids, timeout):
        """Whether all `pids` are registered (in pids.config) within `timeout` s."""
        end = time.monotonic() + timeout
        while not set(pids) <= set(self.pids()):
            if time.monotonic() > end:
                return False
            time.sleep(0.05)
        return True

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def outside_env(node, extra=None):
    """A process on the real driver (the mirror's untouched origin volume)."""
    e = dict(os.environ)
    e.pop("LD_PRELOAD", None)
    e.pop("GPU_SIM_ROOT", None)
    rest = e.get("LD_LIBRARY_PATH")
    e["LD_LIBRARY_PATH"] = str(node.origin_lib64) + (":" + rest if rest else "")
    e["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    e["PYTHONPATH"] = str(node.libdir) + (":" + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.update(extra or {})
    return e
