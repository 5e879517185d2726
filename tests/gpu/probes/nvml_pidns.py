"""On a GPU machine: which PIDs the driver's NVML names to a caller in a PID
namespace (as the interposer's controller and memory reconcile run in a pod
without hostPID). A child in the caller's namespace runs matmuls; the caller
prints its own view of the child's PID (and NSpid), then NVML's compute
process list and process-utilization samples.
Run beside a busy process in another namespace, it shows whether NVML names
processes outside the caller's namespace at all.
usage: [unshare --pid --fork --mount-proc] python3 nvml_pidns.py"""

import ctypes
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lib"))
from cudrv import Nvml  # noqa: E402

LOOP = ("import torch\na = torch.randn(4096, 4096, device='cuda')\nprint('go', flush=True)\n"
        "while True:\n    a = a @ a\n    a = a / a.norm()\n    torch.cuda.synchronize()\n")


class Sample(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("timeStamp", ctypes.c_ulonglong), ("smUtil", ctypes.c_uint),
                ("memUtil", ctypes.c_uint), ("encUtil", ctypes.c_uint), ("decUtil", ctypes.c_uint)]


def samples(n):
    count = ctypes.c_uint(0)
    since = ctypes.c_ulonglong(int(time.time() * 1e6) - 2_000_000)
    n.lib.nvmlDeviceGetProcessUtilization(n.h, None, ctypes.byref(count), since)
    arr = (Sample * max(1, count.value))()
    r = n.lib.nvmlDeviceGetProcessUtilization(n.h, arr, ctypes.byref(count), since)
    return r, sorted({(s.pid, s.smUtil) for s in arr[: count.value]})


def main():
    child = subprocess.Popen([sys.executable, "-c", LOOP], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "go"
    time.sleep(2)
    nspid = [ln for ln in open(f"/proc/{child.pid}/status") if ln.startswith("NSpid")]
    print(f"caller pid {os.getpid()}, child pid {child.pid} ({nspid[0].strip() if nspid else 'no NSpid'})")
    n = Nvml()
    print("compute processes:", n.processes())
    r, s = samples(n)
    print(f"process utilization (rc {r}):", s)
    util = (ctypes.c_uint * 2)()
    r = n.lib.nvmlDeviceGetUtilizationRates(n.h, util)
    print(f"device utilization (rc {r}): gpu {util[0]} %, memory {util[1]} %")
    child.kill()


if __name__ == "__main__":
    main()
