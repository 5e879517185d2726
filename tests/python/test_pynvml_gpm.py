"""GPM (GPU Performance Monitoring) per MIG GPU instance on the simulated
H100s through NVIDIA's own NVML bindings (nvidia-ml-py's pynvml,
unchanged): real NVML reports no per-process utilization in MIG mode, and
GPM per GPU instance is what a compute quota inside one is steered by.

A 3g.40gb and a 1g.10gb on GPU 0; a cuda-bindings process, pointed at the
3g by CUDA_VISIBLE_DEVICES=MIG-<uuid>, keeps it busy; two GPM samples of
each instance half a second apart read the 3g busy and the 1g idle.
"""

import os
import subprocess
import sys

import pytest

from conftest import CUDA_PRELUDE, install_node, lib_dir, nvml_client, run_client

client = nvml_client


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return install_node(tmp_path_factory.mktemp("gpm-h100"), "sim-mig-h100")


# Back-to-back batches of kernels on the one (MIG) device the process sees.
LOAD = CUDA_PRELUDE + """
ok(d.cuInit(0))
dev = ok(d.cuDeviceGet(0))
name = ok(d.cuDeviceGetName(64, dev)).split(b"\\0")[0].decode()
ctx = ok(d.cuCtxCreate(None, 0, dev))
f = ok(d.cuModuleGetFunction(ok(d.cuModuleLoadData(b"sim")), b"kernel"))
s = ok(d.cuStreamCreate(0))
print("ready", name, flush=True)
while True:
    for _ in range(8):
        ok(d.cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, s, 0, 0))
    ok(d.cuStreamSynchronize(s))
"""


def test_gpm_reads_the_busy_instance_busy_and_the_idle_one_idle(root):
    migs = client(
        root,
        """
        N.nvmlDeviceSetMigMode(gpu, N.NVML_DEVICE_MIG_ENABLE)
        for gi_profile, ci_profile in (
            (N.NVML_GPU_INSTANCE_PROFILE_3_SLICE, N.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE),
            (N.NVML_GPU_INSTANCE_PROFILE_1_SLICE, N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE),
        ):
            p = N.nvmlDeviceGetGpuInstanceProfileInfo(gpu, gi_profile)
            g = N.nvmlDeviceCreateGpuInstance(gpu, p.id)
            N.nvmlGpuInstanceCreateComputeInstance(g, ci_profile)
        out = {}
        for i in range(N.nvmlDeviceGetMaxMigDeviceCount(gpu)):
            try:
                m = N.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i)
            except N.NVMLError_NotFound:
                continue
            out[N.nvmlDeviceGetName(m).split()[-1]] = [N.nvmlDeviceGetUUID(m), N.nvmlDeviceGetGpuInstanceId(m)]
        print(json.dumps(out))
        """,
    )
    (busy_uuid, busy_gi), (_, idle_gi) = migs["3g.40gb"], migs["1g.10gb"]

    env = {k: v for k, v in os.environ.items() if k != "GPU_SIM_ROOT"}
    env["LD_LIBRARY_PATH"] = str(lib_dir(root))
    env["CUDA_VISIBLE_DEVICES"] = busy_uuid
    load = subprocess.Popen(
        [sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = load.stdout.readline().strip()
        if not line.startswith("ready"):
            load.kill()
            pytest.fail(f"load failed: {line}{load.stderr.read()}")
        assert line.endswith("MIG 3g.40gb"), line
        out = client(
            root,
            f"""
            mig = N.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
            try:
                N.nvmlGpmQueryDeviceSupport(mig)
                on_mig = "supported"
            except N.NVMLError as e:
                on_mig = e.value

            def metrics(s1, s2):
                mg = N.c_nvmlGpmMetricsGet_t()
                mg.version = N.NVML_GPM_METRICS_GET_VERSION
                mg.numMetrics = 3
                mg.sample1, mg.sample2 = s1, s2
                for i, m in enumerate((N.NVML_GPM_METRIC_SM_UTIL, N.NVML_GPM_METRIC_GRAPHICS_UTIL,
                                       N.NVML_GPM_METRIC_SM_OCCUPANCY)):
                    mg.metrics[i].metricId = m
                N.nvmlGpmMetricsGet(mg)
                return [[m.nvmlReturn, m.value, m.metricInfo.longName and m.metricInfo.longName.decode()]
                        for m in mg.metrics[:3]]

            busy, idle = [N.nvmlGpmSampleAlloc() for _ in range(2)], [N.nvmlGpmSampleAlloc() for _ in range(2)]
            time.sleep(0.2)  # the load in its stride
            for i in range(2):
                N.nvmlGpmMigSampleGet(gpu, {busy_gi}, busy[i])
                N.nvmlGpmMigSampleGet(gpu, {idle_gi}, idle[i])
                if i == 0:
                    time.sleep(0.5)
            res = {{
                "supported": N.nvmlGpmQueryDeviceSupport(gpu).isSupportedDevice,
                "on_mig": on_mig,
                "busy": metrics(busy[0], busy[1]),
                "idle": metrics(idle[0], idle[1]),
            }}
            for s in busy + idle:
                N.nvmlGpmSampleFree(s)
            print(json.dumps(res))
            """,
        )
    finally:
        load.kill()
        load.wait()

    assert out["supported"] == 1, "H100: Hopper"
    assert out["on_mig"] == N_INVALID_ARGUMENT, "support is asked of the parent GPU"
    (sm, gr, occ), idle = out["busy"], out["idle"]
    assert sm[0] == 0 and sm[1] > 80 and sm[2] == "SM_UTIL", out
    assert gr[0] == 0 and gr[1] > 80 and gr[2] == "GRAPHICS_UTIL", out
    assert occ[0] == N_NOT_SUPPORTED, out
    assert idle[0][0] == 0 and idle[0][1] < 5, out


# NVML return codes (nvml.h), spelled out so the test does not lean on pynvml
# for the values it checks.
N_INVALID_ARGUMENT = 2
N_NOT_SUPPORTED = 3
