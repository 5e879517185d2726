"""MIG on the simulated node through NVIDIA's own NVML bindings
(nvidia-ml-py's pynvml, unchanged): the sim-mig-h100 node's H100s, enabled,
partitioned into a 3g.40gb and a 1g.10gb with compute instances, read back
as MIG devices, and torn down. Each client is a fresh Python whose only
pointer to the simulated driver is LD_LIBRARY_PATH (conftest.run_client);
every client sees what the previous one left, through the shared state.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import CUDA_PRELUDE, install_node, lib_dir, nvml_client, run_client

client = nvml_client


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return install_node(tmp_path_factory.mktemp("mig-h100"), "sim-mig-h100")


# A process holding a context on GPU 0 (cuda-bindings on the simulated libcuda).
HOLD = """
from cuda.bindings import driver as d
assert d.cuInit(0)[0] == d.CUresult.CUDA_SUCCESS
err, dev = d.cuDeviceGet(0)
err, ctx = d.cuCtxCreate(None, 0, dev)
assert err == d.CUresult.CUDA_SUCCESS, err
print("ready", flush=True)
import time
time.sleep(600)
"""


def test_mig_through_pynvml(root):
    # Not MIG-capable would raise NotSupported: these are, and start disabled.
    assert client(root, "print(json.dumps(N.nvmlDeviceGetMigMode(gpu)))") == [0, 0]

    # Busy GPU: the change stays pending, activation status IN_USE.
    env = {k: v for k, v in os.environ.items() if k != "GPU_SIM_ROOT"}
    env["LD_LIBRARY_PATH"] = str(lib_dir(root))
    hold = subprocess.Popen([sys.executable, "-c", HOLD], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "ready"
        out = client(
            root,
            """
            st = N.nvmlDeviceSetMigMode(gpu, N.NVML_DEVICE_MIG_ENABLE)
            print(json.dumps([st, N.nvmlDeviceGetMigMode(gpu)]))
            """,
        )
        assert out == [N_IN_USE, [0, 1]]
    finally:
        hold.kill()
        hold.wait()

    out = client(
        root,
        """
        st = N.nvmlDeviceSetMigMode(gpu, N.NVML_DEVICE_MIG_ENABLE)
        p1 = N.nvmlDeviceGetGpuInstanceProfileInfo(gpu, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
        p3 = N.nvmlDeviceGetGpuInstanceProfileInfo(gpu, N.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
        count = N.c_uint(0)
        places = (N.c_nvmlGpuInstancePlacement_t * 2)()
        N.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, p3.id, places, N.byref(count))
        g3 = N.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, p3.id, N.byref(places[1]))
        g1 = N.nvmlDeviceCreateGpuInstance(gpu, p1.id)
        try:
            N.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, p1.id, N.byref(N.c_nvmlGpuInstancePlacement_t(5, 1)))
            overlap = "created"
        except N.NVMLError as e:
            overlap = e.value
        c3 = N.nvmlGpuInstanceCreateComputeInstance(g3, N.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
        c1 = N.nvmlGpuInstanceCreateComputeInstance(g1, N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
        i3 = N.nvmlGpuInstanceGetInfo(g3)
        ci = N.nvmlComputeInstanceGetInfo(c3)
        print(json.dumps({
            "status": st,
            "mode": N.nvmlDeviceGetMigMode(gpu),
            "p1": [p1.id, p1.sliceCount, p1.instanceCount, p1.multiprocessorCount, p1.memorySizeMB,
                   p1.name.decode() if isinstance(p1.name, bytes) else p1.name],
            "p3": [p3.id, p3.multiprocessorCount, p3.memorySizeMB],
            "placements": [[p.start, p.size] for p in places[: count.value]],
            "overlap": overlap,
            "gi3": [i3.id, i3.profileId, i3.placement.start, i3.placement.size],
            "ci3": [ci.id, ci.profileId, ci.placement.start, ci.placement.size],
            "room_4g": N.nvmlDeviceGetGpuInstanceRemainingCapacity(
                gpu, N.nvmlDeviceGetGpuInstanceProfileInfo(gpu, N.NVML_GPU_INSTANCE_PROFILE_4_SLICE).id),
        }))
        """,
    )
    assert out["status"] == 0 and out["mode"] == [1, 1]
    assert out["p1"] == [19, 1, 7, 16, 9984, "MIG 1g.10gb"]
    assert out["p3"] == [9, 60, 40448]
    assert out["placements"] == [[0, 4], [4, 4]]
    assert out["overlap"] == N_INSUFFICIENT_RESOURCES
    assert out["gi3"] == [1, 9, 4, 4]
    assert out["ci3"] == [0, 2, 0, 3]
    assert out["room_4g"] == 0

    # A later process sees the MIG devices the earlier one made.
    out = client(
        root,
        """
        devs = []
        for i in range(N.nvmlDeviceGetMaxMigDeviceCount(gpu)):
            try:
                m = N.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i)
            except N.NVMLError_NotFound:
                continue
            a = N.nvmlDeviceGetAttributes(m)
            devs.append({
                "uuid": N.nvmlDeviceGetUUID(m),
                "name": N.nvmlDeviceGetName(m),
                "mig": N.nvmlDeviceIsMigDeviceHandle(m).value,
                "ids": [N.nvmlDeviceGetGpuInstanceId(m), N.nvmlDeviceGetComputeInstanceId(m)],
                "total": N.nvmlDeviceGetMemoryInfo(m).total,
                "attrs": [a.multiprocessorCount, a.gpuInstanceSliceCount, a.computeInstanceSliceCount, a.memorySizeMB],
                "parent_is_gpu": N.nvmlDeviceGetUUID(N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m))
                == N.nvmlDeviceGetUUID(gpu),
            })
        print(json.dumps({"max": N.nvmlDeviceGetMaxMigDeviceCount(gpu), "devs": devs}))
        """,
    )
    assert out["max"] == 7
    devs = out["devs"]
    assert [d["ids"] for d in devs] == [[1, 0], [7, 0]]
    assert [d["name"] for d in devs] == ["NVIDIA H100 80GB HBM3 MIG 3g.40gb", "NVIDIA H100 80GB HBM3 MIG 1g.10gb"]
    assert all(d["mig"] == 1 and d["parent_is_gpu"] for d in devs)
    assert all(d["uuid"].startswith("MIG-") and len(d["uuid"]) == 40 for d in devs)
    assert devs[0]["uuid"] != devs[1]["uuid"]
    assert devs[0]["total"] == 40448 << 20
    assert devs[0]["attrs"] == [60, 3, 3, 40448]
    assert devs[1]["attrs"] == [16, 1, 1, 9984]

    # nvidia-smi -L lists them under their GPU, as the real tool does.
    smi = subprocess.run(
        [str(root / "usr" / "bin" / "nvidia-smi"), "-L"], env=env, capture_output=True, text=True
    )
    lines = smi.stdout.splitlines()
    assert smi.returncode == 0, smi.stderr
    assert lines[0].startswith("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-"), lines
    assert lines[1:3] == [
        f"  MIG 3g.40gb     Device  0: (UUID: {devs[0]['uuid']})",
        f"  MIG 1g.10gb     Device  1: (UUID: {devs[1]['uuid']})",
    ], lines
    assert lines[3].startswith("GPU 1: "), lines
    lgip = subprocess.run(
        [str(root / "usr" / "bin" / "nvidia-smi"), "mig", "-lgip"], env=env, capture_output=True, text=True
    ).stdout.splitlines()
    rows = [line for line in lgip if "MIG " in line]
    assert rows[0] == "|   0  MIG 1g.10gb         19     3/7        9.75       No     16     1     0   |", lgip
    assert rows[4] == "|   0  MIG 3g.40gb          9     0/2       39.50       No     60     3     0   |", lgip
    assert all(len(line) == 81 for line in lgip), lgip

    # Stable UUIDs: the same on another read.
    again = client(root, "print(json.dumps(N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0))))")
    assert again == devs[0]["uuid"]

    # Tear down: a GI with a CI is in use; CIs first, then GIs, then MIG off.
    out = client(
        root,
        """
        res = []
        for gid in (1, 7):
            g = N.nvmlDeviceGetGpuInstanceById(gpu, gid)
            try:
                N.nvmlGpuInstanceDestroy(g)
                res.append("destroyed with a CI")
            except N.NVMLError as e:
                res.append(e.value)
            c = N.nvmlGpuInstanceGetComputeInstanceById(g, 0)
            N.nvmlComputeInstanceDestroy(c)
            N.nvmlGpuInstanceDestroy(g)
        st = N.nvmlDeviceSetMigMode(gpu, N.NVML_DEVICE_MIG_DISABLE)
        print(json.dumps([res, st, N.nvmlDeviceGetMigMode(gpu), N.nvmlDeviceGetMaxMigDeviceCount(gpu)]))
        """,
    )
    assert out == [[N_IN_USE, N_IN_USE], 0, [0, 0], 0]


# NVML return codes (nvml.h), spelled out so the test does not lean on pynvml
# for the values it checks.
N_IN_USE = 19
N_INSUFFICIENT_RESOURCES = 23


def test_cuda_bindings_see_one_mig_device(tmp_path):
    """NVIDIA's cuda-bindings in a process given CUDA_VISIBLE_DEVICES=MIG-…
    (what a pod given a MIG device gets) see that instance as their one
    device: its UUID, its memory and SM count, and a kernel that runs; the
    other instance and the whole GPUs stay out of sight."""
    root = install_node(tmp_path, "sim-mig-h100")
    made = client(
        root,
        """
        N.nvmlDeviceSetMigMode(gpu, N.NVML_DEVICE_MIG_ENABLE)
        uuids = []
        for p, c in ((N.NVML_GPU_INSTANCE_PROFILE_2_SLICE, N.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE),
                     (N.NVML_GPU_INSTANCE_PROFILE_1_SLICE, N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)):
            g = N.nvmlDeviceCreateGpuInstance(gpu, N.nvmlDeviceGetGpuInstanceProfileInfo(gpu, p).id)
            N.nvmlGpuInstanceCreateComputeInstance(g, c)
        for i in range(N.nvmlDeviceGetMaxMigDeviceCount(gpu)):
            try:
                uuids.append(N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i)))
            except N.NVMLError_NotFound:
                pass
        print(json.dumps(uuids))
        """,
    )
    assert len(made) == 2, made
    two_g = made[0]
    p = run_client(
        root,
        CUDA_PRELUDE
        + textwrap.dedent(
            """
        ok(d.cuInit(0))
        dev = ok(d.cuDeviceGet(0))
        A = d.CUdevice_attribute
        ctx = ok(d.cuCtxCreate(None, 0, dev))
        mod = ok(d.cuModuleLoadData(b"not a real cubin"))
        f = ok(d.cuModuleGetFunction(mod, b"kernel"))
        s = ok(d.cuStreamCreate(0))
        ok(d.cuLaunchKernel(f, 64, 1, 1, 128, 1, 1, 0, s, 0, 0))
        ok(d.cuStreamSynchronize(s))
        free, total = ok(d.cuMemGetInfo())
        print(json.dumps({
            "count": ok(d.cuDeviceGetCount()),
            "uuid": bytes(ok(d.cuDeviceGetUuid(dev)).bytes).hex(),
            "name": ok(d.cuDeviceGetName(96, dev)).split(b"\\0")[0].decode(),
            "total": ok(d.cuDeviceTotalMem(dev)),
            "meminfo_total": total,
            "sms": ok(d.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)),
            "second": int(d.cuDeviceGet(1)[0]),
        }))
        """
        ),
        env={"CUDA_VISIBLE_DEVICES": two_g},
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    # MIG-xxxxxxxx-xxxx-…: the device's 16 UUID bytes are the MIG UUID's.
    assert out["uuid"] == two_g[4:].replace("-", ""), (out, two_g)
    assert out["count"] == 1
    assert out["second"] == 101  # CUDA_ERROR_INVALID_DEVICE
    # 2g.20gb on an H100 80GB: 32 SMs, 20096 MiB (19.62 GiB in the MIG user
    # guide's `nvidia-smi mig -lgip` table for the H100).
    assert out["sms"] == 32
    assert out["total"] == 20096 << 20 and out["meminfo_total"] == out["total"]
    assert out["name"] == "NVIDIA H100 80GB HBM3 MIG 2g.20gb"
