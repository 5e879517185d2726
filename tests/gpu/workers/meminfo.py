"""The memory a process in the share is shown: free/total before and after
allocating STEP bytes, and the device's total memory.

usage: meminfo.py API STEP      (API: torch -> torch.cuda.mem_get_info,
                                 driver -> cuMemGetInfo / cuDeviceTotalMem)
"""

import os
import sys

import proto


def run():
    api, step = sys.argv[1], int(sys.argv[2])
    if api == "torch":
        import torch

        torch.empty(1, device="cuda")
        info = lambda: list(torch.cuda.mem_get_info())  # noqa: E731
        device_total = torch.cuda.get_device_properties(0).total_memory
        alloc = lambda: torch.empty(step, dtype=torch.uint8, device="cuda")  # noqa: E731
    elif api == "driver":
        import cudrv

        d = cudrv.Driver()
        info = lambda: list(d.mem_get_info())  # noqa: E731
        device_total = d.device_total()

        def alloc():
            r, p = d.alloc(step)
            if r:
                raise cudrv.CudaError("cuMemAlloc_v2", r)
            return p
    else:
        raise ValueError(f"unknown API {api!r}")
    proto.ready(pid=os.getpid())
    before = info()
    held = alloc()
    after = info()
    proto.say(result={"before": before, "after": after, "device_total": device_total})
    del held
    proto.hold()


if __name__ == "__main__":
    proto.main(run)
