"""The interposer (cuda-shim) under NVIDIA's own Python clients.

cuda-bindings resolves every driver function through cuGetProcAddress_v2 and
pynvml dlopens libnvidia-ml.so.1, so these check that neither path escapes
the quota. The node: a simulated GPU whose driver directory is mirrored like
the vdriver `nvidia` volume (the interposer as libcuda.so.1 and
libnvidia-ml.so.1, hard links of one file, beside the real versioned
libraries), and a stand-in manager (cuda-shim's `test_manager` example,
built by `cargo build --workspace --all-targets`) serving vcuda.sock.
"""

import json
import os
import shutil
import subprocess
import textwrap

import pytest

from conftest import context_cost, lib_dir, run_client, start_shim_node

GIB = 1 << 30
# What a client's context takes (counted through the NVML reconcile).
CTX = context_cost()
# Four gigabytes beside one context.
QUOTA = 4 * GIB + CTX


@pytest.fixture(scope="module")
def shim_node(tmp_path_factory):
    """(sim root, interposer lib dir, config dir) with a manager running."""
    yield from start_shim_node(tmp_path_factory, QUOTA)


def shim_client(node, body, env=None):
    root, lib64, cfg = node
    e = {"LD_LIBRARY_PATH": str(lib64), "VCUDA_CONFIG_DIR": str(cfg)}
    e.update(env or {})
    p = run_client(root, PRELUDE + textwrap.dedent(body), env=e)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


PRELUDE = """
import json
from cuda.bindings import driver as d

def ok(res):
    err, *rest = res if isinstance(res, tuple) else (res,)
    assert err == d.CUresult.CUDA_SUCCESS, err
    return rest[0] if len(rest) == 1 else rest

def fill(alloc, free):
    held = []
    while True:
        err, p = alloc()
        if err != d.CUresult.CUDA_SUCCESS:
            break
        held.append(p)
    for p in held:
        ok(free(p))
    return len(held), int(err)
"""

FILL = """
ok(d.cuInit(0))
dev = ok(d.cuDeviceGet(0))
ctx = ok(d.cuCtxCreate(None, 0, dev))
free0, total0 = ok(d.cuMemGetInfo())
n, err = fill(lambda: d.cuMemAlloc(GIB), d.cuMemFree)
s = ok(d.cuStreamCreate(0))
na, erra = fill(lambda: d.cuMemAllocAsync(GIB, s), lambda p: d.cuMemFreeAsync(p, s))
ok(d.cuStreamSynchronize(s))
free1, total1 = ok(d.cuMemGetInfo())
print(json.dumps({
    "total": int(total0), "free": int(free0), "device_total": int(ok(d.cuDeviceTotalMem(dev))),
    "n": n, "err": err, "async_n": na, "async_err": erra, "free_after": int(free1),
}))
"""


@pytest.mark.parametrize("ptds", ["0", "1"])
def test_cuda_bindings_allocations_stop_at_the_quota(shim_node, ptds):
    # PTDS mode makes cuda-bindings ask for the _ptsz variants.
    out = shim_client(
        shim_node,
        f"GIB = {GIB}\n" + FILL,
        env={"CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM": ptds},
    )
    assert out["total"] == QUOTA
    assert out["free"] == QUOTA - CTX
    assert out["device_total"] == QUOTA
    assert (out["n"], out["err"]) == (QUOTA // GIB, 2)  # CUDA_ERROR_OUT_OF_MEMORY
    assert (out["async_n"], out["async_err"]) == (QUOTA // GIB, 2)
    assert out["free_after"] == QUOTA - CTX


def test_cuda_bindings_vmm_and_pools(shim_node):
    out = shim_client(
        shim_node,
        f"""
        GIB = {GIB}
        ok(d.cuInit(0))
        dev = ok(d.cuDeviceGet(0))
        ctx = ok(d.cuCtxCreate(None, 0, dev))
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        vmm = fill(lambda: d.cuMemCreate(GIB, prop, 0), d.cuMemRelease)
        props = d.CUmemPoolProps()
        props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = 0
        pool = ok(d.cuMemPoolCreate(props))
        s = ok(d.cuStreamCreate(0))
        pooled = fill(lambda: d.cuMemAllocFromPoolAsync(GIB, pool, s), lambda p: d.cuMemFreeAsync(p, s))
        ok(d.cuStreamSynchronize(s))
        print(json.dumps({{"vmm": vmm, "pool": pooled, "free": int(ok(d.cuMemGetInfo())[0])}}))
        """,
    )
    assert out["vmm"] == [QUOTA // GIB, 2]
    assert out["pool"] == [QUOTA // GIB, 2]
    assert out["free"] == QUOTA - CTX


def test_pynvml_sees_the_quota_and_only_the_containers_processes(shim_node):
    root, _, _ = shim_node
    # A process of another tenant on the same GPU, straight on the driver.
    outsider = subprocess.Popen(
        ["python3", "-c", PRELUDE + textwrap.dedent("""
            import sys
            ok(d.cuInit(0))
            ctx = ok(d.cuCtxCreate(None, 0, ok(d.cuDeviceGet(0))))
            p = ok(d.cuMemAlloc(3 << 30))
            print("held", flush=True)
            sys.stdin.read()
            """)],
        env={**os.environ, "LD_LIBRARY_PATH": str(lib_dir(root))},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert outsider.stdout.readline().strip() == "held"
        out = shim_client(
            shim_node,
            f"""
            import os, pynvml as N
            ok(d.cuInit(0))
            ctx = ok(d.cuCtxCreate(None, 0, ok(d.cuDeviceGet(0))))
            p = ok(d.cuMemAlloc({GIB}))
            N.nvmlInit()
            h = N.nvmlDeviceGetHandleByIndex(0)
            m = N.nvmlDeviceGetMemoryInfo(h)
            m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
            procs = [q.pid for q in N.nvmlDeviceGetComputeRunningProcesses(h)]
            detail = [q.pid for q in N.nvmlDeviceGetRunningProcessDetailList(
                h, N.nvmlProcessDetailList_v1, N.NVML_PROCESS_MODE_COMPUTE)]
            acct = N.nvmlDeviceGetAccountingPids(h)
            try:
                N.nvmlDeviceGetAccountingStats(h, {outsider.pid})
                other_stats = "found"
            except N.NVMLError_NotFound:
                other_stats = "not found"
            N.nvmlShutdown()
            print(json.dumps({{"total": m.total, "used": m.used, "free": m.free,
                               "total2": m2.total, "used2": m2.used, "free2": m2.free,
                               "procs": procs, "detail": detail, "acct": acct,
                               "other_stats": other_stats, "me": os.getpid()}}))
            """,
        )
    finally:
        outsider.stdin.close()
        outsider.wait(timeout=10)
    used = GIB + CTX
    assert (out["total"], out["used"], out["free"]) == (QUOTA, used, QUOTA - used)
    assert (out["total2"], out["used2"], out["free2"]) == (QUOTA, used, QUOTA - used)
    assert out["procs"] == [out["me"]], out
    assert outsider.pid not in out["procs"]
    # The other per-process queries hide the outsider too.
    assert out["detail"] == [out["me"]], out
    assert out["acct"] == [out["me"]], out
    assert out["other_stats"] == "not found"


def test_pynvml_alone_neither_registers_nor_waits_for_a_missing_manager(shim_node, tmp_path):
    # The container's config, but no manager behind vcuda.sock: a CUDA
    # process would wait for it (60 s here) and fail closed; an NVML-only
    # tool answers at once from the ledger file, without a slot.
    root, lib64, cfg = shim_node
    lonely = tmp_path / "vm"
    lonely.mkdir()
    shutil.copy2(cfg / "vcuda.config", lonely / "vcuda.config")
    shutil.copy2(cfg / "ledger", lonely / "ledger")
    p = run_client(
        root,
        textwrap.dedent("""
            import json, time, pynvml as N
            t = time.monotonic()
            N.nvmlInit()
            h = N.nvmlDeviceGetHandleByIndex(0)
            m = N.nvmlDeviceGetMemoryInfo(h)
            procs = N.nvmlDeviceGetComputeRunningProcesses(h)
            N.nvmlShutdown()
            print(json.dumps({"total": m.total, "secs": time.monotonic() - t}))
            """),
        env={"LD_LIBRARY_PATH": str(lib64), "VCUDA_CONFIG_DIR": str(lonely),
             "VCUDA_REGISTER_TIMEOUT_MS": "60000"},
        timeout=50,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["total"] == QUOTA
    assert out["secs"] < 30, out
