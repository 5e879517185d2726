#!/bin/bash
# On a GPU machine: which private NVML tables (nvmlInternalGetExportTable) the
# host's nvidia-smi asks for, and what it shows when each is refused, while a
# PyTorch process holds 512 MiB; then whether the driver lists that process to
# an nvidia-smi in another PID namespace.  usage: smi-tables.sh WORKDIR
set -u
work=$1; here=$(cd "$(dirname "$0")" && pwd)
probe=$work/smi_tables.so
cc -shared -fPIC -o "$probe" "$here/smi_tables.c" -ldl || exit 2
smi=$(command -v nvidia-smi) || { echo "no nvidia-smi"; exit 2; }
${PYTHON:-python3} -c 'import torch,time; x=torch.empty(512<<20,dtype=torch.uint8,device="cuda"); torch.cuda.synchronize(); print("holder", flush=True); time.sleep(90)' &
holder=$!
for _ in $(seq 60); do "$smi" --query-compute-apps=pid --format=csv,noheader | grep -qw "$holder" && break; sleep 0.5; done
apps() { "$smi" --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1; echo "rc $?"; }
echo "== holder pid $holder; resolved names"
PROBE_NAMES=1 LD_PRELOAD=$probe "$smi" -q >/dev/null 2>"$work/names.txt"
grep -c "probe: dlsym" "$work/names.txt"; grep missing "$work/names.txt" | head -20
echo "== tables asked by: nvidia-smi (table), -q, --query-compute-apps, --query-gpu"
for args in "" "-q" "--query-compute-apps=pid,used_memory --format=csv" "--query-gpu=memory.used --format=csv"; do
  LD_PRELOAD=$probe "$smi" $args 2>&1 >/dev/null | sort | uniq -c | sed "s|^|[$args] |"
done
ids=$(LD_PRELOAD=$probe "$smi" -q 2>&1 >/dev/null | sed -n 's/^probe: table \([0-9a-f]*\).*/\1/p' | sort -u)
echo "== every table refused"
PROBE_REFUSE=all LD_PRELOAD=$probe "$smi" 2>&1; echo "rc $?"
PROBE_REFUSE=all LD_PRELOAD=$probe apps
PROBE_REFUSE=all LD_PRELOAD=$probe "$smi" --query-gpu=memory.used,memory.total --format=csv 2>&1
for id in $ids; do
  echo "== refused $id: compute apps"
  PROBE_REFUSE=$id LD_PRELOAD=$probe apps
done
echo "== another PID namespace (unshare --pid --fork --mount-proc)"
unshare --pid --fork --mount-proc "$smi" --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1; echo "rc $?"
unshare --pid --fork --mount-proc "$smi" 2>&1 | tail -8
kill "$holder" 2>/dev/null; wait 2>/dev/null
