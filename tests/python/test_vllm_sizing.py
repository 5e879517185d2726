"""vLLM's memory sizing, done the vLLM way, on the simulated node under the
interposer: its steps reimplemented in a few lines over PyTorch (torch
2.15.0, as test_torch.py), each following vLLM 0.33.0's source (the PyPI
wheel's files and lines):

1. NVML's total for the device (vllm/platforms/cuda.py:804-808,
   nvmlDeviceGetMemoryInfo(handle).total): the engine's defaults come from
   it, so it must be the quota, as cudaMemGetInfo's is (HAMi-core #181:
   NVML reported the card while CUDA reported the slice).
2. The worker's start (vllm/v1/worker/gpu_worker.py:526-541): a cuBLAS and
   a cuBLASLt call, gc, empty_cache, then the init MemorySnapshot
   (vllm/utils/mem_utils.py:131-159: torch.accelerator.memory_stats,
   get_memory_info, memory_reserved).
3. request_memory (vllm/v1/worker/utils.py:716-769): ceil(total x
   gpu_memory_utilization), refused when less than that is free at start.
4. memory_profiling around a profile run (mem_utils.py:283-321): weights
   held, activations freed, memory outside torch; then vLLM's assertion that
   free memory did not grow meanwhile (gpu_worker.py:732; HAMi #1381: there
   the free figure did not move at all) and the KV budget
   requested - non_kv_cache_memory (gpu_worker.py:753-757).
5. num_blocks = available // bytes_per_block
   (vllm/v1/core/kv_cache_planning.py:681), allocated as one int8 buffer
   (vllm/v1/worker/utils.py:596; torch.empty here where vLLM zeroes it:
   the simulator's memset writes every byte, 14 s for 2 GiB in a debug
   build, and zeroing changes no memory figure).
6. profile_cudagraph_memory (vllm/v1/worker/gpu_model_runner.py:6268-6414):
   graphs of the two largest batch sizes captured into a pool, free memory
   sampled around each, an estimate for all of them.

Beside it, a second process of the same share holds memory: NVML's
per-process list seen inside the share shows both and adds up to the used
figure that cudaMemGetInfo and nvmlDeviceGetMemoryInfo give.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import start_shim_node
from test_shim_clients import CTX, GIB, PRELUDE as CUDA_PRELUDE
from test_torch_memory import agree, torch_run

MIB = 1 << 20
# A share large enough for vLLM's default gpu_memory_utilization (0.9 of the
# total free at start) beside its own context and a neighbour's.
QUOTA = 24 * GIB + CTX
UTIL = 0.9
# One KV block over all layers: 64 tokens x 80 layers x (K, V) x 8 KV heads
# x head size 128 x 2 bytes (a 70B-class model's cache), 20 MiB: each extra
# block is one cudaMalloc of its own size.
BLOCK = 20 * MIB
WEIGHTS = 512 * MIB
ACTIVATIONS = 2 * 256 * MIB
# Memory outside torch during the profile run (NCCL's buffers, say), taken
# with the driver API.
NON_TORCH = 64 * MIB
# The kernels a process's first launches load (the driver takes them on its
# own; 25 MiB measured for the warm-up's cuBLAS/cuBLASLt calls): a bound.
KERNELS = 64 * MIB

SIZING = """
from cuda.bindings import driver as d


def snapshot():
    # MemorySnapshot.measure (mem_utils.py:131-159).
    stats = torch.accelerator.memory_stats()
    free, total = torch.accelerator.get_memory_info()
    reserved = torch.accelerator.memory_reserved()
    return {"peak": stats.get("allocated_bytes.all.peak", 0),
            "allocated": stats.get("allocated_bytes.all.current", 0),
            "free": free, "total": total, "torch": reserved}


out = {"nvml_total": N.nvmlDeviceGetMemoryInfo(H).total, "me": os.getpid()}
# The worker's start (gpu_worker.py:526-541).
x = torch.ones(16, 16, dtype=torch.float16, device="cuda")
torch.mm(x, x)
torch.nn.functional.linear(x, x, x[0])
del x
gc.collect()
torch.accelerator.empty_cache()
init = out["init"] = snapshot()
out["init_settled"] = settled()
# request_memory (utils.py:724-769).
requested = out["requested"] = math.ceil(init["total"] * UTIL)
assert init["free"] >= requested, ("vLLM would refuse to start", init, requested)
out["requested_all"] = math.ceil(init["total"] * 1.0)

weights = torch.empty(WEIGHTS, dtype=torch.uint8, device="cuda")
# memory_profiling (mem_utils.py:283-321) around a profile run.
gc.collect()
torch.accelerator.empty_cache()
torch.accelerator.reset_peak_memory_stats()
acts = [torch.empty(ACTIVATIONS // 2, dtype=torch.uint8, device="cuda") for _ in range(2)]
acts[0][:4096].add_(1)
err, outside = d.cuMemAlloc(NON_TORCH)
assert err == d.CUresult.CUDA_SUCCESS, err
del acts
torch.cuda.synchronize()
gc.collect()
torch.accelerator.empty_cache()
after = out["after"] = snapshot()
# gpu_worker.py:732: free memory may only have shrunk meanwhile.
assert init["free"] >= after["free"], ("vLLM's profiling assertion", init, after)
consumed = out["consumed"] = init["free"] - after["free"]
headroom = out["headroom"] = after["peak"] - after["allocated"]
available = out["available"] = requested - (consumed + headroom)
num_blocks = out["num_blocks"] = available // BLOCK
kv = torch.empty(num_blocks * BLOCK, dtype=torch.int8, device="cuda")
out["kv"] = settled()
# Blocks beyond the budget until the quota refuses one: a clean OOM.
extra = []
try:
    while True:
        extra.append(torch.empty(BLOCK, dtype=torch.int8, device="cuda"))
except torch.cuda.OutOfMemoryError as e:
    out["oom"] = str(e).splitlines()[0]
out["extra"] = len(extra)
out["full"] = settled()
del extra
torch.cuda.empty_cache()
kv[:BLOCK].fill_(1)  # and it goes on serving
torch.cuda.synchronize()
out["served"] = settled()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def share(tmp_path_factory):
    """A container's share of QUOTA bytes on the simulated node."""
    yield from start_shim_node(tmp_path_factory, QUOTA)


@pytest.fixture
def neighbour(share):
    """A second process of the same share holding 1 GiB (the driver API)."""
    _, lib64, cfg = share
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_SIM_ROOT", "CUDA_VISIBLE_DEVICES")}
    env.update({"LD_LIBRARY_PATH": str(lib64), "VCUDA_CONFIG_DIR": str(cfg)})
    body = f"""
        import sys
        ok(d.cuInit(0))
        ctx = ok(d.cuCtxCreate(None, 0, ok(d.cuDeviceGet(0))))
        p = ok(d.cuMemAlloc({GIB}))
        print("held", flush=True)
        sys.stdin.read()
        """
    p = subprocess.Popen(
        [sys.executable, "-c", CUDA_PRELUDE + textwrap.dedent(body)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "held"
        yield p.pid
    finally:
        p.stdin.close()
        p.wait(timeout=10)


def test_vllm_sizes_its_kv_cache_inside_the_quota(share, neighbour):
    consts = f"UTIL, BLOCK, WEIGHTS, ACTIVATIONS, NON_TORCH = {UTIL}, {BLOCK}, {WEIGHTS}, {ACTIVATIONS}, {NON_TORCH}\n"
    out, _ = torch_run(share, consts + SIZING)
    me, other = str(out["me"]), str(neighbour)
    init, start = out["init"], out["init_settled"]
    # 1. NVML's total and CUDA's are both the quota.
    assert out["nvml_total"] == init["total"] == QUOTA, out
    # 2. At start the container holds the neighbour's context and 1 GiB and
    # this process's context (and cuBLAS's): free is the quota less that,
    # the same in all three views.
    agree(start, QUOTA)
    assert set(start["procs"]) == {me, other}, start
    assert start["procs"][other] == CTX + GIB, start
    assert start["free"] == QUOTA - start["procs"][me] - start["procs"][other]
    # What vLLM read at once may lack only the kernels its warm-up loaded.
    assert 0 <= init["free"] - start["free"] < KERNELS, out
    # 3. 0.9 of the quota fits beside all that; the whole quota would not
    # (vLLM's own refusal at start, utils.py:761).
    assert init["free"] >= out["requested"] == -(-QUOTA * 9 // 10), out
    assert init["free"] < out["requested_all"], out
    # 4. The profile run consumed the weights and what went outside torch
    # (and any kernels its launches loaded); the activations were headroom.
    assert WEIGHTS + NON_TORCH <= out["consumed"] < WEIGHTS + NON_TORCH + KERNELS, out
    assert out["headroom"] == ACTIVATIONS, out
    # 5. The KV cache fits in vLLM's budget: what is free beyond what vLLM
    # left unrequested is the activations' headroom and less than a block.
    kv = out["kv"]
    agree(kv, QUOTA)
    assert out["num_blocks"] == out["available"] // BLOCK > 0, out
    unrequested = init["free"] - out["requested"]
    assert ACTIVATIONS <= kv["free"] - unrequested < ACTIVATIONS + BLOCK + KERNELS, out
    # Past the budget, every block that fits in what is free goes in and the
    # next one, over the quota, raises OutOfMemoryError.
    assert out["extra"] == kv["free"] // BLOCK > 0, out
    assert out["oom"].startswith("CUDA out of memory. Tried to allocate 20.00 MiB"), out
    agree(out["full"], QUOTA)
    assert out["full"]["free"] == kv["free"] - out["extra"] * BLOCK < BLOCK, out
    # And the server goes on: the extra blocks given back, a kernel run, the
    # neighbour untouched.
    agree(out["served"], QUOTA)
    assert out["served"]["free"] == kv["free"], out
    assert out["served"]["procs"][other] == CTX + GIB, out


def test_nvml_and_mem_get_info_agree_right_after_a_first_launch(share):
    # vLLM measures right after its warm-up and its profile run, the
    # launches that load kernels (gpu_worker.py:526-541, mem_utils.py:312-314).
    # The driver's per-process figure holds each op's module at once; the
    # interposer measures again at a query when a launch ran since its last
    # measurement (cuda-shim/src/mem/reconcile.rs `fresh`). With a 2 ms
    # window alone the query after each op here read the ledger without the
    # op's module (+26-36 MB) whenever the op and the previous query were
    # under 2 ms apart: a failure on a fast machine, a pass on a loaded one.
    out, _ = torch_run(
        share,
        """
        x = torch.ones(64, 64, device="cuda")
        seen = []
        for op in (lambda: torch.mm(x, x), lambda: torch.cumsum(x, 0),
                   lambda: torch.softmax(x, 1), lambda: torch.sort(x, 1)):
            op()
            seen.append(views())
        print(json.dumps(seen))
        """,
    )
    for v in out:
        agree(v, QUOTA)


def test_vllm_cudagraph_profile_sees_the_graphs_memory_at_once(share):
    # vLLM's profile_cudagraph_memory (vllm/v1/worker/gpu_model_runner.py:
    # 6268-6414): after the profile run, it captures the two largest batch
    # sizes into a graph pool (:6307, :6330), samples get_memory_info's free
    # before and after each, synchronised (:6334-6349), and estimates
    # first + (n - 1) x max(second, 1 MiB) (:6353-6358), which the KV budget
    # gives up (gpu_worker.py:753-757). HAMi-core #181: that profile ran out
    # of memory on a slice. Here what it samples must be what the container
    # holds at that moment, and the estimate must cover the graphs captured.
    out, _ = torch_run(
        share,
        """
        SIZES = [256, 128, 64, 32, 16, 8]
        w1 = torch.empty(1024, 4096, device="cuda", dtype=torch.float16)
        w2 = torch.empty(4096, 1024, device="cuda", dtype=torch.float16)


        def model(x):
            return torch.relu(x @ w1) @ w2


        for b in SIZES:  # the profile run: every kernel loaded
            model(torch.empty(b, 1024, device="cuda", dtype=torch.float16))
        torch.cuda.synchronize()
        gc.collect()
        torch.accelerator.empty_cache()
        out = {"base": settled(), "samples": [], "at_once": [], "seen": []}
        pool = torch.cuda.graph_pool_handle()
        graphs = []


        def capture(b):
            x = torch.empty(b, 1024, device="cuda", dtype=torch.float16)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                model(x)  # warm-up, as torch.cuda.graph's docs ask
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                y = model(x)
            graphs.append((g, x, y))


        for b in SIZES[:2]:
            before = torch.accelerator.get_memory_info()[0]
            capture(b)
            torch.accelerator.synchronize()
            after = torch.accelerator.get_memory_info()[0]
            out["samples"].append(before - after)
            out["at_once"].append(after)
            out["seen"].append(settled())
        for b in SIZES[2:]:
            capture(b)
        for g, _, _ in graphs:
            g.replay()
        torch.cuda.synchronize()
        out["end"] = settled()
        out["n"] = len(SIZES)
        print(json.dumps(out))
        """,
    )
    agree(out["base"], QUOTA)
    for free, seen in zip(out["at_once"], out["seen"]):
        agree(seen, QUOTA)
        assert free == seen["free"], out
    first, second = out["samples"]
    assert first > 0, out
    estimate = first + max(second, MIB) * (out["n"] - 1)
    agree(out["end"], QUOTA)
    assert 0 < out["base"]["free"] - out["end"]["free"] <= estimate, out
