"""NVIDIA's cuda-bindings (cuda.bindings.driver) against the simulated driver.

The bindings find libcuda.so.1 by plain dlopen and resolve every entry point
through cuGetProcAddress_v2, so this checks the sim the way real clients use
it: only LD_LIBRARY_PATH points into the installed root.
"""

import json
import textwrap

from conftest import CUDA_PRELUDE, context_cost, run_client

PRELUDE = CUDA_PRELUDE + """
def kernel_setup():
    # cuInit, a context on device 0, the sim's fake module's `kernel` and a
    # stream: (dev, ctx, f, s).
    ok(d.cuInit(0))
    dev = ok(d.cuDeviceGet(0))
    ctx = ok(d.cuCtxCreate(None, 0, dev))
    mod = ok(d.cuModuleLoadData(b"not a real cubin"))
    f = ok(d.cuModuleGetFunction(mod, b"kernel"))
    return dev, ctx, f, ok(d.cuStreamCreate(0))
"""


def client(sim_root, body, env=None):
    p = run_client(sim_root, PRELUDE + textwrap.dedent(body), env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_devices_and_attributes(sim_root):
    out = client(
        sim_root,
        """
        ok(d.cuInit(0))
        dev = ok(d.cuDeviceGet(0))
        A = d.CUdevice_attribute
        attr = lambda a: ok(d.cuDeviceGetAttribute(a, dev))
        print(json.dumps({
            "version": ok(d.cuDriverGetVersion()),
            "count": ok(d.cuDeviceGetCount()),
            "name": ok(d.cuDeviceGetName(96, dev)).split(b"\\0")[0].decode(),
            "uuid": bytes(ok(d.cuDeviceGetUuid(dev)).bytes).hex(),
            "total": ok(d.cuDeviceTotalMem(dev)),
            "sms": attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            "major": attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            "minor": attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            "warp": attr(A.CU_DEVICE_ATTRIBUTE_WARP_SIZE),
            "threads": attr(A.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            "bus": attr(A.CU_DEVICE_ATTRIBUTE_PCI_BUS_ID),
            "pools": attr(A.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED),
            "vmm": attr(A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED),
            "bad_dev": int(d.cuDeviceGet(5)[0]),
        }))
        """,
    )
    assert out["version"] == 13000
    assert out["count"] == 1
    assert out["name"] == "NVIDIA A100-SXM4-40GB"
    assert out["uuid"] == "6f61d573f4c55a3a8902f931468a1784"
    assert out["total"] == 40960 << 20
    assert (out["sms"], out["major"], out["minor"]) == (108, 8, 0)
    assert (out["warp"], out["threads"], out["bus"]) == (32, 1024, 7)
    assert out["pools"] == 1 and out["vmm"] == 1
    assert out["bad_dev"] == 101  # CUDA_ERROR_INVALID_DEVICE


def test_context_memory_and_oom(sim_root):
    out = client(
        sim_root,
        """
        ok(d.cuInit(0))
        dev = ok(d.cuDeviceGet(0))
        ctx = ok(d.cuCtxCreate(None, 0, dev))
        assert int(ok(d.cuCtxGetCurrent())) == int(ctx)
        assert int(ok(d.cuCtxGetDevice())) == 0
        free0, total = ok(d.cuMemGetInfo())
        ptr = ok(d.cuMemAlloc(1 << 30))
        free1, _ = ok(d.cuMemGetInfo())
        ok(d.cuMemsetD8(ptr, 7, 16))
        back = bytearray(16)
        ok(d.cuMemcpyDtoH(back, ptr, 16))
        oom = d.cuMemAlloc(total + 1)[0]
        name = ok(d.cuGetErrorName(oom)).decode()
        ok(d.cuMemFree(ptr))
        free2, _ = ok(d.cuMemGetInfo())
        ok(d.cuCtxSynchronize())
        ok(d.cuCtxDestroy(ctx))
        print(json.dumps({"free0": free0, "free1": free1, "free2": free2, "total": total,
                          "back": list(back), "oom": int(oom), "name": name}))
        """,
    )
    assert out["total"] == 40960 << 20
    assert out["free0"] == out["total"] - context_cost(), "the context takes its share"
    assert out["free0"] - out["free1"] == 1 << 30
    assert out["free2"] == out["free0"]
    assert out["back"] == [7] * 16
    assert out["oom"] == 2 and out["name"] == "CUDA_ERROR_OUT_OF_MEMORY"


def test_launch_and_stream_sync(sim_root):
    out = client(
        sim_root,
        """
        import time
        dev, ctx, f, s = kernel_setup()
        t0 = time.monotonic()
        for _ in range(10):  # 100 waves of 10 us each = 1 ms per launch
            ok(d.cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, s, 0, 0))
        busy = int(d.cuStreamQuery(s)[0])
        ok(d.cuStreamSynchronize(s))
        print(json.dumps({"busy": busy, "waited_ms": (time.monotonic() - t0) * 1e3}))
        """,
    )
    assert out["busy"] == 600  # CUDA_ERROR_NOT_READY while kernels run
    assert out["waited_ms"] >= 9.5


def test_per_thread_default_stream_mode(sim_root):
    out = client(
        sim_root,
        """
        ok(d.cuInit(0))
        ok(d.cuCtxCreate(None, 0, ok(d.cuDeviceGet(0))))
        ptr = ok(d.cuMemAlloc(64))
        ok(d.cuMemsetD32(ptr, 5, 16))
        back = bytearray(64)
        ok(d.cuMemcpyDtoH(back, ptr, 64))
        print(json.dumps({"back": list(back[:8])}))
        """,
        env={"CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM": "1"},
    )
    assert out["back"] == [5, 0, 0, 0, 5, 0, 0, 0]


def test_missing_state_is_a_clear_error(sim_root, tmp_path):
    import shutil

    from conftest import lib_dir

    # A copy of the libraries with no installed state anywhere above them.
    libs = tmp_path / "usr" / "lib" / "x86_64-linux-gnu"
    shutil.copytree(lib_dir(sim_root), libs, symlinks=True)
    p = run_client(
        tmp_path,
        PRELUDE + "\nprint(json.dumps({'init': int(d.cuInit(0)[0])}))\n",
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip())["init"] == 100  # CUDA_ERROR_NO_DEVICE
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "gpu-sim install" in lines[0], p.stderr
