"""Allocates BLOCK-byte blocks until the allocator says out of memory, holds
them until stdin closes, and reports how many it got.

usage: alloc.py API BLOCK CAP [--refill]
  API: torch (caching allocator), torch-expandable (the same with
       PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: cuMemCreate'd
       handles mapped into one growing range), torch-async
       (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync; both set by the
       harness), driver (cuMemAlloc), driver-async (cuMemAllocAsync on a
       stream's default pool)
  CAP: stop (and say so) after this many bytes: the quota is not enforced
  --refill: after the first OOM free everything and fill again (pool reuse)
"""

import sys

import proto


def torch_api():
    import torch

    torch.cuda.init()
    torch.empty(1, device="cuda")  # context now, not inside the fill

    def alloc(n):
        try:
            return torch.empty(n, dtype=torch.uint8, device="cuda"), None
        except torch.cuda.OutOfMemoryError:
            return None, "OOM"

    def release(held):
        held.clear()
        torch.cuda.synchronize()

    info = lambda: tuple(torch.cuda.mem_get_info())  # noqa: E731
    backend = getattr(torch.cuda, "get_allocator_backend", lambda: "native (old torch)")()
    return alloc, release, info, backend


def expandable(torch):
    """Whether the caching allocator's segments are expandable ones."""
    return any(s.get("is_expandable") for s in torch.cuda.memory_snapshot())


def driver_api(is_async):
    import cudrv

    d = cudrv.Driver()
    s = d.stream()

    def alloc(n):
        r, p = d.alloc_async(n, s) if is_async else d.alloc(n)
        if r == cudrv.CUDA_SUCCESS:
            return p, None
        return None, "OOM" if r == cudrv.CUDA_ERROR_OUT_OF_MEMORY else f"CUresult {r}"

    def release(held):
        for p in held:
            d.free_async(p, s) if is_async else d.free(p)
        held.clear()
        d.ok("cuStreamSynchronize", s)

    return alloc, release, d.mem_get_info, "cuMemAllocAsync" if is_async else "cuMemAlloc"


def fill(alloc, block, cap, held):
    while True:
        if len(held) * block >= cap:
            return "cap"
        p, err = alloc(block)
        if err:
            return err
        held.append(p)


def run():
    api, block, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    refill = "--refill" in sys.argv[4:]
    if api in ("torch", "torch-expandable", "torch-async"):
        alloc, release, info, backend = torch_api()
    elif api in ("driver", "driver-async"):
        alloc, release, info, backend = driver_api(api == "driver-async")
    else:
        raise ValueError(f"unknown API {api!r}")
    import os

    proto.ready(pid=os.getpid(), backend=backend)
    held = []
    stop = fill(alloc, block, cap, held)
    out = {"blocks": len(held), "stop": stop, "info_at_oom": list(info())}
    if api == "torch-expandable":
        import torch

        out["expandable"] = expandable(torch)
    if refill:
        release(held)
        out["info_after_free"] = list(info())
        out["refill_stop"] = fill(alloc, block, cap, held)
        out["refill_blocks"] = len(held)
    proto.say(result=out)
    proto.hold()


if __name__ == "__main__":
    proto.main(run)
