"""PIDs of a case's processes in the three namespaces that matter, never
assumed equal:

* own: the process's os.getpid() (its own PID namespace: a container's);
* local: the harness's namespace, what SO_PEERCRED gives the registration
  stand-in running beside the harness (pids.config holds these);
* nvml: what NVML lists. Real drivers list PIDs of the initial (host)
  namespace from any namespace: a suite run in a container without hostPID
  sees PIDs that are not its own.

local comes from /proc/<pid>/status `NSpid:` (the process's PID in each
namespace from the reader's down to its own) of the worker's process tree.
nvml: the local PID when NVML lists it; else (NVML speaks of a namespace
this harness cannot see) the one PID that appeared in NVML's process list
while the worker created its context ("correlated"); else unknown.
"""

import pathlib


def nspid(pid):
    """NSpid of `pid` as this reader sees it (outermost first), or None."""
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        return None
    return None


def _children(pid):
    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return out


def local_pid(root, own):
    """The local PID of the process in `root`'s tree (root included: the
    worker itself, or a launcher such as `unshare --fork` above it) whose
    own PID is `own`; None when none is."""
    todo, seen = [root], set()
    while todo:
        p = todo.pop(0)
        if p in seen:
            continue
        seen.add(p)
        ns = nspid(p)
        if ns and ns[-1] == own and (len(ns) > 1 or p == own):
            return p
        todo += _children(p)
    return None


class Pids:
    """A worker's PIDs (see the module doc); `how` says how nvml was found."""

    def __init__(self, own, local, nvml, how):
        self.own, self.local, self.nvml, self.how = own, local, nvml, how

    def __str__(self):
        return f"{self.own}→{self.nvml}" if self.own != self.nvml else str(self.own)


def resolve(root, own, nvml_now, nvml_before):
    """The worker's Pids: `root` its Popen PID, `own` what it reported,
    `nvml_now` / `nvml_before` NVML's PIDs now (its context exists) and
    before it started."""
    local = local_pid(root, own)
    if local is not None and local in nvml_now:
        return Pids(own, local, local, "same" if local == own else "NSpid")
    new = set(nvml_now) - set(nvml_before)
    if len(new) == 1:
        return Pids(own, local, new.pop(), "correlated")
    return Pids(own, local, None, f"unknown (NVML lists {sorted(nvml_now)[:8]}, new since start {sorted(new)})")
