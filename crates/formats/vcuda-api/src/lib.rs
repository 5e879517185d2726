//! Protobuf and gRPC types for every wire contract vcuda speaks.
//!
//! * [`deviceplugin::v1beta1`]: kubelet's device-plugin API (we serve
//!   `DevicePlugin`, kubelet serves `Registration`).
//! * [`podresources::v1`]: kubelet's pod-resources API.
//! * [`display`]: the operator display service `display.GPUDisplay`.
//! * [`vcuda`]: messages of the interposer -> manager registration, framed
//!   by [`vcuda::frame`].

#[cfg(feature = "grpc")]
pub mod deviceplugin {
    pub mod v1beta1 {
        tonic::include_proto!("v1beta1");

        /// API version string sent in `RegisterRequest.version`.
        pub const VERSION: &str = "v1beta1";
        /// Value of `Device.health` for a usable device.
        pub const HEALTHY: &str = "Healthy";
        /// Value of `Device.health` for an unusable device.
        pub const UNHEALTHY: &str = "Unhealthy";
        /// Socket kubelet serves `Registration` on, inside the device-plugin dir.
        pub const KUBELET_SOCKET: &str = "kubelet.sock";
        /// Default device-plugin dir of kubelet.
        pub const DEVICE_PLUGIN_PATH: &str = "/var/lib/kubelet/device-plugins";
    }
}

#[cfg(feature = "grpc")]
pub mod podresources {
    pub mod v1 {
        tonic::include_proto!("v1");

        /// Default socket of kubelet's pod-resources API.
        pub const DEFAULT_SOCKET: &str = "/var/lib/kubelet/pod-resources/kubelet.sock";
    }
}

#[cfg(feature = "grpc")]
pub mod display {
    tonic::include_proto!("display");
}

/// Always built (no tonic): the generated code has messages only.
pub mod vcuda {
    include!(concat!(env!("OUT_DIR"), "/vcuda.rs"));

    /// Length-prefixed framing of the registration protocol: a 4-byte
    /// big-endian length, then the protobuf bytes.
    pub mod frame {
        use prost::Message;
        use std::io::{self, Read, Write};

        /// Largest frame either side accepts.
        pub const MAX_FRAME: usize = 64 * 1024;
        /// Protocol version of a one-GPU container (one ledger).
        pub const PROTOCOL_VERSION: u32 = 1;
        /// Protocol version of a container whose share spans several GPUs:
        /// one ledger (and slot) per GPU, in record order.
        pub const PROTOCOL_VERSION_MULTI_GPU: u32 = 2;

        pub fn write<M: Message>(w: &mut impl Write, msg: &M) -> io::Result<()> {
            w.write_all(&encode(msg)?)
        }

        /// The whole frame of `msg` (length and body), for a writer of
        /// its own (a raw descriptor, an async stream).
        pub fn encode<M: Message>(msg: &M) -> io::Result<Vec<u8>> {
            let body = msg.encode_to_vec();
            if body.len() > MAX_FRAME {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("frame of {} bytes exceeds {MAX_FRAME}", body.len()),
                ));
            }
            let mut buf = Vec::with_capacity(4 + body.len());
            buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
            buf.extend_from_slice(&body);
            Ok(buf)
        }

        pub fn read<M: Message + Default>(r: &mut impl Read) -> io::Result<M> {
            let body = read_body(r)?;
            M::decode(body.as_slice())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("bad frame: {e}")))
        }

        /// One frame's body, undecoded (a reader that tells a frame it
        /// cannot decode from a broken stream).
        pub fn read_body(r: &mut impl Read) -> io::Result<Vec<u8>> {
            let mut len = [0u8; 4];
            r.read_exact(&mut len)?;
            let len = u32::from_be_bytes(len) as usize;
            if len > MAX_FRAME {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("frame of {len} bytes exceeds {MAX_FRAME}"),
                ));
            }
            let mut body = vec![0u8; len];
            r.read_exact(&mut body)?;
            Ok(body)
        }

        #[cfg(test)]
        mod tests {
            use super::*;
            use crate::vcuda::RegisterRequest;

            #[test]
            fn round_trip() {
                let req = RegisterRequest {
                    protocol_version: PROTOCOL_VERSION,
                    pod_uid: "uid-1".into(),
                    container_name: "c".into(),
                    bus_id: "00000000:3B:00.0".into(),
                    local_pid: 7,
                    program: "train".into(),
                    previous_slot: Some(3),
                    previous_slots: vec![3, 5],
                    qos_pages: true,
                    qos_flags: true,
                };
                let mut buf = Vec::new();
                write(&mut buf, &req).unwrap();
                assert_eq!(
                    u32::from_be_bytes(buf[..4].try_into().unwrap()) as usize,
                    buf.len() - 4
                );
                let back: RegisterRequest = read(&mut buf.as_slice()).unwrap();
                assert_eq!(back, req);
            }

            #[test]
            fn oversize_frame_is_refused() {
                let mut buf = ((MAX_FRAME as u32) + 1).to_be_bytes().to_vec();
                buf.extend(std::iter::repeat_n(0u8, 16));
                let err = read::<RegisterRequest>(&mut buf.as_slice()).unwrap_err();
                assert_eq!(err.kind(), io::ErrorKind::InvalidData);
                assert!(err.to_string().contains("exceeds"));
            }

            #[test]
            fn truncated_frame_is_an_error() {
                let buf = 10u32.to_be_bytes().to_vec();
                assert!(read::<RegisterRequest>(&mut buf.as_slice()).is_err());
            }
        }
    }
}
