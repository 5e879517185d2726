"""The kernel mix through the driver API (ctypes): kernel A = 1 block of 256
threads spinning A_NS, kernel B = 10,000 blocks of 256 threads spinning B_NS
each, on one stream. At most DEPTH launches are queued (events), so a launch
call's wall time is the interposer's wait, not a full queue. Each call's wall
time is also reported less the time the thread spent runnable but not running
(its runqueue delay, /proc/thread-self/schedstat): a loaded host wakes a
sleeping thread late by anything up to 100+ ms, which is not the interposer's.
What remains of the host's lateness (timer and vCPU latency) is measured by a
control process during the mixed window: plain sleeps of CONTROL_MS (the case
passes what the longer kernel should wait) back to back, timed the same way.

usage: kmix.py IMAGE MODE SECONDS WARMUP A_NS B_NS [CONTROL_MS]
       kmix.py control CONTROL_MS SECONDS (the control: prints JSON)
  IMAGE: the fatbin built from kmix.cu, or "fake" (the simulated driver
         accepts any image; its kernels last by shape)
  MODE baseline: each kernel's device time (events, back to back behind a
                blocker), and the mix unthrottled for SECONDS
  MODE mixed: A, B, A, B, ... for WARMUP s, then a SECONDS window measured by
              events; reports launches of each, the longest launch calls and
              the control sleeps' lateness
"""

import collections
import ctypes
import json
import os
import subprocess
import sys
import time

import cudrv
import proto

DEPTH = 4
SHAPES = {"A": 1, "B": 10_000}
THREADS = 256
# Longest waits (and control latenesses) reported, ms.
TOP = 200
# cuDeviceGetAttribute: what the interposer's wave cost (cuda-shim/src/throttle/cost.rs) reads.
MULTIPROCESSOR_COUNT, MAX_THREADS_PER_MULTIPROCESSOR = 16, 39
# ~5 ms on an H100 (95 waves of 50 us), ~1 ms on the sim: time to queue the measured launches.
BLOCKER_GRID, BLOCKER_NS = 100_000, ctypes.c_ulonglong(50_000)


class Mix:
    def __init__(self, image, a_ns, b_ns):
        self.d = d = cudrv.Driver()
        data = b"fake image" if image == "fake" else open(image, "rb").read()
        self.f = d.function(data, "spin")
        self.s = d.stream()
        self.ns = {"A": ctypes.c_ulonglong(a_ns), "B": ctypes.c_ulonglong(b_ns)}
        # kernelParams: one pointer per argument, to the argument's value.
        self.params = {k: (ctypes.c_void_p * 1)(ctypes.addressof(v)) for k, v in self.ns.items()}
        self.free = [d.event() for _ in range(DEPTH + 2)]
        self.queued = collections.deque()
        # The interposer's cost of each kernel: waves of SMs x blocks per SM.
        sms = d.attribute(MULTIPROCESSOR_COUNT)
        per_sm = min(32, max(1, d.attribute(MAX_THREADS_PER_MULTIPROCESSOR) // THREADS))
        self.waves = {k: -(-g // (sms * per_sm)) for k, g in SHAPES.items()}
        try:
            self.sched = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self.sched = None

    def runqueue_ns(self):
        """This thread's time spent runnable but not running, ever (0 where
        the kernel does not say)."""
        return int(os.pread(self.sched, 64, 0).split()[1]) if self.sched is not None else 0

    def launch(self, k):
        """Launches kernel k; returns the call's wall time in ns and that less
        the thread's runqueue delay meanwhile."""
        if len(self.queued) >= DEPTH:
            e = self.queued.popleft()
            self.d.ok("cuEventSynchronize", e)
            self.free.append(e)
        q0 = self.runqueue_ns()
        t0 = time.perf_counter_ns()
        r = self.d.call("cuLaunchKernel", self.f, SHAPES[k], 1, 1, THREADS, 1, 1, 0, self.s, self.params[k], None)
        dt = time.perf_counter_ns() - t0
        q = self.runqueue_ns() - q0
        if r:
            raise cudrv.CudaError("cuLaunchKernel", r)
        e = self.free.pop()
        self.d.ok("cuEventRecord", e, self.s)
        self.queued.append(e)
        return dt, max(0, dt - q)

    def raw(self, grid, ns):
        r = self.d.call("cuLaunchKernel", self.f, grid, 1, 1, THREADS, 1, 1, 0, self.s, ns, None)
        if r:
            raise cudrv.CudaError("cuLaunchKernel", r)

    def device_ms(self, k, n=20, rounds=5):
        """Median device time of kernel k, run n times back to back behind a
        blocker kernel (so no launch gap counts), over `rounds` rounds."""
        blocker = (ctypes.c_void_p * 1)(ctypes.addressof(BLOCKER_NS))
        start, end, per = self.d.event(), self.d.event(), []
        for _ in range(rounds):
            self.sync()
            self.raw(BLOCKER_GRID, blocker)
            self.d.ok("cuEventRecord", start, self.s)
            for _ in range(n):
                self.raw(SHAPES[k], self.params[k])
            self.d.ok("cuEventRecord", end, self.s)
            self.d.ok("cuEventSynchronize", end)
            per.append(self.d.elapsed_ms(start, end) / n)
        return sorted(per)[len(per) // 2]

    def sync(self):
        self.d.ok("cuStreamSynchronize", self.s)
        self.free.extend(self.queued)
        self.queued.clear()

    def window(self, kernels, seconds, control_ns=0):
        """Launches `kernels` in turn for `seconds`: (counts, window ms by events,
        {kernel: {"max", "p99", "wait_max", "wait_p99", "wait_top"}} launch call
        ms, wait_*: less the runqueue delay, wait_top: the TOP longest, control:
        {"n", "late_top"} ms, the TOP latest control sleeps)."""
        self.sync()
        start, end = self.d.event(), self.d.event()
        self.d.ok("cuEventRecord", start, self.s)
        calls = {k: [] for k in kernels}
        ctl = subprocess.Popen([sys.executable, __file__, "control", str(control_ns), str(seconds)],
                               stdout=subprocess.PIPE, text=True) if control_ns else None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for k in kernels:
                calls[k].append(self.launch(k))
        counts = {k: len(v) for k, v in calls.items()}
        worst = {}
        for k, v in calls.items():
            wall, wait = sorted(x[0] for x in v), sorted(x[1] for x in v)
            worst[k] = {"max": wall[-1] / 1e6, "p99": wall[len(v) * 99 // 100] / 1e6,
                        "wait_max": wait[-1] / 1e6, "wait_p99": wait[len(v) * 99 // 100] / 1e6,
                        "wait_top": [x / 1e6 for x in wait[-TOP:]]}
        control = json.loads(ctl.communicate(timeout=60)[0]) if ctl else None
        self.d.ok("cuEventRecord", end, self.s)
        self.d.ok("cuEventSynchronize", end)
        ms = self.d.elapsed_ms(start, end)
        self.sync()
        return counts, ms, worst, control


def control(ns, seconds):
    """Plain sleeps of `ns` back to back for `seconds`: {"n", "late_top": the
    TOP latest, ms, each less the runqueue delay meanwhile}."""
    try:
        fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    except OSError:
        fd = None

    def rq():
        return int(os.pread(fd, 64, 0).split()[1]) if fd is not None else 0
    late = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        q0, t0 = rq(), time.perf_counter_ns()
        time.sleep(ns / 1e9)
        dt = time.perf_counter_ns() - t0
        late.append(max(0, dt - (rq() - q0) - ns))
    late.sort()
    print(json.dumps({"n": len(late), "late_top": [x / 1e6 for x in late[-TOP:]]}))


def run():
    image, mode, seconds, warmup, a_ns, b_ns = sys.argv[1:7]
    control_ns = int(float(sys.argv[7]) * 1e6) if len(sys.argv) > 7 else 0
    mix = Mix(image, int(a_ns), int(b_ns))
    proto.ready(pid=os.getpid())
    seconds, warmup = float(seconds), float(warmup)
    if mode == "baseline":
        mix.window(["A", "B"], warmup)
        out = {k: {"ms": mix.device_ms(k)} for k in SHAPES}
        counts, ms, worst, _ = mix.window(["A", "B"], seconds)
        out["unthrottled_share"] = sum(counts[k] * out[k]["ms"] for k in SHAPES) / ms * 100
        out["call_ms"] = worst
        out["waves"] = mix.waves
        proto.say(result=out)
    elif mode == "mixed":
        mix.window(["A", "B"], warmup, control_ns)
        counts, ms, worst, control = mix.window(["A", "B"], seconds, control_ns)
        proto.say(result={"counts": counts, "window_ms": ms, "call_ms": worst, "waves": mix.waves,
                          "runqueue_known": mix.sched is not None, "control": control})
    else:
        raise ValueError(f"unknown mode {mode!r}")
    proto.hold()


if __name__ == "__main__":
    if sys.argv[1:2] == ["control"]:
        control(int(sys.argv[2]), float(sys.argv[3]))
    else:
        proto.main(run)
