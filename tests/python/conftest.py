"""Shared fixtures for the Python tests.

`sim_root`: a simulated GPU node installed once per session by the real
`gpu-sim install` (config/nodes/sim-1gpu.toml) into a temporary directory.
The binaries come from $VCUDA_TARGET_DIR (default <repo>/target/debug), which
must hold gpu-sim and the libraries it installs (`cargo build --workspace`).
Tests that load the simulated libraries run their client code in a subprocess
with LD_LIBRARY_PATH set (see `run_client`), because the driver libraries are
dlopened once per process and must come from the installed root.
"""

import os
import pathlib
import shutil
import json
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def target_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("VCUDA_TARGET_DIR", REPO / "target" / "debug"))


def context_cost(node: str = "sim-1gpu") -> int:
    """Device memory one context takes on a sample node: its overhead and
    its 8 MiB device heap (every process that creates a context pays it)."""
    import tomllib

    spec = tomllib.loads((REPO / "config" / "nodes" / f"{node}.toml").read_text())
    return (spec["gpu"][0].get("context_overhead_mib", 0) + 8) << 20


def install_node(root: pathlib.Path, node: str = "sim-1gpu") -> pathlib.Path:
    gpu_sim = target_dir() / "gpu-sim"
    if not gpu_sim.exists():
        pytest.fail(f"{gpu_sim} not found: run `cargo build --workspace` (or set VCUDA_TARGET_DIR)")
    subprocess.run(
        [str(gpu_sim), "install", "--node", str(REPO / "config" / "nodes" / f"{node}.toml"), "--root", str(root)],
        check=True,
        capture_output=True,
    )
    return root


@pytest.fixture(scope="session")
def sim_root(tmp_path_factory):
    """Root of a 1-GPU simulated node; also exported as VCUDA_SIM_ROOT."""
    root = install_node(tmp_path_factory.mktemp("sim-1gpu"))
    os.environ["VCUDA_SIM_ROOT"] = str(root)
    yield root


def lib_dir(root: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(root) / "usr" / "lib" / "x86_64-linux-gnu"


def run_client(root, code: str, env=None, timeout=120) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh Python whose only pointer to the simulated
    driver is LD_LIBRARY_PATH=<root>/usr/lib/x86_64-linux-gnu."""
    e = {k: v for k, v in os.environ.items() if k not in ("GPU_SIM_ROOT", "CUDA_VISIBLE_DEVICES")}
    e["LD_LIBRARY_PATH"] = str(lib_dir(root))
    e.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_shim_node(tmp_path_factory, quota: int):
    """Yields (sim root, interposer lib dir, config dir) of a node whose
    driver directory is mirrored like the vdriver `nvidia` volume, with a
    stand-in manager (cuda-shim's `test_manager` example) serving a
    container of `quota` bytes; stops the manager after."""
    root = install_node(tmp_path_factory.mktemp("shim-node"))
    # VCUDA_INTERPOSER: tests/run.sh runs these again on the glibc-2.17 build.
    shim = pathlib.Path(os.environ.get("VCUDA_INTERPOSER") or target_dir() / "libvcuda.so")
    manager = target_dir() / "examples" / "test_manager"
    for p in (shim, manager):
        if not p.exists():
            pytest.fail(f"{p} not found: run `cargo build --workspace --all-targets`")
    # Inside the root, so the sim's libraries (hard links) find their state.
    lib64 = root / "vdriver" / "nvidia" / "lib64"
    lib64.mkdir(parents=True)
    real = lib_dir(root)
    version = None
    for f in real.iterdir():
        if f.is_file() and not f.is_symlink() and (f.name.startswith("libcuda.so.") or f.name.startswith("libnvidia-ml.so.")):
            os.link(f, lib64 / f.name)
            if f.name.startswith("libcuda.so."):
                version = f.name[len("libcuda.so."):]
    shutil.copy2(shim, lib64 / "libvcuda.so")
    for name in ("libcuda.so", "libcuda.so.1", "libnvidia-ml.so", "libnvidia-ml.so.1"):
        os.link(lib64 / "libvcuda.so", lib64 / name)
    cfg = tmp_path_factory.mktemp("vcuda-config")
    major_minor = ".".join(version.split(".")[:2])
    proc = subprocess.Popen(
        [str(manager), str(cfg), str(quota), major_minor],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    yield root, lib64, cfg
    proc.stdin.close()
    proc.wait(timeout=10)


# cuda-bindings' driver module as `d`, and `ok`, which asserts success and
# returns the call's value(s).
CUDA_PRELUDE = """
import json
from cuda.bindings import driver as d

def ok(res):
    err, *rest = res if isinstance(res, tuple) else (res,)
    assert err == d.CUresult.CUDA_SUCCESS, err
    return rest[0] if len(rest) == 1 else rest
"""

NVML_PRELUDE = """
import json, time
import pynvml as N
N.nvmlInit()
gpu = N.nvmlDeviceGetHandleByIndex(0)
"""


def nvml_client(root, body):
    """Runs `body` in a client whose pynvml is initialised, GPU 0 as `gpu`;
    the JSON its last line prints."""
    p = run_client(root, NVML_PRELUDE + textwrap.dedent(body))
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])
