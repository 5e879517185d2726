"""CUDA graphs and stream capture through NVIDIA's cuda-bindings against the
simulated driver: every entry point is resolved through cuGetProcAddress_v2
with the bindings' own versions (cuGraphInstantiate -> WithFlags,
cuStreamGetCaptureInfo -> _v3, ...), so this checks the names and struct
layouts a real client uses."""

from test_cuda_bindings import client


def test_capture_instantiate_launch(sim_root):
    out = client(
        sim_root,
        """
        ok(d.cuInit(0))
        dev = ok(d.cuDeviceGet(0))
        ctx = ok(d.cuCtxCreate(None, 0, dev))
        mod = ok(d.cuModuleLoadData(b"not a real cubin"))
        f = ok(d.cuModuleGetFunction(mod, b"kernel"))
        s = ok(d.cuStreamCreate(0))
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
        ok(d.cuInit(0))
        ctx = ok(d.cuCtxCreate(None, 0, ok(d.cuDeviceGet(0))))
        mod = ok(d.cuModuleLoadData(b"not a real cubin"))
        f = ok(d.cuModuleGetFunction(mod, b"kernel"))
        s = ok(d.cuStreamCreate(0))
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
