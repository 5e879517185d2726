//! `--extra-config`: extra device nodes for every container, in the original's
//! format `{"default": {"Devices": ["/dev/..."]}}` (key case-insensitive).

use std::path::Path;

use serde_json::Value;

#[derive(Debug, thiserror::Error)]
#[error("extra config {path}: {problem}")]
pub struct ExtraError {
    path: String,
    problem: String,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ExtraConfig {
    /// Host device paths added (rwm, same path inside) to every container.
    pub devices: Vec<String>,
}

impl ExtraConfig {
    pub fn load(path: &Path) -> Result<ExtraConfig, ExtraError> {
        let err = |problem: String| ExtraError {
            path: path.display().to_string(),
            problem,
        };
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        Self::parse(&text).map_err(err)
    }

    pub fn parse(text: &str) -> Result<ExtraConfig, String> {
        let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let Some(obj) = v.as_object() else {
            return Err("expected an object keyed by \"default\"".into());
        };
        let mut out = ExtraConfig::default();
        if let Some(def) = obj.get("default") {
            let devs = def
                .as_object()
                .and_then(|o| o.iter().find(|(k, _)| k.eq_ignore_ascii_case("devices")))
                .map(|(_, v)| v);
            if let Some(devs) = devs {
                let list = devs.as_array().ok_or("default.devices must be a list")?;
                for d in list {
                    let s = d.as_str().ok_or("default.devices must hold strings")?;
                    if !s.starts_with("/dev/") {
                        return Err(format!("device {s:?} is not under /dev/"));
                    }
                    out.devices.push(s.to_string());
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn original_format() {
        assert_eq!(ExtraConfig::parse("{}").unwrap(), ExtraConfig::default());
        let c =
            ExtraConfig::parse(r#"{"default": {"Devices": ["/dev/nvidia-uvm-tools"]}}"#).unwrap();
        assert_eq!(c.devices, vec!["/dev/nvidia-uvm-tools"]);
        assert!(ExtraConfig::parse(r#"{"default": {"devices": ["/etc/passwd"]}}"#).is_err());
    }
}
