"""What the real NVML's per-process utilisation samples look like while
several processes share the GPU (the interposer's compute feedback,
cuda-shim/src/throttle/sampler.rs, groups them by timestamp): every
`--every` seconds for `--seconds`, each new `nvmlDeviceGetProcessUtilization`
sample as `t=<monotonic s> pid=<pid> ts=<sample us> sm=<%> mem=<%>`, and the
device's `nvmlDeviceGetUtilizationRates` as `t=... device gpu=<%>`.

    python3 tests/gpu/probes/nvml_util.py --seconds 60 > nvml.log &
"""

import argparse
import ctypes
import time
from ctypes import byref, c_uint, c_ulonglong, c_void_p


class Sample(ctypes.Structure):
    _fields_ = [("pid", c_uint), ("timeStamp", c_ulonglong), ("smUtil", c_uint), ("memUtil", c_uint),
                ("encUtil", c_uint), ("decUtil", c_uint)]


class Rates(ctypes.Structure):
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--every", type=float, default=0.05)
    ap.add_argument("--lib", default="libnvidia-ml.so.1")
    a = ap.parse_args()
    nvml = ctypes.CDLL(a.lib)
    assert nvml.nvmlInit_v2() == 0, "nvmlInit_v2"
    h = c_void_p()
    assert nvml.nvmlDeviceGetHandleByIndex_v2(c_uint(0), byref(h)) == 0, "handle"
    last, end = 0, time.monotonic() + a.seconds
    buf = (Sample * 256)()
    while time.monotonic() < end:
        n = c_uint(256)
        r = nvml.nvmlDeviceGetProcessUtilization(h, buf, byref(n), c_ulonglong(last))
        now = time.monotonic()
        if r == 0:
            for s in sorted(buf[: n.value], key=lambda s: s.timeStamp):
                if s.timeStamp > last:
                    print(f"t={now:.3f} pid={s.pid} ts={s.timeStamp} sm={s.smUtil} mem={s.memUtil}")
            last = max([last] + [s.timeStamp for s in buf[: n.value]])
        elif r != 6:  # NOT_FOUND: no new samples
            print(f"t={now:.3f} error={r}")
        rates = Rates()
        if nvml.nvmlDeviceGetUtilizationRates(h, byref(rates)) == 0:
            print(f"t={now:.3f} device gpu={rates.gpu}")
        print(end="", flush=True)
        time.sleep(a.every)


if __name__ == "__main__":
    main()
