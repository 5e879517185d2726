//! The sample pods (`config/samples/*.yaml`, real Kubernetes Pod manifests)
//! and the workloads they run (`config/samples/workloads/*.c`).

use crate::DemoError;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

pub const VCORE: &str = "tencent.com/vcuda-core";
pub const VMEM: &str = "tencent.com/vcuda-memory";

/// One pod manifest.
#[derive(Debug, Clone)]
pub struct SamplePod {
    pub file: PathBuf,
    pub name: String,
    pub namespace: String,
    pub containers: Vec<SampleContainer>,
    /// The manifest as JSON, quantities normalised to strings.
    pub object: Value,
}

#[derive(Debug, Clone)]
pub struct SampleContainer {
    pub name: String,
    /// `command` followed by `args`.
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    /// `tencent.com/vcuda-core` limit (0: no GPU).
    pub cores: u64,
    /// `tencent.com/vcuda-memory` limit, in 256 MiB units.
    pub memory_units: u64,
}

fn bad(file: &Path, what: impl std::fmt::Display) -> DemoError {
    DemoError::Setup(format!("sample pod {}: {what}", file.display()))
}

/// Loads every `*.yaml` / `*.yml` in `dir`, in file-name order (the order
/// they are admitted in, which decides placement).
pub fn load(dir: &Path) -> Result<Vec<SamplePod>, DemoError> {
    let entries = std::fs::read_dir(dir).map_err(|source| DemoError::Io {
        what: format!("reading the samples dir {}", dir.display()),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(DemoError::Setup(format!(
            "no pod manifests (*.yaml) in {}",
            dir.display()
        )));
    }
    files.iter().map(|f| load_file(f)).collect()
}

pub fn load_file(file: &Path) -> Result<SamplePod, DemoError> {
    let text = std::fs::read_to_string(file).map_err(|source| DemoError::Io {
        what: format!("reading {}", file.display()),
        source,
    })?;
    let mut object: Value = serde_yaml::from_str(&text).map_err(|e| bad(file, e))?;
    if object["kind"] != "Pod" || object["apiVersion"] != "v1" {
        return Err(bad(file, "not a v1 Pod (apiVersion: v1, kind: Pod)"));
    }
    let name = object["metadata"]["name"]
        .as_str()
        .ok_or_else(|| bad(file, "no metadata.name"))?
        .to_string();
    let namespace = object["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default")
        .to_string();
    object["metadata"]["namespace"] = json!(namespace);
    let Some(cs) = object["spec"]["containers"].as_array_mut() else {
        return Err(bad(file, "no spec.containers"));
    };
    let mut containers = Vec::new();
    for c in cs.iter_mut() {
        let cname = c["name"]
            .as_str()
            .ok_or_else(|| bad(file, "a container without a name"))?
            .to_string();
        // Quantities are strings in the API; YAML lets people write numbers.
        if let Some(limits) = c["resources"]["limits"].as_object_mut() {
            for v in limits.values_mut() {
                if let Some(n) = v.as_u64() {
                    *v = json!(n.to_string());
                }
            }
        }
        let limit = |key: &str| -> Result<u64, DemoError> {
            match &c["resources"]["limits"][key] {
                Value::Null => Ok(0),
                Value::String(s) => s
                    .parse()
                    .map_err(|_| bad(file, format!("{cname}: {key} {s:?} is not a whole number"))),
                v => Err(bad(file, format!("{cname}: {key} {v} is not a quantity"))),
            }
        };
        let cores = limit(VCORE)?;
        let memory_units = limit(VMEM)?;
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        let mut argv = strings(&c["command"]);
        argv.extend(strings(&c["args"]));
        if argv.is_empty() {
            return Err(bad(
                file,
                format!("{cname}: no command (the demo image has no entrypoint)"),
            ));
        }
        let env = c["env"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|e| {
                        Some((
                            e["name"].as_str()?.to_string(),
                            e["value"].as_str().unwrap_or("").to_string(),
                        ))
                    })
                    .collect()
            })
            .unwrap_or_default();
        containers.push(SampleContainer {
            name: cname,
            argv,
            env,
            cores,
            memory_units,
        });
    }
    Ok(SamplePod {
        file: file.to_path_buf(),
        name,
        namespace,
        containers,
        object,
    })
}

/// Compiles every `*.c` of `src_dir` with gcc into `out_dir`; returns the
/// program names.
pub fn compile_workloads(src_dir: &Path, out_dir: &Path) -> Result<Vec<String>, DemoError> {
    let entries = std::fs::read_dir(src_dir).map_err(|source| DemoError::Io {
        what: format!("reading the workloads dir {}", src_dir.display()),
        source,
    })?;
    let mut sources: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "c"))
        .collect();
    sources.sort();
    std::fs::create_dir_all(out_dir).map_err(|source| DemoError::Io {
        what: format!("creating {}", out_dir.display()),
        source,
    })?;
    // Both programs compile at once: two cores, and gcc is most of this step.
    let mut jobs = Vec::new();
    for src in &sources {
        let name = src.file_stem().unwrap().to_string_lossy().into_owned();
        let child = std::process::Command::new("gcc")
            .args(["-O1", "-Wall", "-o"])
            .arg(out_dir.join(&name))
            .arg(src)
            .arg("-ldl")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| {
                DemoError::Setup(format!(
                    "cannot run gcc ({e}): the demo compiles its workloads from {}; install gcc",
                    src_dir.display()
                ))
            })?;
        jobs.push((name, src, child));
    }
    let mut names = Vec::new();
    for (name, src, child) in jobs {
        let out = child.wait_with_output().map_err(|source| DemoError::Io {
            what: format!("waiting for gcc on {}", src.display()),
            source,
        })?;
        if !out.status.success() {
            return Err(DemoError::Setup(format!(
                "gcc failed on {}:\n{}",
                src.display(),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        names.push(name);
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../config/samples")
    }

    #[test]
    fn the_shipped_samples_parse() {
        let pods = load(&samples_dir()).unwrap();
        let got: Vec<(&str, u64, u64)> = pods
            .iter()
            .flat_map(|p| {
                p.containers
                    .iter()
                    .map(move |c| (p.name.as_str(), c.cores, c.memory_units))
            })
            .collect();
        assert_eq!(
            got,
            [
                ("share-30", 30, 8),
                ("share-70", 70, 16),
                ("exclusive-2gpu", 200, 0),
                ("over-quota", 10, 4)
            ]
        );
        assert_eq!(pods[0].containers[0].argv, ["/work/compute_loop", "1536"]);
    }

    #[test]
    fn numbers_become_quantity_strings_and_bad_manifests_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("p.yaml");
        std::fs::write(
            &f,
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - name: c\n    command: [x]\n    resources: {limits: {tencent.com/vcuda-core: 5}}\n",
        )
        .unwrap();
        let p = load_file(&f).unwrap();
        assert_eq!(
            p.object["spec"]["containers"][0]["resources"]["limits"][VCORE],
            "5"
        );
        assert_eq!(p.namespace, "default");
        std::fs::write(&f, "apiVersion: v1\nkind: Service\nmetadata: {name: p}\n").unwrap();
        let e = load_file(&f).unwrap_err().to_string();
        assert!(e.contains("p.yaml") && e.contains("not a v1 Pod"), "{e}");
    }
}
