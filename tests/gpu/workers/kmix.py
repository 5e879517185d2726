"""The kernel mix through the driver API (ctypes): kernel A = 1 block of 256
threads spinning A_NS, kernel B = 10,000 blocks of 256 threads spinning B_NS
each, on one stream. At most DEPTH launches are queued (events), so a launch
call's wall time is the interposer's wait, not a full queue.

usage: kmix.py IMAGE MODE SECONDS WARMUP A_NS B_NS
  IMAGE: the fatbin built from kmix.cu, or "fake" (the simulated driver
         accepts any image; its kernels last by shape)
  MODE baseline: each kernel's device time (events, back to back behind a
                blocker), and the mix unthrottled for SECONDS
  MODE mixed: A, B, A, B, ... for WARMUP s, then a SECONDS window measured by
              events; reports launches of each and the longest launch calls
"""

import collections
import ctypes
import os
import sys
import time

import cudrv
import proto

DEPTH = 4
SHAPES = {"A": 1, "B": 10_000}
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

    def launch(self, k):
        """Launches kernel k; returns the call's wall time in ns."""
        if len(self.queued) >= DEPTH:
            e = self.queued.popleft()
            self.d.ok("cuEventSynchronize", e)
            self.free.append(e)
        t0 = time.perf_counter_ns()
        r = self.d.call("cuLaunchKernel", self.f, SHAPES[k], 1, 1, 256, 1, 1, 0, self.s, self.params[k], None)
        dt = time.perf_counter_ns() - t0
        if r:
            raise cudrv.CudaError("cuLaunchKernel", r)
        e = self.free.pop()
        self.d.ok("cuEventRecord", e, self.s)
        self.queued.append(e)
        return dt

    def raw(self, grid, ns):
        r = self.d.call("cuLaunchKernel", self.f, grid, 1, 1, 256, 1, 1, 0, self.s, ns, None)
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

    def window(self, kernels, seconds):
        """Launches `kernels` in turn for `seconds`: (counts, window ms by events,
        {kernel: {"max", "p99"} launch call ms})."""
        self.sync()
        start, end = self.d.event(), self.d.event()
        self.d.ok("cuEventRecord", start, self.s)
        calls = {k: [] for k in kernels}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for k in kernels:
                calls[k].append(self.launch(k))
        counts = {k: len(v) for k, v in calls.items()}
        worst = {k: {"max": max(v) / 1e6, "p99": sorted(v)[len(v) * 99 // 100] / 1e6} for k, v in calls.items()}
        self.d.ok("cuEventRecord", end, self.s)
        self.d.ok("cuEventSynchronize", end)
        ms = self.d.elapsed_ms(start, end)
        self.sync()
        return counts, ms, worst


def run():
    image, mode, seconds, warmup, a_ns, b_ns = sys.argv[1:7]
    mix = Mix(image, int(a_ns), int(b_ns))
    proto.ready(pid=os.getpid())
    seconds, warmup = float(seconds), float(warmup)
    if mode == "baseline":
        mix.window(["A", "B"], warmup)
        out = {k: {"ms": mix.device_ms(k)} for k in SHAPES}
        counts, ms, worst = mix.window(["A", "B"], seconds)
        out["unthrottled_share"] = sum(counts[k] * out[k]["ms"] for k in SHAPES) / ms * 100
        out["call_ms"] = worst
        proto.say(result=out)
    elif mode == "mixed":
        mix.window(["A", "B"], warmup)
        counts, ms, worst = mix.window(["A", "B"], seconds)
        proto.say(result={"counts": counts, "window_ms": ms, "call_ms": worst})
    else:
        raise ValueError(f"unknown mode {mode!r}")
    proto.hold()


if __name__ == "__main__":
    proto.main(run)
