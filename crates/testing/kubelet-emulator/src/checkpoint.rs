//! kubelet's device-manager checkpoint (`kubelet_internal_checkpoint`), in the
//! JSON layout of current kubelets, with kubelet's checksum.
//!
//! kubelet computes `Checksum` as FNV-1a 32 (widened to uint64) over
//! `spew.Sprintf("%#v", data)` with `SortKeys`, `DisablePointerAddresses`,
//! `DisableCapacities`, `DisableMethods`, `SpewKeys` (k8s.io/utils/dump
//! `ForHash`). [`spew_dump`] reproduces that rendering for exactly this type.

use std::collections::BTreeMap;
use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use serde::{Deserialize, Serialize};

/// Device IDs of one allocation per NUMA node (`-1`: no topology).
pub type DevicesPerNuma = BTreeMap<i64, Vec<String>>;

/// One `PodDevicesEntry` of kubelet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodDevicesEntry {
    pub pod_uid: String,
    pub container_name: String,
    pub resource_name: String,
    pub device_ids: DevicesPerNuma,
    /// Protobuf bytes of the plugin's `ContainerAllocateResponse`.
    pub alloc_resp: Vec<u8>,
}

/// Checkpoint content (kubelet's `checkpointData`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckpointData {
    pub pod_device_entries: Vec<PodDevicesEntry>,
    pub registered_devices: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("reading checkpoint {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing checkpoint {path}: {reason}")]
    Parse { path: String, reason: String },
    #[error("checkpoint {path} is corrupt: checksum {found} != computed {computed}")]
    Checksum {
        path: String,
        found: u64,
        computed: u64,
    },
}

// JSON shapes, field names exactly as Go's encoding/json writes them.
#[derive(Serialize, Deserialize)]
struct JsonEntry {
    #[serde(rename = "PodUID")]
    pod_uid: String,
    #[serde(rename = "ContainerName")]
    container_name: String,
    #[serde(rename = "ResourceName")]
    resource_name: String,
    /// Go writes map[int64] keys as decimal strings.
    #[serde(rename = "DeviceIDs")]
    device_ids: Option<BTreeMap<String, Vec<String>>>,
    /// []byte is base64 in Go's JSON.
    #[serde(rename = "AllocResp")]
    alloc_resp: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct JsonData {
    #[serde(rename = "PodDeviceEntries")]
    pod_device_entries: Option<Vec<JsonEntry>>,
    #[serde(rename = "RegisteredDevices")]
    registered_devices: Option<BTreeMap<String, Vec<String>>>,
}

#[derive(Serialize, Deserialize)]
struct JsonFile {
    #[serde(rename = "Data")]
    data: JsonData,
    #[serde(rename = "Checksum")]
    checksum: u64,
}

impl CheckpointData {
    /// kubelet's checksum of this data.
    pub fn checksum(&self) -> u64 {
        fnv1a32(spew_dump(self).as_bytes()) as u64
    }

    pub fn to_json(&self) -> String {
        let entries: Vec<JsonEntry> = self
            .pod_device_entries
            .iter()
            .map(|e| JsonEntry {
                pod_uid: e.pod_uid.clone(),
                container_name: e.container_name.clone(),
                resource_name: e.resource_name.clone(),
                device_ids: Some(
                    e.device_ids
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.clone()))
                        .collect(),
                ),
                alloc_resp: Some(B64.encode(&e.alloc_resp)),
            })
            .collect();
        let file = JsonFile {
            data: JsonData {
                // kubelet's slice is nil (JSON null) when nothing is allocated.
                pod_device_entries: (!entries.is_empty()).then_some(entries),
                registered_devices: Some(self.registered_devices.clone()),
            },
            checksum: self.checksum(),
        };
        serde_json::to_string(&file).expect("checkpoint serializes")
    }

    pub fn from_json(path: &str, text: &str) -> Result<Self, CheckpointError> {
        let perr = |reason: String| CheckpointError::Parse {
            path: path.to_string(),
            reason,
        };
        let file: JsonFile = serde_json::from_str(text).map_err(|e| perr(e.to_string()))?;
        let mut entries = Vec::new();
        for e in file.data.pod_device_entries.unwrap_or_default() {
            let mut ids = DevicesPerNuma::new();
            for (k, v) in e.device_ids.unwrap_or_default() {
                let numa = k
                    .parse::<i64>()
                    .map_err(|_| perr(format!("NUMA key {k:?} is not an integer")))?;
                ids.insert(numa, v);
            }
            let alloc_resp = B64
                .decode(e.alloc_resp.unwrap_or_default())
                .map_err(|err| {
                    perr(format!(
                        "AllocResp of {}/{}: {err}",
                        e.pod_uid, e.container_name
                    ))
                })?;
            entries.push(PodDevicesEntry {
                pod_uid: e.pod_uid,
                container_name: e.container_name,
                resource_name: e.resource_name,
                device_ids: ids,
                alloc_resp,
            });
        }
        let data = CheckpointData {
            pod_device_entries: entries,
            registered_devices: file.data.registered_devices.unwrap_or_default(),
        };
        let computed = data.checksum();
        if computed != file.checksum {
            return Err(CheckpointError::Checksum {
                path: path.to_string(),
                found: file.checksum,
                computed,
            });
        }
        Ok(data)
    }

    /// Reads `path`; `Ok(None)` when there is no checkpoint.
    pub fn load(path: &Path) -> Result<Option<Self>, CheckpointError> {
        let p = path.display().to_string();
        match std::fs::read_to_string(path) {
            Ok(text) => Self::from_json(&p, &text).map(Some),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(CheckpointError::Io { path: p, source }),
        }
    }

    /// Writes atomically (temp file + fsync + rename), as kubelet does.
    pub fn store(&self, path: &Path) -> Result<(), CheckpointError> {
        use std::io::Write;
        let ioerr = |source| CheckpointError::Io {
            path: path.display().to_string(),
            source,
        };
        // A name of its own per write: concurrent writers never rename
        // each other's half-written file away.
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        let tmp = path.with_file_name(format!(".{name}.tmp.{}.{n}", std::process::id()));
        let r = (|| {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(self.to_json().as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)
        })();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r.map_err(ioerr)
    }
}

/// FNV-1a, 32 bit (Go's `hash/fnv.New32a`).
pub fn fnv1a32(data: &[u8]) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in data {
        h ^= *b as u32;
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

fn spew_strings(out: &mut String, v: &[String]) {
    out.push('[');
    out.push_str(&v.join(" "));
    out.push(']');
}

/// go-spew's `%#v` rendering of kubelet's `checkpoint.checkpointData`:
/// top-level and field values carry their Go type in parentheses, slice
/// elements and map keys/values do not; map keys sorted; nil slices and maps
/// print `<nil>`.
pub fn spew_dump(d: &CheckpointData) -> String {
    let mut s =
        String::from("(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)");
    if d.pod_device_entries.is_empty() {
        s.push_str("<nil>");
    } else {
        s.push('[');
        for (i, e) in d.pod_device_entries.iter().enumerate() {
            if i > 0 {
                s.push(' ');
            }
            s.push_str(&format!(
                "{{PodUID:(string){} ContainerName:(string){} ResourceName:(string){} DeviceIDs:(checkpoint.DevicesPerNUMA)map[",
                e.pod_uid, e.container_name, e.resource_name
            ));
            // BTreeMap<i64> iterates in numeric order, like spew's SortKeys.
            for (j, (numa, ids)) in e.device_ids.iter().enumerate() {
                if j > 0 {
                    s.push(' ');
                }
                s.push_str(&format!("{numa}:"));
                spew_strings(&mut s, ids);
            }
            s.push_str("] AllocResp:([]uint8)[");
            let bytes: Vec<String> = e.alloc_resp.iter().map(u8::to_string).collect();
            s.push_str(&bytes.join(" "));
            s.push_str("]}");
        }
        s.push(']');
    }
    s.push_str(" RegisteredDevices:(map[string][]string)map[");
    for (i, (res, ids)) in d.registered_devices.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(res);
        s.push(':');
        spew_strings(&mut s, ids);
    }
    s.push_str("]}");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CheckpointData {
        CheckpointData {
            pod_device_entries: vec![PodDevicesEntry {
                pod_uid: "uid-1".into(),
                container_name: "c0".into(),
                resource_name: "tencent.com/vcuda-core".into(),
                device_ids: [
                    (-1, vec!["a".to_string()]),
                    (0, vec!["b".to_string(), "c".to_string()]),
                ]
                .into(),
                alloc_resp: vec![10, 3, 1, 2],
            }],
            registered_devices: [(
                "tencent.com/vcuda-core".to_string(),
                vec!["a".to_string(), "b".to_string()],
            )]
            .into(),
        }
    }

    #[test]
    fn fnv_matches_reference_vectors() {
        // Published FNV-1a 32 test vectors.
        assert_eq!(fnv1a32(b""), 0x811c9dc5);
        assert_eq!(fnv1a32(b"a"), 0xe40c292c);
        assert_eq!(fnv1a32(b"foobar"), 0xbf9cf968);
    }

    #[test]
    fn spew_rendering_has_go_shape() {
        let s = spew_dump(&sample());
        assert_eq!(
            s,
            "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)[{PodUID:(string)uid-1 \
             ContainerName:(string)c0 ResourceName:(string)tencent.com/vcuda-core \
             DeviceIDs:(checkpoint.DevicesPerNUMA)map[-1:[a] 0:[b c]] AllocResp:([]uint8)[10 3 1 2]}] \
             RegisteredDevices:(map[string][]string)map[tencent.com/vcuda-core:[a b]]}"
        );
        let empty = spew_dump(&CheckpointData::default());
        assert_eq!(
            empty,
            "(checkpoint.checkpointData){PodDeviceEntries:([]checkpoint.PodDevicesEntry)<nil> \
             RegisteredDevices:(map[string][]string)map[]}"
        );
    }

    #[test]
    fn json_round_trip_and_checksum() {
        let d = sample();
        let j = d.to_json();
        assert!(
            j.starts_with("{\"Data\":{\"PodDeviceEntries\":[{\"PodUID\":\"uid-1\""),
            "{j}"
        );
        assert!(
            j.contains("\"DeviceIDs\":{\"-1\":[\"a\"],\"0\":[\"b\",\"c\"]}"),
            "{j}"
        );
        assert!(j.contains("\"AllocResp\":\"CgMBAg==\""), "{j}");
        assert!(j.contains(&format!("\"Checksum\":{}", d.checksum())), "{j}");
        assert_eq!(CheckpointData::from_json("t", &j).unwrap(), d);
        let tampered = j.replace("uid-1", "uid-2");
        assert!(matches!(
            CheckpointData::from_json("t", &tampered),
            Err(CheckpointError::Checksum { .. })
        ));
    }

    #[test]
    fn empty_checkpoint_writes_null_entries() {
        let j = CheckpointData::default().to_json();
        assert!(
            j.starts_with("{\"Data\":{\"PodDeviceEntries\":null,\"RegisteredDevices\":{}}"),
            "{j}"
        );
        assert_eq!(
            CheckpointData::from_json("t", &j).unwrap(),
            CheckpointData::default()
        );
    }
}
