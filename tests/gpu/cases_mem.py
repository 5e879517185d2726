"""Memory cases: fill to OOM (PyTorch's caching allocator, its cudaMallocAsync
backend, the driver API), mem_get_info, two racing processes, nvidia-smi."""

import subprocess
import time

from container import Container, outside_env
from harness import FAIL, PASS, NotRun, Row, Sampler, Worker, check_nvml_peak, mib

GIB = 1 << 30
QUOTA = 4 * GIB
BLOCK = 256 << 20
# NVML counts what the driver really holds; allow this much rounding between
# it and what the interposer charged (2 MiB pages, context estimates).
SLACK = 128 << 20
START_S = 90  # worker start-up budget: importing torch and a first context
ALLOC_CONF = {"torch-async": "backend:cudaMallocAsync", "torch-expandable": "expandable_segments:True"}


def need_torch(node, api):
    if api.startswith("torch") and not node.has_torch:
        raise NotRun("PyTorch not importable")


def _fill_rows(node, name, api, n_workers=1, refill=False):
    need_torch(node, api)
    extra = {"PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF[api]} if api in ALLOC_CONF else {}
    args = [api, BLOCK, QUOTA + 4 * BLOCK] + (["--refill"] if refill else [])
    with Container(node, name, QUOTA) as c, Sampler(node.nvml) as s:
        workers, readies = [], []
        try:
            # One after the other until ready (each one's new NVML PID is its own
            # where NVML speaks of another namespace); released together.
            for _ in range(n_workers):
                workers.append(Worker(node, "alloc.py", args, c.env(extra)))
                readies.append(workers[-1].wait_for("ready", START_S))
            for w in workers:  # racers start together
                w.go()
            results = [w.wait_for("result", 120)["result"] for w in workers]
            pids = [w.pids for w in workers]
            registered = c.wait_pids([p.local for p in pids], 2.0)
            time.sleep(0.5)  # samples of everything held at once
        finally:
            for w in workers:
                w.finish()
    return readies, results, pids, registered, s


def _judge_fill(results, s, pids, registered, refill=False):
    """(status, measured) against: every worker stopped with OOM, the real
    per-process memory (NVML) never above the quota and, at the OOM, within one
    block (+ SLACK) of it."""
    unmapped = [p for p in pids if p.nvml is None]
    if unmapped:
        return FAIL, f"no NVML PID for worker {unmapped[0].own}: {unmapped[0].how}"
    nvml = [p.nvml for p in pids]
    ok_nvml, nvml_txt = check_nvml_peak(s, nvml, QUOTA)
    peak, _, _ = s.peak(nvml)
    blocks = [r["blocks"] for r in results]
    stops = {r["stop"] for r in results}
    ok = stops == {"OOM"} and ok_nvml and peak > QUOTA - BLOCK - SLACK and registered
    parts = [f"blocks {'+'.join(map(str, blocks))} ({mib(sum(blocks) * BLOCK)}), stop {'/'.join(sorted(stops))}",
             nvml_txt]
    if refill:
        again = [r.get("refill_blocks") for r in results]
        ok = ok and again == blocks and {r.get("refill_stop") for r in results} == {"OOM"}
        parts.append(f"refill {'+'.join(map(str, again))}")
    if not registered:
        parts.append("not all workers in pids.config")
    if any(p.own != p.nvml for p in pids):
        parts.append("PIDs own→NVML " + ", ".join(f"{p} ({p.how})" for p in pids))
    return (PASS if ok else FAIL), "; ".join(parts)


OOM_EXPECT = f"OOM (no other error); NVML used <= {mib(QUOTA)} always, > quota-1 block-{mib(SLACK)} at OOM"


def oom(node, api):
    name = f"oom-{api}"
    readies, results, pids, reg, s = _fill_rows(node, name, api)
    status, measured = _judge_fill(results, s, pids, reg)
    backend = readies[0].get("backend", "")
    if api == "torch-expandable":
        backend += ", expandable segments"
        if not results[0].get("expandable"):
            status, measured = FAIL, "no expandable segment in torch.cuda.memory_snapshot(); " + measured
    return Row(f"{api}: 256 MiB blocks to OOM [{backend}]", OOM_EXPECT, measured, status)


def pool(node, api):
    readies, results, pids, reg, s = _fill_rows(node, f"pool-{api}", api, refill=True)
    status, measured = _judge_fill(results, s, pids, reg, refill=True)
    backend = readies[0].get("backend", "")
    if api == "torch-async" and backend != "cudaMallocAsync":
        status, measured = FAIL, f"allocator backend is {backend!r}, not cudaMallocAsync; " + measured
    return Row(f"{api}: pool fill, free all, refill [{backend}]",
               OOM_EXPECT + "; refill gets as many blocks", measured, status)


def race(node, api):
    readies, results, pids, reg, s = _fill_rows(node, f"race-{api}", api, n_workers=2)
    status, measured = _judge_fill(results, s, pids, reg)
    return Row(f"{api}: two processes racing to OOM", "sum of both: " + OOM_EXPECT, measured, status)


def mem_get_info(node, api):
    need_torch(node, api)
    step = GIB
    with Container(node, f"meminfo-{api}", QUOTA) as c, Worker(node, "meminfo.py", [api, step], c.env()) as w:
        w.wait_for("ready", START_S)
        w.go()
        r = w.wait_for("result", 60)["result"]
    (f0, t0), (f1, t1) = r["before"], r["after"]
    drop = f0 - f1
    ok = t0 == QUOTA and t1 == QUOTA and f0 <= QUOTA and abs(drop - step) <= (2 << 20) \
        and r["device_total"] == QUOTA
    what = "torch.cuda.mem_get_info" if api == "torch" else "cuMemGetInfo"
    return Row(f"{api}: {what}",
               f"total = {mib(QUOTA)} (and device total); free <= total; 1 GiB alloc drops free by 1 GiB",
               f"total {mib(t0)}, free {mib(f0)} -> {mib(f1)} (drop {mib(drop)}), device total {mib(r['device_total'])}",
               PASS if ok else FAIL)


def nvidia_smi(node):
    """nvidia-smi in the share while the container holds 1 GiB and a process
    outside it (real driver) holds 512 MiB."""
    smi = node.bin / "nvidia-smi"
    if not smi.is_file():
        raise NotRun(f"no nvidia-smi in the mirror ({node.bin})")
    with Container(node, "smi", QUOTA) as c, Worker(node, "holder.py", [GIB], c.env()) as inside:
        inside.wait_for("ready", START_S)  # before the outsider starts: its new NVML PID is its own
        with Worker(node, "holder.py", [512 << 20], outside_env(node)) as outside:
            for w in (inside, outside):
                w.wait_for("ready", START_S)
                w.go()
                w.wait_for("result", 30)

            # With --pidns, nvidia-smi runs in the inside worker's PID and mount
            # namespaces, as in the worker's pod: the driver lists that
            # namespace's processes by their PIDs there and no one else's.
            ns = ["nsenter", "--target", str(inside.pids.local), "--pid", "--mount"] if node.pidns else []

            def smi_run(*args):
                p = subprocess.run([*ns, str(smi), *args], env=c.env(), capture_output=True, text=True, timeout=60)
                if p.returncode != 0:
                    raise RuntimeError(f"nvidia-smi {' '.join(args)}: rc {p.returncode}: {p.stderr.strip()[-300:]}")
                return p.stdout

            gpu = smi_run("--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits")
            apps = smi_run("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
            table = smi_run()
    total, used = (int(float(x)) for x in gpu.strip().splitlines()[0].split(","))
    # One "pid, used" line per process; anything else (a "No running processes" note) lists none.
    listed = {int(f) for f in (line.split(",")[0].strip() for line in apps.splitlines()) if f.isdigit()}
    quota_mib = QUOTA >> 20
    # nvidia-smi lists NVML's PIDs: the host's, to a caller in the host's
    # namespace; in the worker's namespace, the worker's PID there.
    want = {inside.pids.own} if node.pidns else {inside.pids.nvml}
    ok = total == quota_mib and 1024 <= used <= quota_mib and listed == want \
        and f"{quota_mib}MiB" in table.replace(" ", "")
    return Row("nvidia-smi in the share",
               f"memory.total = {quota_mib} MiB, 1024 <= used <= total, apps = the container's only; table shows it",
               f"total {total} MiB, used {used} MiB, apps {sorted(listed)} (inside {inside.pids} "
               f"[{inside.pids.how}], outside {outside.pids})", PASS if ok else FAIL)


IPC_BYTES = GIB
# What opening an IPC handle may take beyond the opened bytes (the driver's
# mapping bookkeeping); far below the 1 GiB a double charge would show.
IPC_SLACK = 64 << 20


def ipc(node):
    """Two processes of one container pass a 1 GiB tensor over CUDA IPC
    (torch.multiprocessing): the opener sees the bytes and the exporter the
    opener's writes; opening charges the container nothing more (both views
    drop by at most IPC_SLACK); NVML's per-process sum over the container's
    processes stays within the quota at every sample."""
    need_torch(node, "torch")
    before = set()
    if node.nvml:
        try:
            before = set(node.nvml.processes())
        except RuntimeError:
            pass
    with Container(node, "ipc-torch", QUOTA) as c, Sampler(node.nvml) as s, \
            Worker(node, "ipc.py", [IPC_BYTES], c.env()) as w:
        w.wait_for("ready", START_S)
        w.go()
        r = w.wait_for("result", 120)["result"]
        time.sleep(0.5)  # samples of both holding everything
    exp_drop = r["exporter_before"][0] - r["exporter_after"][0]
    opn_drop = r["opener_before"][0] - r["opener_after"][0]
    mine = sorted({p for sample in s.samples for p in sample} - before)
    ok_nvml, nvml_txt = check_nvml_peak(s, mine, QUOTA)
    ok = r["intact"] and r["written_by_opener"] == 9 and exp_drop <= IPC_SLACK and opn_drop <= IPC_SLACK \
        and ok_nvml and len(mine) == 2
    return Row("torch: a 1 GiB tensor over CUDA IPC between two processes of the share",
               f"bytes intact both ways; opening drops neither view's free by > {mib(IPC_SLACK)}; "
               f"NVML sum of the container's 2 processes <= {mib(QUOTA)}",
               f"intact {r['intact']}, opener wrote {r['written_by_opener']}; free drop at open: exporter "
               f"{mib(exp_drop)}, opener {mib(opn_drop)}; {nvml_txt} (PIDs {mine})", PASS if ok else FAIL)
