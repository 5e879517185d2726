//! The volume config (`--volume-config`), in the original gpu-manager's JSON shape:
//! `{"volume":[{"name","mode","base","components":{"binaries":[...],"libraries":[...]}}]}`.

use std::collections::BTreeSet;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};

/// Name of the volume that gets the interposer in place of libcuda / libnvidia-ml.
pub const SHARED_VOLUME: &str = "nvidia";
/// Name of the volume that keeps the driver untouched (whole-GPU pods).
pub const ORIGIN_VOLUME: &str = "origin";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VolumeConfig {
    pub volume: Vec<Volume>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Volume {
    /// Directory name under the vdriver dir, e.g. `nvidia` or `origin`.
    pub name: String,
    /// Mount mode for containers: `ro` or `rw`.
    pub mode: String,
    /// The vdriver dir the original mirrored into (`/etc/gpu-manager/vdriver`); the manager
    /// may use it as the default for `mirror`'s `vdriver_dir`.
    pub base: String,
    pub components: Components,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Components {
    /// Program names looked up on the host root's PATH directories.
    #[serde(default)]
    pub binaries: Vec<String>,
    /// Library name prefixes matched against ld.so.cache keys (`libcuda.so` matches `libcuda.so.1`).
    #[serde(default)]
    pub libraries: Vec<String>,
}

const TOP_KEYS: &[&str] = &["volume"];
const VOLUME_KEYS: &[&str] = &["name", "mode", "base", "components"];
const COMPONENT_KEYS: &[&str] = &["binaries", "libraries"];

impl VolumeConfig {
    /// Reads and validates the config file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::ConfigRead {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text).map_err(|message| Error::Config {
            path: path.to_owned(),
            message,
        })
    }

    /// Parses and validates config text. The error message names every unknown key with
    /// its place in the document (e.g. `volume[1].components.libs`).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        // serde's deny_unknown_fields stops at the first unknown key; walk the tree first so
        // the operator sees all of them at once.
        let unknown = unknown_keys(&value);
        if !unknown.is_empty() {
            return Err(format!("unknown keys: {}", unknown.join(", ")));
        }
        let config: VolumeConfig = serde_json::from_value(value).map_err(|e| e.to_string())?;
        config.validate()?;
        Ok(config)
    }

    /// Looks a volume up by name.
    pub fn get(&self, name: &str) -> Option<&Volume> {
        self.volume.iter().find(|v| v.name == name)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let mut seen = BTreeSet::new();
        for (i, v) in self.volume.iter().enumerate() {
            let valid_name = !v.name.is_empty()
                && v.name != "."
                && v.name != ".."
                && !v.name.contains('/')
                && !v.name.contains('\0');
            if !valid_name {
                return Err(format!(
                    "volume[{i}].name {:?} must be a plain directory name",
                    v.name
                ));
            }
            if !seen.insert(v.name.as_str()) {
                return Err(format!("volume[{i}].name {:?} appears twice", v.name));
            }
            if v.mode != "ro" && v.mode != "rw" {
                return Err(format!(
                    "volume[{i}].mode {:?} must be \"ro\" or \"rw\"",
                    v.mode
                ));
            }
            let names = v.components.binaries.iter().chain(&v.components.libraries);
            if let Some(bad) = names.into_iter().find(|n| n.is_empty() || n.contains('/')) {
                return Err(format!(
                    "volume[{i}] component {bad:?} must be a bare file name"
                ));
            }
        }
        Ok(())
    }
}

fn unknown_keys(value: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let check = |obj: &serde_json::Map<String, Value>,
                 allowed: &[&str],
                 at: &str,
                 out: &mut Vec<String>| {
        for key in obj.keys().filter(|k| !allowed.contains(&k.as_str())) {
            out.push(if at.is_empty() {
                key.clone()
            } else {
                format!("{at}.{key}")
            });
        }
    };
    let Some(top) = value.as_object() else {
        return out;
    };
    check(top, TOP_KEYS, "", &mut out);
    let Some(vols) = top.get("volume").and_then(Value::as_array) else {
        return out;
    };
    for (i, vol) in vols.iter().enumerate() {
        let Some(vol) = vol.as_object() else { continue };
        let at = format!("volume[{i}]");
        check(vol, VOLUME_KEYS, &at, &mut out);
        if let Some(comp) = vol.get("components").and_then(Value::as_object) {
            check(comp, COMPONENT_KEYS, &format!("{at}.components"), &mut out);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"volume":[
        {"name":"nvidia","mode":"ro","base":"/etc/gpu-manager/vdriver",
         "components":{"binaries":["nvidia-smi"],"libraries":["libcuda.so","libnvidia-ml.so"]}},
        {"name":"origin","mode":"ro","base":"/etc/gpu-manager/vdriver",
         "components":{"libraries":["libcuda.so"]}}]}"#;

    #[test]
    fn parses_original_shape() {
        let c = VolumeConfig::parse(GOOD).unwrap();
        assert_eq!(c.volume.len(), 2);
        assert_eq!(c.get("nvidia").unwrap().components.binaries, ["nvidia-smi"]);
        assert!(c.get("origin").unwrap().components.binaries.is_empty());
    }

    #[test]
    fn shipped_config_parses() {
        let text = include_str!("../../../../config/volume.conf");
        let c = VolumeConfig::parse(text).unwrap();
        let nvidia = c.get(SHARED_VOLUME).unwrap();
        let origin = c.get(ORIGIN_VOLUME).unwrap();
        for v in [nvidia, origin] {
            assert_eq!(v.mode, "ro");
            assert!(v.components.libraries.iter().any(|l| l == "libcuda.so"));
            assert!(
                v.components
                    .libraries
                    .iter()
                    .any(|l| l == "libnvidia-ml.so")
            );
            assert!(v.components.binaries.iter().any(|b| b == "nvidia-smi"));
        }
    }

    #[test]
    fn unknown_keys_are_all_named() {
        let text = r#"{"volume":[{"name":"nvidia","mode":"ro","base":"/x","colour":1,
            "components":{"libraries":[],"libs":[]}}],"extra":true}"#;
        let err = VolumeConfig::parse(text).unwrap_err();
        assert!(err.contains("extra"), "{err}");
        assert!(err.contains("volume[0].colour"), "{err}");
        assert!(err.contains("volume[0].components.libs"), "{err}");
    }

    #[test]
    fn load_error_names_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("volume.conf");
        std::fs::write(&path, r#"{"volumes":[]}"#).unwrap();
        let msg = VolumeConfig::load(&path).unwrap_err().to_string();
        assert!(
            msg.contains("volume.conf") && msg.contains("volumes"),
            "{msg}"
        );
    }

    #[test]
    fn rejects_bad_values() {
        for (text, needle) in [
            (
                r#"{"volume":[{"name":"a/b","mode":"ro","base":"/","components":{}}]}"#,
                "plain directory",
            ),
            (
                r#"{"volume":[{"name":"a","mode":"rx","base":"/","components":{}}]}"#,
                "mode",
            ),
            (
                r#"{"volume":[{"name":"a","mode":"ro","base":"/","components":{}},{"name":"a","mode":"ro","base":"/","components":{}}]}"#,
                "twice",
            ),
            (
                r#"{"volume":[{"name":"a","mode":"ro","components":{}}]}"#,
                "base",
            ),
            (
                r#"{"volume":[{"name":"a","mode":"ro","base":"/","components":{"libraries":["x/y"]}}]}"#,
                "bare",
            ),
            ("{", "JSON"),
        ] {
            let err = VolumeConfig::parse(text).unwrap_err();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }
}
