"""Two processes of one share exchanging a CUDA tensor over CUDA IPC, the way
torch.multiprocessing does it (torch/multiprocessing/reductions.py:
reduce_tensor -> storage._share_cuda_() -> cudaIpcGetMemHandle; the receiver's
rebuild_cuda_tensor -> cudaIpcOpenMemHandle), as vLLM's and SGLang's worker
processes pass tensors: this worker (the exporter) spawns the opener through
torch.multiprocessing, fills a BYTES tensor with 7s and puts it on a queue;
the opener checks the bytes, writes 9s into the first 16 and reports its
memory view before and after opening; the exporter reads the 9s back.
Bytes move by copies to and from the host (no kernel), so the check holds
on the simulated node too, whose kernels compute nothing.

usage: ipc.py BYTES
"""

import os
import sys

import proto


def _context():
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context before any measurement
    return torch


def opener(to_opener, from_opener):
    torch = _context()
    from_opener.put(("ready", os.getpid()))
    to_opener.get()  # the exporter holds its tensor: the view before opening
    from_opener.put(("before", list(torch.cuda.mem_get_info())))
    t = to_opener.get()  # cudaIpcOpenMemHandle happens here
    torch.cuda.synchronize()
    after = list(torch.cuda.mem_get_info())
    intact = bool((t[:4096].cpu() == 7).all()) and bool((t[-4096:].cpu() == 7).all())
    t[:16].copy_(torch.full((16,), 9, dtype=torch.uint8))
    torch.cuda.synchronize()
    from_opener.put(("opened", intact, after))
    to_opener.get()  # held until the exporter is done
    del t
    torch.cuda.synchronize()
    from_opener.put(("closed",))


def run():
    n = int(sys.argv[1])
    torch = _context()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    to_opener, from_opener = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=opener, args=(to_opener, from_opener), daemon=True)
    child.start()
    _, opener_pid = from_opener.get(timeout=120)
    proto.ready(pid=os.getpid(), opener_pid=opener_pid)
    t = torch.empty(n, dtype=torch.uint8, device="cuda")
    t.copy_(torch.full((n,), 7, dtype=torch.uint8))
    torch.cuda.synchronize()
    to_opener.put("measure")
    _, opener_before = from_opener.get(timeout=60)
    exporter_before = list(torch.cuda.mem_get_info())
    to_opener.put(t)
    _, intact, opener_after = from_opener.get(timeout=120)
    exporter_after = list(torch.cuda.mem_get_info())
    proto.say(result={
        "intact": intact,
        "written_by_opener": int(t[0].item()),
        "opener_pid": opener_pid,
        "opener_before": opener_before,
        "opener_after": opener_after,
        "exporter_before": exporter_before,
        "exporter_after": exporter_after,
    })
    proto.hold()  # both hold everything while the harness samples NVML
    to_opener.put("done")
    from_opener.get(timeout=60)
    child.join(60)


if __name__ == "__main__":
    proto.main(run)
