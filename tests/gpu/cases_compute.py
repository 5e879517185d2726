"""Compute cases under a hard 30 % quota, each against an unthrottled baseline
measured in the same run (a container without a compute limit):

* share = device time of the work done in the window ÷ the window, where the
  window is timed by CUDA events and each unit of work's device time comes
  from the baseline's CUDA events;
* graph30: units = replays of a CUDA graph of 8192² fp16 matmuls (PyTorch);
* kmix30: units = launches of a 1-block and a 10,000-block kernel (kmix.cu,
  nvcc; on the simulated node any image, kernels last by shape), and every
  launch call returns within 1.25 × its kernel's device time ÷ 0.30 + 1 ms.
"""

import glob
import pathlib
import shutil
import subprocess

from container import Container
from harness import FAIL, PASS, NotRun, Row, Worker

TARGET = 30
TOLERANCE = 2.0  # percentage points
QUOTA = 8 << 30
START_S = 120
MATMULS = 8
A_NS, B_NS = 1_000_000, 100_000  # ~1 ms each on an H100 (B: ~10 waves of 0.1 ms)


def _run(node, name, util, script, args, timeout):
    with Container(node, name, QUOTA, utilization=util, hard=True) as c, \
            Worker(node, script, args, c.env()) as w:
        w.wait_for("ready", START_S)
        w.go()
        return w.wait_for("result", timeout)["result"]


def _share_row(case, share, extra):
    ok = abs(share - TARGET) <= TOLERANCE
    return Row(case, f"achieved share {TARGET} ± {TOLERANCE:g} points (CUDA events vs unthrottled baseline)",
               f"{share:.1f} %; {extra}", PASS if ok else FAIL)


def graph30(node):
    if not node.has_torch:
        raise NotRun("PyTorch not importable")
    secs, warm = node.compute_seconds, node.compute_warmup
    base = _run(node, "graph-base", 0, "graph.py", [3, 1, MATMULS], 60)
    per = base["window_ms"] / base["replays"]
    thr = _run(node, "graph-30", TARGET, "graph.py", [secs, warm, MATMULS], secs + warm + 60)
    share = thr["replays"] * per / thr["window_ms"] * 100
    return _share_row(f"torch: CUDA graph of {MATMULS} 8192² matmuls, hard {TARGET} %", share,
                      f"{thr['replays']} replays × {per:.2f} ms in {thr['window_ms'] / 1000:.1f} s; "
                      f"longest replay call {thr['max_call_ms']:.1f} ms")


def _fatbin(node):
    if node.sim:
        return "fake"
    found = sorted(glob.glob("/usr/local/cuda*/bin/nvcc"))
    nvcc = shutil.which("nvcc") or (found[-1] if found else None)
    if nvcc is None:
        raise NotRun("nvcc not found (PATH, /usr/local/cuda*/bin)")
    major, minor = node.nvml.compute_capability()
    cc = f"{major}{minor}"
    out = pathlib.Path(node.work) / "kmix.fatbin"
    p = subprocess.run([nvcc, "--fatbin", "-gencode", f"arch=compute_{cc},code=[sm_{cc},compute_{cc}]",
                        "-o", str(out), str(node.workers / "kmix.cu")], capture_output=True, text=True, timeout=180)
    if p.returncode != 0:
        raise RuntimeError(f"nvcc failed: {p.stderr.strip()[-400:]}")
    return str(out)


def kmix30(node):
    image = _fatbin(node)
    secs, warm = node.compute_seconds, node.compute_warmup
    base = _run(node, "kmix-base", 0, "kmix.py", [image, "baseline", 2, 0.5, A_NS, B_NS], 120)
    d = {k: base[k]["ms"] for k in ("A", "B")}
    thr = _run(node, "kmix-30", TARGET, "kmix.py", [image, "mixed", secs, warm, A_NS, B_NS], secs + warm + 60)
    counts, window = thr["counts"], thr["window_ms"]
    share = sum(counts[k] * d[k] for k in d) / window * 100
    label = "1-block + 10,000-block kernel mix" + (" (sim: fake image)" if image == "fake" else "")
    rows = [_share_row(f"{label}, hard {TARGET} %", share,
                       f"A {counts['A']} × {d['A']:.3f} ms + B {counts['B']} × {d['B']:.3f} ms in "
                       f"{window / 1000:.1f} s; unthrottled mix {base['unthrottled_share']:.0f} %")]
    bound = {k: 1.25 * d[k] / (TARGET / 100) + 1.0 for k in d}
    worst = {k: v["max"] for k, v in thr["call_ms"].items()}
    ok = all(worst[k] <= bound[k] for k in d)
    rows.append(Row(f"{label}: launch waits, hard {TARGET} %",
                    "every launch call ≤ 1.25 × its kernel's device time ÷ 0.30 + 1 ms",
                    "; ".join(f"{k}: longest {worst[k]:.2f} ms, p99 {thr['call_ms'][k]['p99']:.2f} (bound "
                              f"{bound[k]:.2f}; unthrottled longest {base['call_ms'][k]['max']:.2f})" for k in d),
                    PASS if ok else FAIL))
    return rows
