//! Opaque per-claim (or per-class) parameters for vcuda devices, the
//! equivalent of the device-plugin mode's `tencent.com/vcuda-core-limit`:
//!
//! ```yaml
//! config:
//! - opaque:
//!     driver: vcuda.tencent.com
//!     parameters: {apiVersion: vcuda.tencent.com/v1alpha1, kind: GpuConfig, coreLimit: 60}
//! ```
//!
//! `coreLimit` makes the compute limit soft: the share may burst up to it
//! while the GPU is otherwise idle. `tier: latency | batch | plain` is the
//! share's compute tier (docs/qos.md; the device-plugin mode's
//! `tencent.com/vcuda-tier`). `exclusive: true` (set by the whole-GPU
//! DeviceClass) asks for the untouched driver and refuses partial shares.

use qos_page::Tier;
use serde::Deserialize;

use gpu_pods::dra::{CONFIG_API_VERSION, CONFIG_KIND};

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuConfig {
    pub api_version: String,
    pub kind: String,
    #[serde(default)]
    pub core_limit: Option<u32>,
    #[serde(default)]
    pub exclusive: Option<bool>,
    #[serde(default)]
    pub tier: Option<String>,
    /// Memory the share may borrow up to, above its capacity (a quantity:
    /// `12Gi`); docs/qos.md, "Memory".
    #[serde(default)]
    pub memory_limit: Option<String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ParamsError {
    #[error("opaque parameters for {driver}: {problem}")]
    Invalid {
        driver: &'static str,
        problem: String,
    },
}

fn invalid(problem: String) -> ParamsError {
    ParamsError::Invalid {
        driver: crate::DRIVER_NAME,
        problem,
    }
}

impl GpuConfig {
    pub fn parse(v: &serde_json::Value) -> Result<GpuConfig, ParamsError> {
        let c: GpuConfig = serde_json::from_value(v.clone()).map_err(|e| invalid(e.to_string()))?;
        if c.api_version != CONFIG_API_VERSION || c.kind != CONFIG_KIND {
            return Err(invalid(format!(
                "apiVersion/kind {}/{} is not {CONFIG_API_VERSION}/{CONFIG_KIND}",
                c.api_version, c.kind
            )));
        }
        if let Some(l) = c.core_limit
            && !(1..=100).contains(&l)
        {
            return Err(invalid(format!("coreLimit {l} is not within 1..=100")));
        }
        if let Some(t) = &c.tier {
            Tier::parse(t).map_err(|e| invalid(e.to_string()))?;
        }
        c.memory_limit()?;
        Ok(c)
    }

    /// The memory limit in bytes, if it names one.
    pub fn memory_limit(&self) -> Result<Option<u64>, ParamsError> {
        self.memory_limit
            .as_deref()
            .map(|q| {
                crate::quantity::parse(q).map_err(|e| invalid(format!("memoryLimit {q:?}: {e}")))
            })
            .transpose()
    }

    /// The tier it names (checked by [`GpuConfig::parse`]), plain if none.
    pub fn tier(&self) -> Tier {
        self.tier
            .as_deref()
            .and_then(|t| Tier::parse(t).ok())
            .unwrap_or_default()
    }

    /// `other` (later: the claim's over the class's) wins where it says something.
    pub fn merge(self, other: GpuConfig) -> GpuConfig {
        GpuConfig {
            core_limit: other.core_limit.or(self.core_limit),
            exclusive: other.exclusive.or(self.exclusive),
            tier: other.tier.or(self.tier),
            memory_limit: other.memory_limit.or(self.memory_limit),
            ..other
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parse_and_refuse() {
        let ok = json!({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "coreLimit": 60});
        assert_eq!(GpuConfig::parse(&ok).unwrap().core_limit, Some(60));
        let e = GpuConfig::parse(
            &json!({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "corelimit": 60}),
        )
        .unwrap_err();
        assert!(e.to_string().contains("unknown field `corelimit`"), "{e}");
        let e = GpuConfig::parse(
            &json!({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "coreLimit": 150}),
        )
        .unwrap_err();
        assert!(e.to_string().contains("coreLimit 150"), "{e}");
        let e = GpuConfig::parse(&json!({"apiVersion": "v1", "kind": CONFIG_KIND})).unwrap_err();
        assert!(
            e.to_string()
                .contains("is not vcuda.tencent.com/v1alpha1/GpuConfig"),
            "{e}"
        );
        let class = GpuConfig::parse(
            &json!({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "exclusive": true}),
        )
        .unwrap();
        let merged = class.merge(GpuConfig::parse(&ok).unwrap());
        assert_eq!(
            (merged.exclusive, merged.core_limit),
            (Some(true), Some(60))
        );
    }

    #[test]
    fn a_memory_limit_is_a_quantity() {
        let with = |q: &str| json!({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "memoryLimit": q});
        let c = GpuConfig::parse(&with("12Gi")).unwrap();
        assert_eq!(c.memory_limit().unwrap(), Some(12 << 30));
        let e = GpuConfig::parse(&with("lots")).unwrap_err().to_string();
        assert!(e.contains("memoryLimit \"lots\""), "{e}");
    }

    #[test]
    fn a_tier_is_one_of_three_and_the_claims_wins() {
        let with =
            |t: &str| json!({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND, "tier": t});
        let latency = GpuConfig::parse(&with("latency")).unwrap();
        assert_eq!(latency.tier(), Tier::Latency);
        let e = GpuConfig::parse(&with("gold")).unwrap_err().to_string();
        assert!(
            e.contains("unknown QoS tier \"gold\": expected latency, batch or plain"),
            "{e}"
        );
        let class = GpuConfig::parse(&with("batch")).unwrap();
        assert_eq!(class.clone().merge(latency).tier(), Tier::Latency);
        let none =
            GpuConfig::parse(&json!({"apiVersion": CONFIG_API_VERSION, "kind": CONFIG_KIND}))
                .unwrap();
        assert_eq!(
            class.merge(none).tier(),
            Tier::Batch,
            "the class's when the claim says none"
        );
    }
}
