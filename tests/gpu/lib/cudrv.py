"""ctypes bindings for the few CUDA driver and NVML calls the suite needs.

ctypes rather than cuda-bindings/pynvml: the driver-level cases and the
harness's NVML sampler then need nothing beyond the Python standard library,
on the GPU machine and on the simulated node alike. `Driver()` loads
`libcuda.so.1` by name, so inside the share it is the interposer; `Nvml(path)`
is given the real (origin) library explicitly by the harness.
"""

import ctypes
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_uint, c_uint64, c_ulonglong, c_void_p, c_size_t

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_READY = 600
NVML_SUCCESS = 0
# NVML's "not available" for a process's used memory (e.g. no PID namespace access).
NVML_VALUE_NOT_AVAILABLE = (1 << 64) - 1


class CudaError(RuntimeError):
    def __init__(self, call, code):
        super().__init__(f"{call} failed: CUresult {code}")
        self.call, self.code = call, code


# name: (argtypes); every driver entry point returns CUresult (int).
_CU = {
    "cuInit": [c_uint],
    "cuDeviceGet": [POINTER(c_int), c_int],
    "cuDeviceGetAttribute": [POINTER(c_int), c_int, c_int],
    "cuCtxCreate_v2": [POINTER(c_void_p), c_uint, c_int],
    "cuMemAlloc_v2": [POINTER(c_uint64), c_size_t],
    "cuMemFree_v2": [c_uint64],
    "cuMemGetInfo_v2": [POINTER(c_size_t), POINTER(c_size_t)],
    "cuDeviceTotalMem_v2": [POINTER(c_size_t), c_int],
    "cuStreamCreate": [POINTER(c_void_p), c_uint],
    "cuStreamSynchronize": [c_void_p],
    "cuMemAllocAsync": [POINTER(c_uint64), c_size_t, c_void_p],
    "cuMemFreeAsync": [c_uint64, c_void_p],
    "cuModuleLoadData": [POINTER(c_void_p), c_char_p],
    "cuModuleGetFunction": [POINTER(c_void_p), c_void_p, c_char_p],
    "cuLaunchKernel": [c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                       POINTER(c_void_p), POINTER(c_void_p)],
    "cuEventCreate": [POINTER(c_void_p), c_uint],
    "cuEventRecord": [c_void_p, c_void_p],
    "cuEventSynchronize": [c_void_p],
    "cuEventElapsedTime": [POINTER(c_float), c_void_p, c_void_p],
}


class Driver:
    """A context on device 0 of `libcuda.so.1` (whatever LD_LIBRARY_PATH finds)."""

    def __init__(self, path="libcuda.so.1"):
        self.lib = ctypes.CDLL(path)
        self.fn = {}
        for name, args in _CU.items():
            f = getattr(self.lib, name)
            f.argtypes, f.restype = args, c_int
            self.fn[name] = f
        self.ok("cuInit", 0)
        dev = c_int()
        self.ok("cuDeviceGet", byref(dev), 0)
        self.dev = dev.value
        ctx = c_void_p()
        self.ok("cuCtxCreate_v2", byref(ctx), 0, self.dev)
        self.ctx = ctx

    def call(self, name, *args):
        return self.fn[name](*args)

    def ok(self, name, *args):
        r = self.fn[name](*args)
        if r != CUDA_SUCCESS:
            raise CudaError(name, r)

    def attribute(self, attr):
        v = c_int()
        self.ok("cuDeviceGetAttribute", byref(v), attr, self.dev)
        return v.value

    def mem_get_info(self):
        free, total = c_size_t(), c_size_t()
        self.ok("cuMemGetInfo_v2", byref(free), byref(total))
        return free.value, total.value

    def device_total(self):
        t = c_size_t()
        self.ok("cuDeviceTotalMem_v2", byref(t), self.dev)
        return t.value

    def alloc(self, size):
        """(CUresult, pointer)."""
        p = c_uint64()
        return self.fn["cuMemAlloc_v2"](byref(p), size), p.value

    def free(self, p):
        self.ok("cuMemFree_v2", p)

    def stream(self):
        s = c_void_p()
        self.ok("cuStreamCreate", byref(s), 0)
        return s

    def alloc_async(self, size, stream):
        p = c_uint64()
        return self.fn["cuMemAllocAsync"](byref(p), size, stream), p.value

    def free_async(self, p, stream):
        self.ok("cuMemFreeAsync", p, stream)

    def function(self, image: bytes, name: str):
        m = c_void_p()
        self.ok("cuModuleLoadData", byref(m), image)
        f = c_void_p()
        self.ok("cuModuleGetFunction", byref(f), m, name.encode())
        return f

    def event(self):
        e = c_void_p()
        self.ok("cuEventCreate", byref(e), 0)
        return e

    def elapsed_ms(self, a, b):
        ms = c_float()
        self.ok("cuEventElapsedTime", byref(ms), a, b)
        return ms.value


class ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_v2_t / _v3: pid, usedGpuMemory, gpuInstanceId, computeInstanceId.
    _fields_ = [("pid", c_uint), ("usedGpuMemory", c_ulonglong), ("gpuInstanceId", c_uint),
                ("computeInstanceId", c_uint)]


class Memory(ctypes.Structure):
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class PciInfo(ctypes.Structure):
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", c_uint), ("bus", c_uint),
                ("device", c_uint), ("pciDeviceId", c_uint), ("pciSubSystemId", c_uint),
                ("busId", ctypes.c_char * 32)]


class Nvml:
    """NVML of the library at `path`, GPU index 0."""

    def __init__(self, path="libnvidia-ml.so.1"):
        self.lib = ctypes.CDLL(path)
        self._ok("nvmlInit_v2")
        h = c_void_p()
        self._ok("nvmlDeviceGetHandleByIndex_v2", c_uint(0), byref(h))
        self.h = h

    def _ok(self, name, *args):
        r = getattr(self.lib, name)(*args)
        if r != NVML_SUCCESS:
            raise RuntimeError(f"{name} failed: nvmlReturn_t {r}")

    def processes(self):
        """{pid: used bytes or None when NVML does not know}."""
        n = c_uint(256)
        arr = (ProcessInfo * 256)()
        self._ok("nvmlDeviceGetComputeRunningProcesses_v3", self.h, byref(n), arr)
        out = {}
        for p in arr[: n.value]:
            used = p.usedGpuMemory
            out[p.pid] = None if used == NVML_VALUE_NOT_AVAILABLE else used
        return out

    def memory(self):
        m = Memory()
        self._ok("nvmlDeviceGetMemoryInfo", self.h, byref(m))
        return m.total, m.used

    def bus_id(self):
        """The 4-digit-domain form vcuda.config's 16-byte field holds."""
        p = PciInfo()
        self._ok("nvmlDeviceGetPciInfo_v3", self.h, byref(p))
        dom, bus, devfn = p.busId.decode().split(":")
        return f"{int(dom, 16) & 0xffff:04x}:{bus.lower()}:{devfn.lower()}"

    def compute_capability(self):
        major, minor = c_int(), c_int()
        self._ok("nvmlDeviceGetCudaComputeCapability", self.h, byref(major), byref(minor))
        return major.value, minor.value
