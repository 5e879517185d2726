//! The kubelet's gRPC contracts for a DRA driver.
//!
//! * [`dra::v1`], [`dra::v1beta1`]: `DRAPlugin` (NodePrepareResources,
//!   NodeUnprepareResources), served by the driver. Kubelets from 1.34 call
//!   v1; older ones v1beta1. The messages are the same apart from
//!   `Device.share_id` (v1 only).
//! * [`dra_health`]: `DRAResourceHealth` (NodeWatchResources), the
//!   devices' health streamed to kubelets with `ResourceHealthStatus`: v1
//!   (kubelets from 1.37, which open it only when the registration lists
//!   it) and v1alpha1 (1.31-1.36, which open it unasked).
//! * [`pluginregistration`]: `Registration` (GetInfo,
//!   NotifyRegistrationStatus), served by the driver on a socket in the
//!   kubelet's `plugins_registry` directory.

pub mod dra {
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");

        /// The service name listed in `PluginInfo.supported_versions`.
        pub const SERVICE: &str = "v1.DRAPlugin";
    }
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");

        /// The service name listed in `PluginInfo.supported_versions`.
        pub const SERVICE: &str = "v1beta1.DRAPlugin";
    }
}

pub mod dra_health {
    pub mod v1 {
        tonic::include_proto!("v1");

        /// The service name listed in `PluginInfo.supported_versions`.
        pub const SERVICE: &str = "v1.DRAResourceHealth";
    }
    pub mod v1alpha1 {
        tonic::include_proto!("v1alpha1");

        /// The service name listed in `PluginInfo.supported_versions`.
        pub const SERVICE: &str = "v1alpha1.DRAResourceHealth";
    }

    /// A v1 message as v1alpha1 says it: the two versions have the same
    /// fields and numbers, so the bytes of one decode as the other.
    pub fn to_v1alpha1(m: &v1::NodeWatchResourcesResponse) -> v1alpha1::NodeWatchResourcesResponse {
        use prost::Message;
        v1alpha1::NodeWatchResourcesResponse::decode(m.encode_to_vec().as_slice())
            .expect("v1 and v1alpha1 share one wire format")
    }
}

pub mod pluginregistration {
    tonic::include_proto!("pluginregistration");

    /// `PluginInfo.type` of a DRA driver.
    pub const DRA_PLUGIN: &str = "DRAPlugin";
    /// The kubelet's default registration directory.
    pub const REGISTRY_DIR: &str = "/var/lib/kubelet/plugins_registry";
    /// The kubelet's default directory for plugins' own sockets.
    pub const PLUGINS_DIR: &str = "/var/lib/kubelet/plugins";
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// The two health versions carry one message: every field survives
    /// the step from v1 to v1alpha1 (the kubelet's v1 types_test checks
    /// the same of its Go types).
    #[test]
    fn health_v1_reads_as_v1alpha1() {
        use dra_health::{v1, v1alpha1};
        let m = v1::NodeWatchResourcesResponse {
            devices: vec![v1::DeviceHealth {
                device: Some(v1::DeviceIdentifier {
                    pool_name: "node-a".into(),
                    device_name: "gpu-1".into(),
                }),
                health: v1::HealthStatus::Unhealthy as i32,
                last_updated_time: 1_800_000_000,
                health_check_timeout_seconds: 60,
                message: "Xid 79".into(),
            }],
        };
        let old = dra_health::to_v1alpha1(&m);
        let d = &old.devices[0];
        let id = d.device.as_ref().unwrap();
        assert_eq!(
            (id.pool_name.as_str(), id.device_name.as_str()),
            ("node-a", "gpu-1")
        );
        assert_eq!(d.health, v1alpha1::HealthStatus::Unhealthy as i32);
        assert_eq!(
            (d.last_updated_time, d.health_check_timeout_seconds),
            (1_800_000_000, 60)
        );
        assert_eq!(d.message, "Xid 79");
        assert_eq!(old.encode_to_vec(), m.encode_to_vec());
    }

    /// Field numbers as the kubelet has them: a `Device` encoded by hand
    /// with tags 1..5 decodes into the right fields.
    #[test]
    fn device_field_numbers() {
        let d = dra::v1::Device {
            request_names: vec!["gpu".into()],
            pool_name: "node-a".into(),
            device_name: "gpu-0".into(),
            cdi_device_ids: vec!["vcuda.tencent.com/gpu=x".into()],
            share_id: Some("s".into()),
        };
        let b = d.encode_to_vec();
        // Tag bytes: (field << 3) | 2 for length-delimited.
        for (field, want) in [(1u8, "gpu"), (2, "node-a"), (3, "gpu-0"), (5, "s")] {
            let tag = (field << 3) | 2;
            let at = b.iter().position(|&x| x == tag).unwrap();
            assert_eq!(
                &b[at + 2..at + 2 + want.len()],
                want.as_bytes(),
                "field {field}"
            );
        }
        // v1beta1 has no field 5: it is skipped, the rest decodes.
        let old = dra::v1beta1::Device::decode(b.as_slice()).unwrap();
        assert_eq!(old.device_name, "gpu-0");
        assert_eq!(old.cdi_device_ids, d.cdi_device_ids);
    }
}
