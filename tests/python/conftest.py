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
