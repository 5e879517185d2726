"""A CUDA graph of MATMULS fp16 8192 x 8192 matmuls (PyTorch, cuBLAS),
replayed on one stream with at most DEPTH replays queued.

usage: graph.py SECONDS WARMUP MATMULS [DUTY]
Replays for WARMUP s, then synchronises and measures a SECONDS window with
CUDA events: {replays, window_ms, max_call_ms}. Run unthrottled, window_ms /
replays is the graph's device time (the GPU never idles: replays are queued).

With DUTY (0..1, unthrottled only) replays are paced instead: one at a time,
each timed by a pair of events around it on an idle stream, then the host
sleeps so the GPU is busy DUTY of the time: {replays, busy_ms, window_ms}.
A power-limited GPU runs a replay faster when it idles between replays
(clocks boost) than when it is saturated, so the device time of throttled
work is the paced one, not the saturated one.
"""

import collections
import os
import sys
import time

import proto

N = 8192
DEPTH = 4


def run():
    import torch

    seconds, warmup, matmuls = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
    a = torch.randn(N, N, device="cuda", dtype=torch.float16)
    b = torch.randn(N, N, device="cuda", dtype=torch.float16)
    c = torch.empty(N, N, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # cuBLAS's workspace and heuristics before capture
        for _ in range(3):
            torch.mm(a, b, out=c)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(matmuls):
            torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    proto.ready(pid=os.getpid())

    queued = collections.deque()

    def window(secs):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        n, worst, deadline = 0, 0, time.monotonic() + secs
        while time.monotonic() < deadline:
            if len(queued) >= DEPTH:
                queued.popleft().synchronize()
            t0 = time.perf_counter_ns()
            g.replay()
            worst = max(worst, time.perf_counter_ns() - t0)
            e = torch.cuda.Event()
            e.record()
            queued.append(e)
            n += 1
        end.record()
        end.synchronize()
        queued.clear()
        return n, start.elapsed_time(end), worst / 1e6

    def paced(secs, duty):
        n, busy, t_start = 0, 0.0, time.monotonic()
        deadline = t_start + secs
        while time.monotonic() < deadline:
            a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            e.record()
            e.synchronize()
            ms = a.elapsed_time(e)
            busy, n = busy + ms, n + 1
            time.sleep(ms / 1000 * (1 - duty) / duty)
        return n, busy, (time.monotonic() - t_start) * 1000

    if len(sys.argv) > 4:
        duty = float(sys.argv[4])
        paced(warmup, duty)
        n, busy, ms = paced(seconds, duty)
        proto.say(result={"replays": n, "busy_ms": busy, "window_ms": ms})
    else:
        window(warmup)
        n, ms, worst = window(seconds)
        proto.say(result={"replays": n, "window_ms": ms, "max_call_ms": worst})
    proto.hold()


if __name__ == "__main__":
    proto.main(run)
