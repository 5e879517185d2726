"""Harness pieces: result rows, worker processes, the NVML sampler."""

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pidmap

PASS, FAIL, NOT_RUN = "PASS", "FAIL", "NOT RUN"


@dataclass
class Row:
    case: str
    expect: str
    measured: str
    status: str


class NotRun(Exception):
    """A case's prerequisite is missing (torch, nvcc, ...): reported, never a pass."""


class WorkerError(RuntimeError):
    pass


# A new PID namespace (and /proc) per worker: a container without hostPID.
PIDNS = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]


def _nvml_pids(node):
    nvml = getattr(node, "nvml", None)
    try:
        return set(nvml.processes()) if nvml else set()
    except RuntimeError:
        return set()


class Worker:
    """A worker script (tests/gpu/workers/) speaking lib/proto.py's protocol.
    `pids` (lib/pidmap.py): its own, local and NVML PIDs, known once it said
    "ready" (its context exists by then)."""

    def __init__(self, node, script, args, env, python=None):
        cmd = [python or sys.executable, str(node.workers / script), *map(str, args)]
        if getattr(node, "pidns", False):
            cmd = PIDNS + cmd
        self.name, self.node = script, node
        self._nvml_before = _nvml_pids(node)
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.pids = None
        self.msgs, self.cv = [], threading.Condition()
        self.err_tail = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                msg = {"stdout": line.rstrip()}
            with self.cv:
                self.msgs.append(msg)
                self.cv.notify_all()
        with self.cv:
            self.msgs.append({"eof": True})
            self.cv.notify_all()

    def _read_err(self):
        # GPU_SUITE_WORKER_LOGS=DIR keeps every worker's stderr (the
        # interposer's LOGGER_LEVEL lines) as DIR/<script>-<pid>.log.
        logs = os.environ.get("GPU_SUITE_WORKER_LOGS")
        out = open(os.path.join(logs, f"{self.name}-{self.proc.pid}.log"), "w") if logs else None
        for line in self.proc.stderr:
            self.err_tail = (self.err_tail + [line.rstrip()])[-15:]
            if out:
                out.write(line)
                out.flush()
        if out:
            out.close()

    def wait_for(self, key, timeout):
        """The first message carrying `key`; an {"error"} or EOF raises."""
        end = time.monotonic() + timeout
        with self.cv:
            while True:
                for m in self.msgs:
                    if key in m:
                        if key == "ready" and self.pids is None and "pid" in m:
                            self.pids = pidmap.resolve(self.proc.pid, m["pid"], _nvml_pids(self.node),
                                                       self._nvml_before)
                        return m
                    if "error" in m or "eof" in m:
                        time.sleep(0.2)  # let stderr's reader catch up
                        why = m.get("error") or f"exited {self.proc.poll()}"
                        raise WorkerError(f"{self.name}: {why}; stderr: {' | '.join(self.err_tail[-4:])}")
                left = end - time.monotonic()
                if left <= 0:
                    raise WorkerError(f"{self.name}: no {key!r} within {timeout:.0f} s; "
                                      f"stderr: {' | '.join(self.err_tail[-4:])}")
                self.cv.wait(min(left, 0.5))

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def finish(self, timeout=30):
        """Closes stdin (the worker frees and exits) and waits."""
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        # The suite's deadline (a BaseException, not an Exception): no grace.
        cut = exc_type is not None and not issubclass(exc_type, Exception)
        self.finish(timeout=1 if cut else 30)


class Sampler:
    """Samples the real NVML's per-process used memory every `period` s while
    a case runs. `peak(pids)`: the largest per-sample sum over `pids`."""

    def __init__(self, nvml, period=0.02):
        self.nvml, self.period = nvml, period
        self.samples, self.errors = [], []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append(self.nvml.processes())
            except RuntimeError as e:
                self.errors.append(str(e))
            self._stop.wait(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def peak(self, pids):
        """(peak sum of used bytes, samples that saw any of pids, unknown-size samples)."""
        peak, seen, unknown = 0, 0, 0
        for s in self.samples:
            mine = [s[p] for p in pids if p in s]
            if not mine:
                continue
            seen += 1
            if any(u is None for u in mine):
                unknown += 1
                continue
            peak = max(peak, sum(mine))
        return peak, seen, unknown


def mib(n):
    return f"{n / (1 << 20):.0f} MiB"


def check_nvml_peak(sampler, pids, quota):
    """(ok, text) for "NVML per-process used <= quota at every sample"."""
    peak, seen, unknown = sampler.peak(pids)
    if sampler.errors:
        return False, f"NVML errors: {sampler.errors[0]}"
    if seen == 0:
        others = sorted({p for s in sampler.samples for p in s})[:8]
        hint = f"; it listed {others} (another PID namespace?)" if others else ""
        return False, f"NVML never listed pids {pids} ({len(sampler.samples)} samples){hint}"
    if unknown:
        return False, f"NVML gave no per-process memory in {unknown}/{seen} samples"
    return peak <= quota, f"NVML peak {mib(peak)} over {seen} samples"
