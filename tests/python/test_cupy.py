"""CuPy, unmodified from PyPI's cupy-cuda13x wheel, on the simulated node:
NVIDIA's libcudart 13 and NVRTC underneath (their wheels), kernels compiled
by NVRTC at run time and loaded by the simulator (which times them and
computes nothing), directly and under the interposer with a memory quota:
device count, memory info, allocation to OutOfMemoryError, a captured CUDA
graph replayed. The runtime gets going through the simulator's export
tables (crates/sim/gpu-sim-cuda/src/export_table.rs). tests/run.sh installs the
wheels (cached in $VCUDA_CACHE/wheels).
"""

import json
import textwrap

import pytest

from conftest import run_client
from test_shim_clients import QUOTA, shim_node  # noqa: F401  (the fixture)

MIB = 1 << 20

CLIENT = """
import json, cupy as cp
out = {"count": cp.cuda.runtime.getDeviceCount()}
out["free"], out["total"] = cp.cuda.runtime.memGetInfo()
a = cp.arange(1 << 20, dtype=cp.float32)
b = a * 2 + 1  # an elementwise kernel, NVRTC-compiled
float(b.sum())  # a reduction, and a copy back
blocks = []
try:
    while True:
        blocks.append(cp.empty(256 << 20, dtype=cp.uint8))
except cp.cuda.memory.OutOfMemoryError as e:
    out["oom"] = type(e).__name__
out["allocated"] = len(blocks) * (256 << 20)
del blocks
cp.get_default_memory_pool().free_all_blocks()
out["free_end"] = cp.cuda.runtime.memGetInfo()[0]
s = cp.cuda.Stream(non_blocking=True)
with s:
    s.begin_capture()
    for _ in range(4):
        b = b * 2
    g = s.end_capture()
    for _ in range(10):
        g.launch()
    s.synchronize()
out["graph"] = True
print(json.dumps(out))
"""


def cupy_client(root, env=None):
    p = run_client(root, CLIENT, env=env)
    if "No module named 'cupy'" in p.stderr:
        pytest.fail("cupy is not installed: tests/run.sh installs cupy-cuda13x and its CUDA wheels")
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def check(out, total):
    assert out["count"] == 1
    assert out["total"] == total
    assert out["oom"] == "OutOfMemoryError"
    # Refused within one block (and the client's two 4 MiB arrays and the
    # pool's leftovers) of what was free.
    assert out["free"] - 320 * MIB < out["allocated"] <= out["free"], out
    assert out["free_end"] >= out["free"] - 64 * MIB, out
    assert out["graph"]


def test_cupy_runs_on_the_simulated_node(sim_root):
    import tomllib

    from conftest import REPO

    spec = tomllib.loads((REPO / "config" / "nodes" / "sim-1gpu.toml").read_text())
    check(cupy_client(sim_root), spec["gpu"][0]["memory_mib"] * MIB)


def test_cupy_stops_at_the_quota_under_the_interposer(shim_node):  # noqa: F811
    root, lib64, cfg = shim_node
    out = cupy_client(root, env={"LD_LIBRARY_PATH": str(lib64), "VCUDA_CONFIG_DIR": str(cfg)})
    check(out, QUOTA)
    print(textwrap.shorten(json.dumps(out), 200))
