"""NVIDIA's NVML bindings (nvidia-ml-py, module pynvml) against the simulated
libnvidia-ml.so.1.

pynvml loads the library with ctypes.CDLL("libnvidia-ml.so.1"), so every
client runs in a fresh Python whose only pointer into the installed root is
LD_LIBRARY_PATH (conftest.run_client). Load comes from other real clients:
cuda-bindings processes allocating memory and launching kernels on the
simulated libcuda.
"""

import json
import os
import subprocess
import sys
import textwrap
import time
import tomllib

import pytest

from conftest import REPO, context_cost, install_node, lib_dir, run_client, target_dir

PRELUDE = """
import json, time
import pynvml as N
"""


def client(root, body):
    p = run_client(root, PRELUDE + textwrap.dedent(body))
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def node(name):
    with open(REPO / "config" / "nodes" / f"{name}.toml", "rb") as f:
        return tomllib.load(f)


@pytest.fixture(scope="module")
def root1(tmp_path_factory):
    """A 1-GPU node of this module's own, so no other test's kernels are on
    its timeline when utilization is measured."""
    return install_node(tmp_path_factory.mktemp("nvml-1gpu"), "sim-1gpu")


@pytest.fixture(scope="module")
def root4(tmp_path_factory):
    return install_node(tmp_path_factory.mktemp("nvml-4gpu"), "sim-4gpu-pcie")


# A load process: cuda-bindings on the simulated libcuda. On sim-1gpu a
# launch of 86400 blocks of 256 threads is 100 waves of 10 us = 1 ms.
LOAD = """
import sys, time
from cuda.bindings import driver as d

def ok(res):
    err, *rest = res if isinstance(res, tuple) else (res,)
    assert err == d.CUresult.CUDA_SUCCESS, err
    return rest[0] if len(rest) == 1 else rest

mode, mem_mib = sys.argv[1], int(sys.argv[2])
ok(d.cuInit(0))
ctx = ok(d.cuCtxCreate(None, 0, ok(d.cuDeviceGet(0))))
if mem_mib:
    ok(d.cuMemAlloc(mem_mib << 20))
f = ok(d.cuModuleGetFunction(ok(d.cuModuleLoadData(b"sim")), b"kernel"))
s = ok(d.cuStreamCreate(0))
MS = 86400
print("ready", flush=True)
t0 = time.monotonic()
period = 0
while True:
    if mode == "hold":
        time.sleep(1)
    elif mode == "saturate":
        # Batches of 1 ms kernels: while one process synchronizes, the
        # other's batch keeps the device busy.
        for _ in range(8):
            ok(d.cuLaunchKernel(f, MS, 1, 1, 256, 1, 1, 0, s, 0, 0))
        ok(d.cuStreamSynchronize(s))
    elif mode == "half":
        # 10 ms of kernels at the start of every 20 ms period.
        ok(d.cuLaunchKernel(f, 10 * MS, 1, 1, 256, 1, 1, 0, s, 0, 0))
        ok(d.cuStreamSynchronize(s))
        period += 1
        time.sleep(max(0.0, t0 + period * 0.020 - time.monotonic()))
"""


class Load:
    def __init__(self, root, mode, mem_mib=0):
        env = {k: v for k, v in os.environ.items() if k != "GPU_SIM_ROOT"}
        env["LD_LIBRARY_PATH"] = str(lib_dir(root))
        self.p = subprocess.Popen(
            [sys.executable, "-c", LOAD, mode, str(mem_mib)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.p.stdout.readline()
        if line.strip() != "ready":
            self.p.kill()
            raise AssertionError(f"load {mode} failed: {line}{self.p.stderr.read()}")
        self.pid = self.p.pid

    def stop(self):
        self.p.kill()
        self.p.wait()


@pytest.fixture
def loads():
    started = []

    def start(root, mode, mem_mib=0):
        load = Load(root, mode, mem_mib)
        started.append(load)
        return load

    yield start
    for load in started:
        load.stop()


def test_init_count_names_uuids_memory(root4):
    spec = node("sim-4gpu-pcie")
    out = client(
        root4,
        """
        N.nvmlInit()
        devs = []
        for i in range(N.nvmlDeviceGetCount()):
            h = N.nvmlDeviceGetHandleByIndex(i)
            m = N.nvmlDeviceGetMemoryInfo(h)
            m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
            pci = N.nvmlDeviceGetPciInfo(h)
            devs.append({
                "name": N.nvmlDeviceGetName(h),
                "uuid": N.nvmlDeviceGetUUID(h),
                "minor": N.nvmlDeviceGetMinorNumber(h),
                "bus": pci.busId,
                "mem": [m.total, m.free, m.used],
                "mem2": [m2.total, m2.free, m2.used],
                "cc": list(N.nvmlDeviceGetCudaComputeCapability(h)),
            })
        by_uuid = N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(devs[2]["uuid"]))
        print(json.dumps({
            "driver": N.nvmlSystemGetDriverVersion(),
            "cuda": N.nvmlSystemGetCudaDriverVersion(),
            "devs": devs,
            "by_uuid": by_uuid,
        }))
        N.nvmlShutdown()
        """,
    )
    assert out["driver"] == spec["driver_version"]
    major, minor = spec["cuda_version"].split(".")
    assert out["cuda"] == int(major) * 1000 + int(minor) * 10
    assert len(out["devs"]) == len(spec["gpu"])
    for got, want in zip(out["devs"], spec["gpu"]):
        total = want["memory_mib"] << 20
        assert got["name"] == want["name"]
        assert got["uuid"] == want["uuid"]
        assert got["minor"] == want["minor"]
        assert got["bus"] == want["pci_bus_id"]
        assert got["mem"] == [total, total, 0]
        assert got["mem2"] == [total, total, 0]
        assert got["cc"] == [int(x) for x in want["compute_capability"].split(".")]
    assert out["by_uuid"] == 2


def test_topology_common_ancestor(root4):
    out = client(
        root4,
        """
        N.nvmlInit()
        h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(4)]
        lvl = {f"{a}{b}": N.nvmlDeviceGetTopologyCommonAncestor(h[a], h[b])
               for a in range(4) for b in range(4) if a < b}
        print(json.dumps(lvl))
        """,
    )
    single, system = 10, 50  # NVML_TOPOLOGY_SINGLE, NVML_TOPOLOGY_SYSTEM
    # 0,1 and 2,3 share a PCIe switch; the pairs sit on different sockets.
    assert out == {"01": single, "23": single, "02": system, "03": system, "12": system, "13": system}


def test_running_processes_by_pid_and_shared_memory(root1, loads):
    a = loads(root1, "hold", 1024)
    b = loads(root1, "hold", 512)
    out = client(
        root1,
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        procs = [[p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses(h)]
        print(json.dumps({
            "procs": sorted(procs),
            "graphics": len(N.nvmlDeviceGetGraphicsRunningProcesses(h)),
            "used": N.nvmlDeviceGetMemoryInfo(h).used,
        }))
        """,
    )
    # Each holder's context and its module image (one 4 KiB page) count as
    # its memory, as a real driver's do.
    c = context_cost() + 4096
    assert out["procs"] == sorted([[a.pid, (1024 << 20) + c], [b.pid, (512 << 20) + c]])
    assert out["graphics"] == 0
    assert out["used"] == (1536 << 20) + 2 * c


# Mean smUtil per PID over the samples of the last second, and the
# device's rate as the mean of six readings over the next second: one
# reading covers one sampling window (1/6 s), which a load helper's late
# wake-up on a busy host moves by several points (43 % for the half-busy
# one beside the 1.20 suite at 529f874, its per-PID mean 50.0).
PER_PROCESS = """
N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
since = int((time.time() - 1.0) * 1e6)
per = {}
for s in N.nvmlDeviceGetProcessUtilization(h, since):
    assert s.timeStamp > since
    per.setdefault(s.pid, []).append(s.smUtil)
rates = []
for _ in range(6):
    rates.append(N.nvmlDeviceGetUtilizationRates(h).gpu)
    time.sleep(1 / 6)
print(json.dumps({
    "per": {str(p): sum(v) / len(v) for p, v in per.items()},
    "n": {str(p): len(v) for p, v in per.items()},
    "device": sum(rates) / len(rates),
}))
"""


def test_process_utilization_two_saturating_processes(root1, loads):
    a = loads(root1, "saturate")
    b = loads(root1, "saturate")
    time.sleep(1.5)
    out = client(root1, PER_PROCESS)
    print("two saturating processes:", out)
    assert set(out["per"]) == {str(a.pid), str(b.pid)}, out
    for pid, util in out["per"].items():
        assert abs(util - 50) <= 5, out
        assert out["n"][pid] >= 5, out
    assert out["device"] >= 95, out


def test_half_busy_process_reads_half(root1, loads):
    a = loads(root1, "half")
    time.sleep(1.5)
    out = client(root1, PER_PROCESS)
    print("half-busy process:", out)
    assert abs(out["device"] - 50) <= 5, out
    assert abs(out["per"][str(a.pid)] - 50) <= 5, out


def test_no_samples_is_not_found(root4):
    out = client(
        root4,
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(3)
        try:
            N.nvmlDeviceGetProcessUtilization(h, 0)
            err = None
        except N.NVMLError as e:
            err = e.value
        print(json.dumps({"err": err}))
        """,
    )
    assert out["err"] == 6  # NVML_ERROR_NOT_FOUND


def test_xid_from_gpu_sim_reaches_event_wait(root4):
    code = PRELUDE + textwrap.dedent(
        """
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(1)
        es = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, es)
        try:
            N.nvmlEventSetWait(es, 50)
            raise SystemExit("no event was injected yet")
        except N.NVMLError_Timeout:
            pass
        print("armed", flush=True)
        ev = N.nvmlEventSetWait(es, 10000)
        print(json.dumps({
            "type": ev.eventType,
            "data": ev.eventData,
            "uuid": N.nvmlDeviceGetUUID(ev.device),
        }))
        N.nvmlEventSetFree(es)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "GPU_SIM_ROOT"}
    env["LD_LIBRARY_PATH"] = str(lib_dir(root4))
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "armed", p.stderr.read()
        subprocess.run(
            [str(target_dir() / "gpu-sim"), "xid", "--root", str(root4), "--gpu", "1", "--code", "79"],
            check=True,
            capture_output=True,
        )
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 0, err
    ev = json.loads(out.strip().splitlines()[-1])
    assert ev["type"] == 8  # nvmlEventTypeXidCriticalError
    assert ev["data"] == 79
    assert ev["uuid"] == node("sim-4gpu-pcie")["gpu"][1]["uuid"]
