"""Wire compatibility of our device plugins with a non-tonic gRPC client.

grpcio (C core) plays kubelet: the client is generated at test time from
proto/deviceplugin/v1beta1/api.proto and talks to the `demo-plugin` binary
over its unix socket with `:authority: localhost`, as kubelet >= 1.26 does,
and with the socket-path authorities older kubelets and grpcio send.

Needs: pip install grpcio grpcio-tools pytest. Finds demo-plugin in
$VCUDA_TARGET_DIR (default: <repo>/target/debug, see conftest.py) and builds
it with cargo when missing.
"""

import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest
from conftest import target_dir
from grpc_tools import protoc

REPO = pathlib.Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "proto" / "deviceplugin" / "v1beta1"


@pytest.fixture(scope="session")
def api(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen")
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO_DIR / "api.proto"),
        ]
    )
    assert rc == 0, "protoc failed on api.proto"
    sys.path.insert(0, str(out))
    import api_pb2  # noqa: E402
    import api_pb2_grpc  # noqa: E402

    return api_pb2, api_pb2_grpc


def demo_plugin_binary():
    exe = target_dir() / "demo-plugin"
    if not exe.exists():
        subprocess.run(
            ["cargo", "build", "-p", "kubelet-emulator", "--bin", "demo-plugin"],
            cwd=REPO,
            check=True,
        )
    assert exe.exists(), f"{exe} not found; build it with cargo build -p kubelet-emulator"
    return exe


@pytest.fixture(scope="session")
def plugin_socket(tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    sock = d / "demo.sock"
    log = open(d / "plugin.log", "w")
    proc = subprocess.Popen(
        [str(demo_plugin_binary()), "--device-plugin-path", str(d), "--socket", "demo.sock", "--devices", "4"],
        stdout=log,
        stderr=log,
    )
    deadline = time.time() + 10
    while not sock.exists():
        assert proc.poll() is None, f"demo-plugin exited: {(d / 'plugin.log').read_text()}"
        assert time.time() < deadline, "demo-plugin did not create its socket"
        time.sleep(0.05)
    yield sock
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert not sock.exists(), "plugin must remove its socket on SIGTERM"


def kubelet_channel(sock, **extra):
    # kubelet >= 1.26 dials unix sockets with authority "localhost".
    opts = [("grpc.default_authority", "localhost")] + list(extra.items())
    return grpc.insecure_channel(f"unix://{sock}", options=opts)


@pytest.fixture
def stub(api, plugin_socket):
    _, api_grpc = api
    with kubelet_channel(plugin_socket) as ch:
        yield api_grpc.DevicePluginStub(ch)


def test_get_device_plugin_options(api, stub):
    pb, _ = api
    opts = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
    assert opts.pre_start_required
    assert opts.get_preferred_allocation_available


def test_list_and_watch_first_message(api, stub):
    pb, _ = api
    stream = stub.ListAndWatch(pb.Empty(), timeout=5)
    first = next(stream)
    assert [d.ID for d in first.devices] == ["dev-0", "dev-1", "dev-2", "dev-3"]
    assert all(d.health == "Healthy" for d in first.devices)
    stream.cancel()


def test_allocate_and_prestart(api, stub):
    pb, _ = api
    req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["dev-1", "dev-3"])])
    resp = stub.Allocate(req, timeout=5)
    assert len(resp.container_responses) == 1
    c = resp.container_responses[0]
    assert c.envs["DEMO_DEVICES"] == "dev-1,dev-3"
    assert c.devices[0].permissions == "rwm"
    assert c.mounts[0].read_only
    stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=["dev-1", "dev-3"]), timeout=5)


def test_get_preferred_allocation(api, stub):
    pb, _ = api
    req = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=["dev-0", "dev-1", "dev-2"], must_include_deviceIDs=["dev-0"], allocation_size=2
            )
        ]
    )
    resp = stub.GetPreferredAllocation(req, timeout=5)
    assert list(resp.container_responses[0].deviceIDs) == ["dev-0", "dev-2"]


def test_invalid_argument_names_unknown_ids(api, stub):
    pb, _ = api
    req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["dev-0", "bogus-7"])])
    with pytest.raises(grpc.RpcError) as e:
        stub.Allocate(req, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert '"bogus-7"' in e.value.details()
    # Still serving afterwards.
    assert stub.GetDevicePluginOptions(pb.Empty(), timeout=5).pre_start_required


def test_accepts_what_kubelet_sends(api, plugin_socket):
    """grpc-go's user agent, a deadline (grpc-timeout header), compression
    offers and a large message limit, as kubelet's client sets them."""
    pb, api_grpc = api
    with kubelet_channel(
        plugin_socket,
        **{"grpc.primary_user_agent": "grpc-go/1.65.0", "grpc.max_receive_message_length": 16 * 1024 * 1024},
    ) as ch:
        s = api_grpc.DevicePluginStub(ch)
        md = [("grpc-accept-encoding", "gzip")]
        assert s.GetDevicePluginOptions(pb.Empty(), timeout=10, metadata=md).pre_start_required
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["dev-2"])])
        assert s.Allocate(req, timeout=10, metadata=md).container_responses[0].envs["DEMO_DEVICES"] == "dev-2"
        first = next(s.ListAndWatch(pb.Empty(), metadata=md))
        assert len(first.devices) == 4


@pytest.mark.parametrize(
    "authority",
    [
        None,  # grpcio's default for a unix: target (percent-encoded path)
        "PLUGIN_SOCKET",  # grpc-go before kubelet 1.26: the raw socket path
        "%2Fvar%2Flib%2Fkubelet%2Fdevice-plugins%2Fdemo.sock",
        "localhost",  # kubelet >= 1.26
    ],
)
def test_any_authority_is_accepted(api, plugin_socket, authority):
    """kubelet < 1.26 (grpc-go) sent the socket path as :authority, and
    grpcio sends a percent-encoded path by default. h2 alone resets such a
    stream with PROTOCOL_ERROR; the plugins' sockets rewrite it (crate
    uds-authority), so every one of them is served, unary and streaming."""
    pb, api_grpc = api
    opts = []
    if authority is not None:
        value = str(plugin_socket) if authority == "PLUGIN_SOCKET" else authority
        opts = [("grpc.default_authority", value)]
    with grpc.insecure_channel(f"unix://{plugin_socket}", options=opts) as ch:
        s = api_grpc.DevicePluginStub(ch)
        assert s.GetDevicePluginOptions(pb.Empty(), timeout=5).pre_start_required
        first = next(s.ListAndWatch(pb.Empty(), timeout=5))
        assert len(first.devices) == 4
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=["dev-1"])])
        assert s.Allocate(req, timeout=5).container_responses[0].envs["DEMO_DEVICES"] == "dev-1"
