"""The real-GPU suite (run through tests/gpu/run.sh): mirrors the driver with
the manager's mirror code, serves each case's container with the
registration stand-in, runs the cases under the interposer and prints a table.
Exit status: 0 all PASS; 1 any FAIL; 3 something NOT RUN (unless
--allow-not-run, for the simulated node); 2 bad usage."""

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE / "lib"))
sys.path.insert(0, str(HERE))

import cases_compute  # noqa: E402
import cases_mem  # noqa: E402
import cases_qos  # noqa: E402
import cudrv  # noqa: E402
from harness import FAIL, NOT_RUN, PASS, NotRun, Row  # noqa: E402

# (id, label for rows that never got to measure, function(node) -> Row)
CASES = [
    ("oom-torch", "torch: 256 MiB blocks to OOM", lambda n: cases_mem.oom(n, "torch")),
    ("oom-driver", "driver: 256 MiB blocks to OOM", lambda n: cases_mem.oom(n, "driver")),
    ("oom-torch-expandable", "torch-expandable: 256 MiB blocks to OOM",
     lambda n: cases_mem.oom(n, "torch-expandable")),
    ("ipc-torch", "torch: a 1 GiB tensor over CUDA IPC between two processes of the share", cases_mem.ipc),
    ("meminfo-torch", "torch: torch.cuda.mem_get_info", lambda n: cases_mem.mem_get_info(n, "torch")),
    ("meminfo-driver", "driver: cuMemGetInfo", lambda n: cases_mem.mem_get_info(n, "driver")),
    ("race-torch", "torch: two processes racing to OOM", lambda n: cases_mem.race(n, "torch")),
    ("race-driver", "driver: two processes racing to OOM", lambda n: cases_mem.race(n, "driver")),
    ("pool-torch", "torch-async: cudaMallocAsync pool", lambda n: cases_mem.pool(n, "torch-async")),
    ("pool-driver", "driver-async: cuMemAllocAsync pool", lambda n: cases_mem.pool(n, "driver-async")),
    ("smi", "nvidia-smi in the share", cases_mem.nvidia_smi),
    ("graph30", "torch: CUDA graph of 8192² matmuls, hard 30 %", cases_compute.graph30),
    ("kmix30", "1-block + 10,000-block kernel mix, hard 30 %", cases_compute.kmix30),
    ("qos", "QoS tiers: a latency tenant beside batch work", cases_qos.qos),
    ("pair30-60", "two saturating hard shares, 30 % + 60 %", cases_qos.pair),
]


class Node:
    """The machine as the cases see it: the mirror, the real NVML, the tools."""

    def __init__(self, a, work):
        self.work = work
        self.libdir, self.workers = HERE / "lib", HERE / "workers"
        self.sim = a.sim
        self.pidns = a.pidns
        self.compute_seconds, self.compute_warmup = a.compute_seconds, a.compute_warmup
        art = pathlib.Path(a.artifacts)
        self.artifacts, self.repo = art, REPO
        self.interposer = art / "libvcuda.so"
        self.mirror_tool = art / "vdriver-mirror"
        self.test_manager = next((p for p in (art / "examples" / "test_manager", art / "test_manager")
                                  if p.is_file()), art / "examples" / "test_manager")
        missing = [str(p) for p in (self.interposer, self.mirror_tool, self.test_manager) if not p.is_file()]
        if missing:
            raise RuntimeError(f"missing artifacts: {', '.join(missing)} (see tests/gpu/README.md)")
        # The sim's libraries find their state from where they lie: mirror inside its root.
        out = pathlib.Path(a.host_root) / f".vcuda-gpu-suite-{os.getpid()}" if self.sim else work / "vdriver"
        self.mirror_out = out
        p = subprocess.run([str(self.mirror_tool), "--config", str(REPO / "config" / "volume.conf"),
                            "--out", str(out), "--host-root", a.host_root, "--interposer",
                            str(self.interposer)], capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            raise RuntimeError(f"vdriver-mirror failed: {p.stderr.strip()}")
        self.report = json.loads(p.stdout)
        self.driver_version = self.report["driver_version"]
        vols = {v["name"]: pathlib.Path(v["path"]) for v in self.report["volumes"]}
        self.lib64, self.bin = vols["nvidia"] / "lib64", vols["nvidia"] / "bin"
        self.origin_lib64 = vols["origin"] / "lib64"
        self.nvml = cudrv.Nvml(str(self.origin_lib64 / "libnvidia-ml.so.1"))
        self.bus_id = self.nvml.bus_id()
        self.has_torch = importlib.util.find_spec("torch") is not None

    def mirror_row(self):
        ino = lambda n: (self.lib64 / n).stat().st_ino  # noqa: E731
        real = self.lib64 / f"libcuda.so.{self.driver_version}"
        shim = self.interposer.stat()
        same = {ino(n) for n in ("libcuda.so.1", "libnvidia-ml.so.1", "libcuda.so")}
        is_shim = len(same) == 1 and (self.lib64 / "libcuda.so.1").stat().st_size == shim.st_size
        ok = is_shim and real.is_file() and real.stat().st_ino not in same
        return Row("vdriver mirror of the host driver",
                   "nvidia/lib64: libcuda.so{,.1}, libnvidia-ml.so.1 = the interposer (one inode), real "
                   "libcuda.so.<ver> beside",
                   f"driver {self.driver_version}, GPU {self.bus_id}, {len(self.report['volumes'])} volumes, "
                   f"interposer linked: {is_shim}, real driver beside: {real.is_file()}", PASS if ok else FAIL)


HEADER = "| case | expectation | measured | result |\n|---|---|---|---|"


def row_line(r):
    return f"| {r.case} | {r.expect} | {r.measured} | **{r.status}** |"


class Deadline(BaseException):
    """The suite's --deadline passed: the running case is abandoned (its
    `with` blocks stop its workers and container). Not an Exception, so a
    case's own error handling cannot swallow it."""


class _Clock:
    in_case = False  # a case (or the setup) runs: the deadline cuts it
    expired = False


def _deadline(_sig, _frame):
    _Clock.expired = True
    if _Clock.in_case:
        raise Deadline()


def _guarded(fn, *args):
    """fn(*args) where the deadline may cut it."""
    _Clock.in_case = True
    try:
        if _Clock.expired:
            raise Deadline()
        return fn(*args)
    finally:
        _Clock.in_case = False


class Partial:
    """Rows as cases finish: each printed at once (stdout, flushed) under a
    header, and the JSON file rewritten, so a run killed from outside still
    leaves every finished row behind."""

    def __init__(self, json_path):
        self.json_path, self.rows = json_path, []
        print("rows as cases finish (the full table follows at the end):\n" + HEADER, flush=True)

    def add(self, rows):
        self.rows.extend(rows)
        for r in rows:
            print(row_line(r), flush=True)
        if self.json_path:
            tmp = pathlib.Path(str(self.json_path) + ".tmp")
            tmp.write_text(json.dumps([r.__dict__ for r in self.rows], indent=1))
            os.replace(tmp, self.json_path)


def print_table(rows):
    print("\n" + HEADER)
    for r in rows:
        print(row_line(r))
    counts = {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, NOT_RUN)}
    print(f"\n{counts[PASS]} passed, {counts[FAIL]} failed, {counts[NOT_RUN]} not run")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--artifacts", default=str(REPO / "target" / "release"),
                    help="directory with libvcuda.so, vdriver-mirror, examples/test_manager")
    ap.add_argument("--host-root", default="/", help="the driver's root (a `gpu-sim install` root for the sim)")
    ap.add_argument("--sim", action="store_true",
                    help="--host-root is a `gpu-sim install` root: mirror inside it, kernels from a fake image")
    ap.add_argument("--only", default="", help="comma-separated case ids: " + ",".join(c[0] for c in CASES))
    ap.add_argument("--skip", default="", help="comma-separated case ids not to run")
    ap.add_argument("--allow-not-run", action="store_true", help="NOT RUN rows do not fail the run")
    ap.add_argument("--compute-seconds", type=float, default=10.0, help="measured window of the 30 %% cases")
    ap.add_argument("--compute-warmup", type=float, default=4.0, help="throttled run before that window")
    ap.add_argument("--budget", type=float, default=420.0,
                    help="start no case after this many seconds (the device machine allows 600 per command)")
    ap.add_argument("--deadline", type=float, default=540.0,
                    help="abandon the running case after this many seconds and print the table (0: none)")
    ap.add_argument("--quick", action="store_true",
                    help="first contact: compute window 5 s after 3 s of warm-up (unless given), budget 300 s")
    ap.add_argument("--pidns", action="store_true",
                    help="run each worker in a new PID namespace (`unshare --pid --fork --mount-proc`, root): "
                    "a container without hostPID, whose own PIDs are not NVML's")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    a = ap.parse_args()
    if a.quick:
        given = " ".join(sys.argv[1:])
        a.compute_seconds = a.compute_seconds if "--compute-seconds" in given else 5.0
        a.compute_warmup = a.compute_warmup if "--compute-warmup" in given else 3.0
        a.budget = min(a.budget, 300.0)
    only = [x for x in a.only.split(",") if x]
    if a.sim and a.host_root == "/":
        ap.error("--sim needs --host-root (a gpu-sim install root)")
    skip = [x for x in a.skip.split(",") if x]
    unknown = set(only + skip) - {c[0] for c in CASES}
    if unknown:
        ap.error(f"unknown case ids {sorted(unknown)}")
    work = pathlib.Path(tempfile.mkdtemp(prefix="vcuda-gpu-suite-"))
    node, t_start = None, time.monotonic()
    out = Partial(a.json)
    rows = out.rows
    if a.deadline > 0:
        signal.signal(signal.SIGALRM, _deadline)
        signal.setitimer(signal.ITIMER_REAL, a.deadline)
    try:
        try:
            node = _guarded(Node, a, work)
            out.add([node.mirror_row()])
        except (RuntimeError, OSError, ValueError, KeyError, subprocess.TimeoutExpired) as e:
            out.add([Row("setup: mirror, real NVML", "mirror and NVML work", f"{type(e).__name__}: {e}", FAIL)])
        except Deadline:
            pass
        for cid, label, fn in CASES:
            if (only and cid not in only) or cid in skip:
                continue
            t0 = time.monotonic()
            if node is None or _Clock.expired:
                why = f"the suite's {a.deadline:.0f} s deadline passed" if _Clock.expired else "setup failed"
                out.add([Row(label, "", why, NOT_RUN)])
                continue
            if time.monotonic() - t_start > a.budget:
                out.add([Row(label, "", f"the suite's {a.budget:.0f} s budget was spent", NOT_RUN)])
                continue
            try:
                got = _guarded(fn, node)
            except NotRun as e:
                got = Row(label, "", str(e), NOT_RUN)
            except Deadline:
                got = Row(label, "", f"cut by the suite's {a.deadline:.0f} s deadline after "
                          f"{time.monotonic() - t0:.0f} s", FAIL)
            except Exception as e:  # noqa: BLE001 - a case that breaks is a FAIL row
                got = Row(label, "", f"{type(e).__name__}: {e}", FAIL)
            got = got if isinstance(got, list) else [got]
            out.add(got)
            print(f"[{time.monotonic() - t_start:5.0f} s] {cid}: {'/'.join(r.status for r in got)} "
                  f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if node is not None and node.sim and not a.keep:
            shutil.rmtree(node.mirror_out, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    print(f"({time.monotonic() - t_start:.0f} s; host root {a.host_root}; artifacts {a.artifacts})")
    if any(r.status == FAIL for r in rows):
        return 1
    if any(r.status == NOT_RUN for r in rows) and not a.allow_not_run:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
