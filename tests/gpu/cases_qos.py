"""QoS tiers on a real GPU (issue 37, docs/qos.md): the settings of cuda-shim's
qos_latency bench, where the simulator cannot judge them (it preempts nothing,
and a 2-core VM's sleeps jitter by milliseconds).

* the latency tenant: tests/c/qos_latency.c, 100 requests/s, each three
  launches of 17,280 blocks of `busy` (workers/busy.cu: every block spins
  10 us; an H200 holds 1,056 such blocks at once, so ~170 us a kernel),
  latency from when a request was due to its stream's synchronize;
* the batch tenant: tests/c/shim_compute.c, `saturate` (86,400 blocks, ~0.8 ms
  a kernel, a synchronize every 4) or `blockmix` (a 10,000-block kernel, ~100
  us, then four 1-block ones of 10 us; a synchronize every 10), started first;
* settings: the latency tenant alone (no interposer; a 50 % hard share), and
  beside batch with no interposer (the driver's time-slicing alone), plain
  50 % + 50 % hard shares, and tiers (one QoS page, `test_manager --qos`)
  with the batch share hard 50 or soft 50 bursting to 100.

Verdicts (issue 37's targets): with tiers, the latency p99 beside batch is
within 10 % of the same share's p99 alone; with a soft batch share, batch
keeps >= 70 % of the throughput it has alone on the GPU (the latency tenant
takes ~5 %). The batch rate is the batch program's launches over its own run
(which the latency tenant overlaps for all but ~2 s), against the same
program alone with no interposer in the same run.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import time

import cases_compute
from container import Container, outside_env
from harness import FAIL, PASS, PIDNS, NotRun, Row

QUOTA = 8 << 30
REQUEST = ["100", "3", "17280"]  # requests/s, kernels a request, blocks a kernel
BATCHES = [("~0.8 ms kernels", "saturate", "4"), ("100 us + 10 us kernels", "blockmix", "10")]
P99_WITHIN = 1.10
BATCH_KEEPS = 0.70


def _programs(node):
    """qos_latency and shim_compute: carried (build-artifacts.sh puts them in
    the artifacts' c/), else compiled here against the mirror's libcuda."""
    out = {}
    for name in ("qos_latency", "shim_compute"):
        carried = node.artifacts / "c" / name
        if carried.is_file():
            out[name] = carried
            continue
        cc = shutil.which("cc") or shutil.which("gcc")
        if cc is None:
            raise NotRun(f"no {carried} and no C compiler to build tests/c/{name}.c")
        exe = pathlib.Path(node.work) / name
        src = node.repo / "tests" / "c" / f"{name}.c"
        p = subprocess.run([cc, "-O2", "-I", str(src.parent), str(src), "-o", str(exe), "-L", str(node.lib64),
                            "-lcuda"], capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"{cc} {src.name}: {p.stderr.strip()[-400:]}")
        out[name] = exe
    return out


def _words(text):
    return {k: float(v) for k, v in (w.split("=", 1) for w in text.split() if "=" in w)
            if v.replace(".", "", 1).lstrip("-").isdigit()}


def _module(node):
    """The environment that points tests/c's programs at busy.cu's fatbin
    (none on the sim: its fake module's kernels last by shape)."""
    return {} if node.qos_image == "fake" else {"VCUDA_TEST_MODULE": node.qos_image}


class _Tenant:
    """One of tests/c's programs. GPU_SUITE_WORKER_LOGS=DIR keeps its stderr
    as DIR/<name>.log, and GPU_SUITE_LOGGER_LEVEL sets the interposer's
    LOGGER_LEVEL for it (4: the compute controller's line per period)."""

    def __init__(self, node, exe, args, env, name):
        cmd = [str(exe), *args]
        logs, level = os.environ.get("GPU_SUITE_WORKER_LOGS"), os.environ.get("GPU_SUITE_LOGGER_LEVEL")
        if level:
            env = {**env, "LOGGER_LEVEL": level}
        err = open(os.path.join(logs, f"{name}.log"), "w") if logs else subprocess.PIPE
        self.proc = subprocess.Popen(PIDNS + cmd if node.pidns else cmd, env=env, stdout=subprocess.PIPE,
                                     stderr=err, text=True)
        print(f"qos tenant {name}: pid {self.proc.pid} at t={time.monotonic():.3f}", file=sys.stderr, flush=True)

    def finish(self, timeout):
        try:
            out, err = self.proc.communicate(timeout=timeout)
            err = err or ""
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            err = err or ""
            raise RuntimeError(f"a tenant ran past {timeout} s: {out[-300:]} {err[-300:]}")
        if self.proc.returncode != 0:
            raise RuntimeError(f"a tenant exited {self.proc.returncode}: {out.strip()[-300:]} {err.strip()[-300:]}")
        return _words(out)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _Setting:
    """The environments of the latency and batch tenants for one setting:
    the real driver, two plain shares, or two tiered shares on one QoS page
    (the batch one hard 50 or soft 50..100), served while in use."""

    def __init__(self, node, name, kind, batch_hard=True):
        self.node, self.name, self.kind, self.batch_hard = node, name, kind, batch_hard
        self.served = []

    def __enter__(self):
        n, image = self.node, _module(self.node)
        if self.kind == "direct":
            return outside_env(n, image), outside_env(n, image)
        batch = (f"{self.name}-batch", "batch", 50, self.batch_hard, 100)
        if self.kind == "tiers":
            lat = Container(n, f"{self.name}-lat", QUOTA, utilization=50, tier="latency", peers=[batch])
            self.served, b = [lat], lat.peers[0]
        else:
            lat = Container(n, f"{self.name}-lat", QUOTA, utilization=50)
            self.served = [lat]
            b = Container(n, batch[0], QUOTA, utilization=50, hard=self.batch_hard)
            self.served.append(b)
        return lat.env(image), b.env(image)

    def __exit__(self, *exc):
        for c in self.served:
            c.close()


def _run(node, progs, setting, batch, secs, warm):
    """One run: batch (if any) first, the latency tenant a second later."""
    with setting as (lat_env, batch_env):
        b = None
        if batch:
            _, mode, sync = batch
            b = _Tenant(node, progs["shim_compute"], [mode, f"{secs + warm + 2:g}", sync], batch_env,
                        f"{setting.name}-batch")
            time.sleep(1.0)
        lat = _Tenant(node, progs["qos_latency"], [f"{secs + warm:g}", *REQUEST, f"warmup={warm:g}"], lat_env,
                      f"{setting.name}-lat")
        try:
            got = lat.finish(secs + warm + 60)
            got_b = b.finish(secs + warm + 60) if b else None
        finally:
            lat.kill()
            if b:
                b.kill()
    return got, got_b


def _batch_alone(node, progs, batch, secs):
    _, mode, sync = batch
    env = outside_env(node, _module(node))
    got = _Tenant(node, progs["shim_compute"], [mode, f"{secs:g}", sync], env, f"{mode}-alone").finish(secs + 60)
    return got["launches"] / got["wall_ns"]


def qos(node):
    node.qos_image = cases_compute.fatbin(node, "busy.cu")
    progs = _programs(node)
    secs, warm = node.compute_seconds, node.compute_warmup
    rows = []
    only = os.environ.get("GPU_SUITE_QOS_BATCH")  # one batch workload: saturate or blockmix
    for i, batch in enumerate(BATCHES):
        if only and batch[1] != only:
            continue
        rate0 = _batch_alone(node, progs, batch, secs + warm)
        figures = {}
        for label, setting, with_batch in [
            ("alone, no interposer", _Setting(node, f"q{i}a0", "direct"), False),
            ("alone, 50 % share", _Setting(node, f"q{i}a", "plain"), False),
            ("beside batch, no interposer", _Setting(node, f"q{i}d", "direct"), True),
            ("beside batch, 50 % + 50 % shares", _Setting(node, f"q{i}p", "plain"), True),
            ("beside batch, tiers, batch hard 50", _Setting(node, f"q{i}h", "tiers"), True),
            ("beside batch, tiers, batch soft 50..100", _Setting(node, f"q{i}s", "tiers", batch_hard=False), True),
        ]:
            lat, b = _run(node, progs, setting, batch if with_batch else None, secs, warm)
            share = 100.0 * b["launches"] / b["wall_ns"] / rate0 if b else None
            figures[label] = (lat, share)
            print(f"qos {batch[0]:<24} {label:<42} p50 {lat['p50_us']:7.0f} us  p99 {lat['p99_us']:7.0f} us  "
                  f"max {lat['max_us']:7.0f} us  late {lat['late']:4.0f}  "
                  f"batch {'-' if share is None else f'{share:5.1f} % of alone'}", flush=True)
        rows += _verdicts(batch[0], figures)
    return rows


def _verdicts(batch, f):
    alone = f["alone, 50 % share"][0]["p99_us"]
    brief = "; ".join(f"{k}: p50 {v[0]['p50_us']:.0f} / p99 {v[0]['p99_us']:.0f} us"
                      + ("" if v[1] is None else f", batch {v[1]:.1f} %") for k, v in f.items())
    out = []
    for label in ("beside batch, tiers, batch hard 50", "beside batch, tiers, batch soft 50..100"):
        lat, share = f[label]
        ok = lat["p99_us"] <= P99_WITHIN * alone
        expect = f"latency p99 ≤ {P99_WITHIN:.2f} × alone's"
        if "soft" in label:
            ok = ok and share >= 100 * BATCH_KEEPS
            expect += f"; batch ≥ {100 * BATCH_KEEPS:.0f} % of its rate alone"
        measured = (f"p99 {lat['p99_us']:.0f} us = {lat['p99_us'] / alone:.2f} × alone ({alone:.0f}); "
                    f"batch {share:.1f} % of alone" + (f" — all settings: {brief}" if "soft" in label else ""))
        out.append(Row(f"QoS, {batch}: {label}", expect, measured, PASS if ok else FAIL))
    return out


PAIR = (30, 60)  # hard quotas of two saturating shares on one GPU
PAIR_TOLERANCE = 5.0  # points


def pair(node):
    """Two plain hard shares, 30 % and 60 %, both saturating (`saturate`)
    for the same window: a real driver's NVML names one process a sample
    period, the busiest, so the 30 % share is never named; it must still
    hold its quota (charged the device's busy time beyond its neighbour),
    and the 60 % one its own. Share = launches/s ÷ the same program's alone
    with no interposer, over each program's whole run (start-up included)."""
    node.qos_image = cases_compute.fatbin(node, "busy.cu")
    progs = _programs(node)
    secs = node.compute_seconds + node.compute_warmup
    batch = BATCHES[0]
    rate0 = _batch_alone(node, progs, batch, secs)
    image = _module(node)
    with Container(node, "pair-a", QUOTA, utilization=PAIR[0]) as a, \
            Container(node, "pair-b", QUOTA, utilization=PAIR[1]) as b:
        runs = [_Tenant(node, progs["shim_compute"], ["saturate", f"{secs:g}", "4"], c.env(image), c.name)
                for c in (a, b)]
        try:
            got = [r.finish(secs + 60) for r in runs]
        finally:
            for r in runs:
                r.kill()
    shares = [100.0 * g["launches"] / g["wall_ns"] / rate0 for g in got]
    ok = all(abs(s - q) <= PAIR_TOLERANCE for s, q in zip(shares, PAIR))
    return Row(f"two saturating hard shares, {PAIR[0]} % + {PAIR[1]} %",
               f"each within {PAIR_TOLERANCE:g} points of its quota (launch rate vs alone, no interposer)",
               f"{shares[0]:.1f} % and {shares[1]:.1f} % ({secs:g} s each)", PASS if ok else FAIL)
