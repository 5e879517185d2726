"""CUDA graphs and stream capture through NVIDIA's cuda-bindings against the
simulated driver: every entry point is resolved through cuGetProcAddress_v2
with the bindings' own versions (cuGraphInstantiate -> WithFlags,
cuStreamGetCaptureInfo -> _v3, ...), so this checks the names and struct
layouts a real client uses. The last test runs under the interposer
(test_shim_clients.py's node and stand-in manager, a 4 GiB quota)."""

from test_cuda_bindings import client
from test_shim_clients import GIB, shim_client, shim_node  # noqa: F401 (fixture)


def test_capture_instantiate_launch(sim_root):
    out = client(
        sim_root,
        """
        dev, ctx, f, s = kernel_setup()
        ok(d.cuStreamBeginCapture(s, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        capturing = int(ok(d.cuStreamIsCapturing(s)))
        info = d.cuStreamGetCaptureInfo(s)
        for _ in range(5):  # 1 ms each on the sim's A100
            ok(d.cuLaunchKernel(f, 86400, 1, 1, 256, 1, 1, 0, s, 0, 0))
        p = ok(d.cuMemAllocAsync(8 << 20, s))
        ok(d.cuMemFreeAsync(p, s))
        g = ok(d.cuStreamEndCapture(s))
        nodes, n = ok(d.cuGraphGetNodes(g, 16))
        types = sorted(int(ok(d.cuGraphNodeGetType(x))) for x in nodes[:n])
        kp = ok(d.cuGraphKernelNodeGetParams(nodes[0]))
        e = ok(d.cuGraphInstantiate(g, 0))
        a, b = ok(d.cuEventCreate(0)), ok(d.cuEventCreate(0))
        ok(d.cuEventRecord(a, s))
        ok(d.cuGraphLaunch(e, s))
        ok(d.cuEventRecord(b, s))
        ok(d.cuEventSynchronize(b))
        ms = ok(d.cuEventElapsedTime(a, b))
        A = d.CUgraphMem_attribute
        reserved = int(ok(d.cuDeviceGetGraphMemAttribute(dev, A.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)))
        ok(d.cuGraphExecDestroy(e))
        ok(d.cuDeviceGraphMemTrim(dev))
        trimmed = int(ok(d.cuDeviceGetGraphMemAttribute(dev, A.CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT)))
        ok(d.cuGraphDestroy(g))
        print(json.dumps({
            "capturing": capturing,
            "info_status": int(info[1]),
            "after": int(ok(d.cuStreamIsCapturing(s))),
            "types": types,
            "grid": kp.gridDimX,
            "ms": ms,
            "reserved": reserved,
            "trimmed": trimmed,
        }))
        """,
    )
    assert out["capturing"] == 1 and out["info_status"] == 1
    assert out["after"] == 0
    # five kernels (0), one mem alloc (10) and one mem free (11) node
    assert out["types"] == [0, 0, 0, 0, 0, 10, 11]
    assert out["grid"] == 86400
    assert out["ms"] >= 5.0
    assert out["reserved"] == 8 << 20
    assert out["trimmed"] == 0


def test_explicit_kernel_nodes_and_update(sim_root):
    out = client(
        sim_root,
        """
        dev, ctx, f, s = kernel_setup()
        def kernel(grid):
            p = d.CUDA_KERNEL_NODE_PARAMS()
            p.func = f
            p.gridDimX, p.gridDimY, p.gridDimZ = grid, 1, 1
            p.blockDimX, p.blockDimY, p.blockDimZ = 256, 1, 1
            return p
        g = ok(d.cuGraphCreate(0))
        n1 = ok(d.cuGraphAddKernelNode(g, None, 0, kernel(86400)))
        n2 = ok(d.cuGraphAddKernelNode(g, [n1], 1, kernel(86400)))
        e = ok(d.cuGraphInstantiate(g, 0))
        def timed():
            a, b = ok(d.cuEventCreate(0)), ok(d.cuEventCreate(0))
            ok(d.cuEventRecord(a, s))
            ok(d.cuGraphLaunch(e, s))
            ok(d.cuEventRecord(b, s))
            ok(d.cuEventSynchronize(b))
            return ok(d.cuEventElapsedTime(a, b))
        before = timed()
        # 10x the blocks on the second node: 1 ms + 10 ms.
        ok(d.cuGraphExecKernelNodeSetParams(e, n2, kernel(864000)))
        after = timed()
        print(json.dumps({"before": before, "after": after}))
        """,
    )
    assert 2.0 <= out["before"] < 10.0
    assert out["after"] >= 11.0


def test_graph_memory_is_held_to_the_quota_under_the_interposer(shim_node):
    out = shim_client(
        shim_node,
        """
        ok(d.cuInit(0))
        dev = ok(d.cuDeviceGet(0))
        ctx = ok(d.cuCtxCreate(None, 0, dev))
        s = ok(d.cuStreamCreate(0))
        def alloc_graph(nbytes):
            g = ok(d.cuGraphCreate(0))
            p = d.CUDA_MEM_ALLOC_NODE_PARAMS()
            p.poolProps.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            p.poolProps.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            p.poolProps.location.id = 0
            p.bytesize = nbytes
            ok(d.cuGraphAddMemAllocNode(g, None, 0, p))
            return g
        free0 = ok(d.cuMemGetInfo())[0]
        big = int(d.cuGraphInstantiate(alloc_graph(5 << 30), 0)[0])
        e = ok(d.cuGraphInstantiate(alloc_graph(1 << 30), 0))
        ok(d.cuGraphLaunch(e, s))
        ok(d.cuStreamSynchronize(s))
        free1 = ok(d.cuMemGetInfo())[0]
        ok(d.cuGraphExecDestroy(e))
        ok(d.cuDeviceGraphMemTrim(dev))
        free2 = ok(d.cuMemGetInfo())[0]
        print(json.dumps({"big": big, "held": free0 - free1, "after_trim": free0 - free2}))
        """,
    )
    assert out["big"] == 2  # CUDA_ERROR_OUT_OF_MEMORY: 5 GiB over a 4 GiB quota
    assert out["held"] == GIB
    assert out["after_trim"] == 0
