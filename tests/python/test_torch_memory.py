"""PyTorch's memory call sequences on the simulated node under the
interposer, followed from PyTorch's own source (torch 2.15.0 from PyPI, as
test_torch.py; C++ lines from PyTorch v2.6.0's
c10/cuda/CUDACachingAllocator.cpp, whose ExpandableSegment is the same
code; Python lines from the installed 2.15.0):

- `expandable_segments:True`: one segment per stream, reserved as address
  space for 1 1/8 of cudaGetDeviceProperties' totalGlobalMem (the quota
  here; CUDACachingAllocator.cpp:371-378, cuMemAddressReserve) and grown by
  20 MiB handles (kLargeBuffer, :51): cuMemCreate with requestedHandleTypes
  POSIX_FILE_DESCRIPTOR (:402-411), a cuMemMap of each, then one
  cuMemSetAccess over the range mapped (mapAndSetAccess, :557-570, and
  setAccess, :547-555). A cuMemCreate answered CUDA_ERROR_OUT_OF_MEMORY
  releases what that call made (:412-420); the allocator frees its cache,
  retries (:1234-1242) and raises torch.cuda.OutOfMemoryError (:1338-1341).
  empty_cache (:1606, release_cached_blocks :2859, unmap_block :2974)
  unmaps and releases the handles (unmapHandles, :572-597).
- torch.multiprocessing's CUDA IPC: reduce_tensor shares the storage
  (torch/multiprocessing/reductions.py:356, cudaIpcGetMemHandle; with
  expandable segments cuMemExportToShareableHandle, allocator :446-458)
  and the receiver opens it (rebuild_cuda_tensor, reductions.py:158-199,
  cudaIpcOpenMemHandle; with expandable segments pidfd_getfd and
  cuMemImportFromShareableHandle, allocator :465-520).

Every figure is read three ways, as the frameworks read them:
torch.cuda.mem_get_info (cudaMemGetInfo, torch/cuda/memory.py:848-864),
nvmlDeviceGetMemoryInfo (torch.cuda.device_memory_used,
torch/cuda/__init__.py:1660-1673) and the sum of
nvmlDeviceGetComputeRunningProcesses (torch.cuda.list_gpu_processes,
torch/cuda/memory.py:782-808): the interposer measures the driver again
at a memory query after a launch (its NVML tick is every 100 ms), so the
memory the driver takes on its own (the kernels a first launch loads) is in
all three at once (test_vllm_sizing.py's first-launch test).
"""

import json
import os
import textwrap

import pytest

from conftest import run_client
from test_shim_clients import CTX, QUOTA, shim_node  # noqa: F401  (the fixture)

MIB = 1 << 20
# PyTorch's large-pool segment size (kLargeBuffer): one cudaMalloc, or one
# cuMemCreate handle with expandable segments, per tensor of this size.
SEG = 20 * MIB

# What every client starts with: NVML, and the three views of the memory.
PRELUDE = """
import gc, json, math, os, sys, time
import torch
import pynvml as N

MIB = 1 << 20
N.nvmlInit()
H = N.nvmlDeviceGetHandleByIndex(0)


def views():
    free, total = torch.cuda.mem_get_info()
    m = N.nvmlDeviceGetMemoryInfo(H)
    procs = {p.pid: p.usedGpuMemory for p in N.nvmlDeviceGetComputeRunningProcesses(H)}
    return {"free": free, "total": total, "used": total - free, "nvml_total": m.total,
            "nvml_used": m.used, "procs": procs, "procs_sum": sum(procs.values())}


def settled(timeout=5.0):
    # The views once the three agree and hold still for two reads (the
    # interposer reconciles with the driver's per-process figure on its tick).
    deadline = time.monotonic() + timeout
    last = None
    while True:
        v = views()
        agree = v["used"] == v["nvml_used"] == v["procs_sum"]
        if agree and v == last:
            return v
        if time.monotonic() > deadline:
            v["unsettled"] = True
            return v
        last = v if agree else None
        time.sleep(0.05)
"""


def torch_run(node, body, env=None, script=None, timeout=120):
    """Runs PRELUDE + `body` under the interposer with torch on PYTHONPATH
    (tests/run.sh installs it into $VCUDA_TORCH_SITE); returns the last
    stdout line as JSON and stderr. `script`: a file to run instead of
    `python -c` (torch.multiprocessing's spawn needs a main module)."""
    root, lib64, cfg = node
    e = {"LD_LIBRARY_PATH": str(lib64), "VCUDA_CONFIG_DIR": str(cfg)}
    site = os.environ.get("VCUDA_TORCH_SITE")
    if site:
        e["PYTHONPATH"] = site
    e.update(env or {})
    code = PRELUDE + textwrap.dedent(body)
    if script is not None:
        script.write_text(code)
        code = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
    p = run_client(root, code, env=e, timeout=timeout)
    if "No module named 'torch'" in p.stderr:
        msg = "torch is not installed: tests/run.sh installs torch==2.15.0 into $VCUDA_TORCH_SITE"
        if os.environ.get("VCUDA_REQUIRE_ALL") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr


def agree(v, quota=QUOTA):
    """mem_get_info, NVML's memory info and NVML's process list say the
    same: total the quota, one used figure."""
    assert not v.get("unsettled"), v
    assert v["total"] == v["nvml_total"] == quota, v
    assert v["used"] == v["nvml_used"] == v["procs_sum"], v


FILL = """
# A program's first steps (cuBLAS's handle and workspace), then the cache
# given back, as vLLM's worker does before it measures.
x = torch.ones(16, 16, device="cuda")
torch.mm(x, x)
del x
torch.cuda.empty_cache()
out = {"start": settled()}


def fill():
    held = []
    try:
        while True:
            held.append(torch.empty(SIZE, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:
        out.setdefault("oom", str(e).splitlines()[0])
    return held


held = fill()
out["n"] = len(held)
out["full"] = settled()
out["reserved"] = torch.cuda.memory_reserved()
out["segments"] = [(s["is_expandable"], s["total_size"]) for s in torch.cuda.memory_snapshot()]
del held
torch.cuda.empty_cache()
out["emptied"] = settled()
held = fill()
out["n_again"] = len(held)
# Still usable after two OOMs: a kernel on what is held.
held[0].fill_(1)
torch.cuda.synchronize()
print(json.dumps(out))
"""


def fill(node, conf, size):
    return torch_run(node, f"SIZE = {size}\n" + FILL, env={"PYTORCH_CUDA_ALLOC_CONF": conf})


# One handle per growth, and five: each growth maps its handles one by one,
# then sets access once over them all (:557-570); the growth that runs out
# releases the handles it had made (:412-420).
@pytest.mark.parametrize("size", [SEG, 5 * SEG])
def test_expandable_segments_stop_at_the_quota_as_cudamalloc_does(shim_node, size):  # noqa: F811
    plain, _ = fill(shim_node, "expandable_segments:False", size)
    grown, err = fill(shim_node, "expandable_segments:True", size)
    for out in (plain, grown):
        for v in ("start", "full", "emptied"):
            agree(out[v])
        start = out["start"]
        # The container holds its context (and cuBLAS's) and nothing else.
        assert start["used"] >= CTX and start["free"] == QUOTA - start["used"], out
        assert out["oom"].startswith(f"CUDA out of memory. Tried to allocate {size // MIB}.00 MiB"), out
        # Every whole tensor that fitted in what was free, and not one more:
        # the 1 1/8 quota of address space reserved is not charged, each
        # handle is, and those of the growth that failed are given back.
        assert out["n"] == start["free"] // size, out
        assert out["full"]["free"] == start["free"] - out["n"] * size, out
        assert out["reserved"] == out["n"] * size, out
        # empty_cache gives every byte back; the same again after.
        assert out["emptied"]["free"] == start["free"], out
        assert out["n_again"] == out["n"], out
    # The same numbers either way.
    assert grown["start"]["free"] == plain["start"]["free"]
    assert (grown["n"], grown["full"]["free"]) == (plain["n"], plain["full"]["free"])
    # The paths differ: one segment per tensor, or one expandable segment
    # grown to n tensors; cuMemCreate's OOM is what stopped it (PyTorch
    # 2.15's warning, CUDACachingAllocator.cpp:623).
    assert plain["segments"] == [[False, size]] * plain["n"]
    assert grown["segments"] == [[True, grown["n"] * size]]
    assert "expandable_segments: memory mapping failed with OOM" in err


IPC = """
import torch.multiprocessing as mp


def receiver(q, back, done):
    torch.empty(1, device="cuda")  # its context
    before = settled()
    t = q.get()
    head = t[:4].tolist()  # the sender's bytes, copied from its memory
    back.put({"before": before, "after": settled(), "numel": t.numel(), "head": head,
              "pid": os.getpid(), "reserved": torch.cuda.memory_reserved()})
    done.get()
    del t
    torch.cuda.ipc_collect()
    back.put("released")


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q, back, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=receiver, args=(q, back, done))
    p.start()
    t = torch.empty(SIZE // 4, device="cuda")
    t[:4].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    torch.cuda.synchronize()
    sender = settled()
    q.put(t)
    out = back.get(timeout=60)
    out["sender_before"] = sender
    out["both"] = settled()
    done.put(1)
    assert back.get(timeout=60) == "released"
    p.join(30)
    del t
    torch.cuda.empty_cache()
    out["sender_alone"] = settled()
    out["exit"] = p.exitcode
    out["me"] = os.getpid()
    print(json.dumps(out))
"""


@pytest.mark.parametrize(
    "conf",
    [
        # cudaIpcGetMemHandle / cudaIpcOpenMemHandle of a cudaMalloc segment.
        "expandable_segments:False",
        # Twelve shareable POSIX-fd handles of an expandable segment.
        "expandable_segments:True",
    ],
)
def test_a_tensor_sent_over_cuda_ipc_is_charged_once(shim_node, tmp_path, conf):  # noqa: F811
    size = 12 * SEG
    out, _ = torch_run(
        shim_node,
        f"SIZE = {size}\n" + IPC,
        env={"PYTORCH_CUDA_ALLOC_CONF": conf},
        script=tmp_path / "ipc_pair.py",
    )
    assert out["exit"] == 0, out
    assert out["numel"] == size // 4 and out["head"] == [1.0, 2.0, 3.0, 4.0], out
    for v in ("before", "after", "sender_before", "both", "sender_alone"):
        agree(out[v])
    me, peer = str(out["me"]), str(out["pid"])
    sender = out["sender_before"]["procs"][me]
    # The receiver holds its context and its own small pool; opening the
    # sender's tensor and copying from it adds nothing: the memory stays
    # the sender's, charged once.
    assert out["after"]["procs"][peer] == out["before"]["procs"][peer], out
    assert out["both"]["procs"] == {me: sender, peer: out["after"]["procs"][peer]}, out
    # Both processes of the share see one free figure: the quota less what
    # the two hold together.
    assert out["after"]["free"] == out["both"]["free"] == QUOTA - sender - out["after"]["procs"][peer]
    # The sender's tensor is gone once the receiver let go and it freed it.
    assert out["sender_alone"]["procs"] == {me: sender - size}, out
