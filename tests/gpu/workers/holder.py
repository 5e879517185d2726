"""Holds BYTES of device memory (cuMemAlloc) until stdin closes: a
container's process, or with the real driver an outsider, for the
nvidia-smi case.  usage: holder.py BYTES"""

import os
import sys

import cudrv
import proto


def run():
    d = cudrv.Driver()
    r, _p = d.alloc(int(sys.argv[1]))
    if r:
        raise cudrv.CudaError("cuMemAlloc_v2", r)
    proto.ready(pid=os.getpid())
    proto.say(result={"held": int(sys.argv[1])})
    proto.hold()


if __name__ == "__main__":
    proto.main(run)
