//! Memory requests below limits through DRA under the real kubelet
//! (docs/qos.md, "Memory"): a claim of 4 GiB with the opaque config
//! `memoryLimit: 12Gi` fills 11 GiB of a 15 GiB T4 (plus its context); a
//! guaranteed 8 GiB claim, pinned by a CEL selector to the same GPU, then
//! allocates 7 GiB. The borrower's process is ended (exit 137, a line in
//! its log saying why, the driver's log, a Warning Event on its pod) and
//! the guaranteed pod succeeds.

use crate::parts::*;
use serde_json::Value;
use std::path::Path;
use std::time::Instant;
use test_support::k8s::util::wait;
use test_support::kv;

fn line_of(n: &Node, pod: &str) -> String {
    wait(&format!("{pod}'s allocation"), 120, || {
        let log = n.kubectl(&["-n", NS, "logs", pod]).unwrap_or_default();
        match log
            .lines()
            .find(|l| l.starts_with("pid=") || l.starts_with("FAIL"))
        {
            Some(l) => Ok(l.to_string()),
            None => Err(format!("log {log:?}")),
        }
    })
}

/// Runs the phase; `driver` is the driver's log. Returns its figure.
pub fn memory_phase(n: &Node, bin: &Path, sim: &Path, driver: &DriverProc) -> String {
    eprintln!("k8s_dra: a memoryLimit above the claim's memory, and its reclaim");
    let config = "      config:\n      - requests: [gpu]\n        opaque:\n          driver: vcuda.tencent.com\n          parameters: {apiVersion: vcuda.tencent.com/v1alpha1, kind: GpuConfig, memoryLimit: 12Gi}\n";
    n.apply(&claim_template_with("mem-borrow", 30, "4Gi", "", config));
    n.apply(&pod(
        "mem-borrower",
        "mem-borrow",
        "mkfifo /tmp/hold && exec /work/hold_memory 11264 <> /tmp/hold",
        bin,
        sim,
    ));
    wait_running(n, "mem-borrower", 120);
    let line = line_of(n, "mem-borrower");
    assert!(
        line.starts_with("pid="),
        "11 GiB on a 4 GiB claim with a 12 GiB limit: {line}"
    );
    assert_eq!(
        kv(&line)["total_mib"],
        "12288",
        "a borrower sees its limit: {line}"
    );
    // The guaranteed claim on the same GPU.
    let claim = pod_claim(n, "mem-borrower").unwrap();
    let device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
        .as_str()
        .unwrap()
        .to_string();
    let slices = n.json(&["get", "resourceslices"]).unwrap();
    let uuid = slices["items"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["spec"]["devices"].as_array().cloned().unwrap_or_default())
        .find(|d| d["name"] == device.as_str())
        .and_then(|d| {
            d["attributes"]["uuid"]["string"]
                .as_str()
                .map(str::to_string)
        })
        .unwrap_or_else(|| panic!("no uuid attribute of {device} in {slices}"));
    let selector = format!(
        "          selectors:\n          - cel: {{expression: 'device.attributes[\"vcuda.tencent.com\"].uuid == \"{uuid}\"'}}\n"
    );
    n.apply(&claim_template_with(
        "mem-guarantee",
        30,
        "8Gi",
        &selector,
        "",
    ));
    let t = Instant::now();
    n.apply(&pod(
        "mem-guaranteed",
        "mem-guarantee",
        "/work/hold_memory 7168 < /dev/null",
        bin,
        sim,
    ));
    let p = wait("the guaranteed pod to finish", 180, || {
        let p = n.json(&["-n", NS, "get", "pod", "mem-guaranteed"])?;
        match p["status"]["phase"].as_str() {
            Some("Succeeded" | "Failed") => Ok(p),
            other => Err(format!("{other:?}")),
        }
    });
    let took = t.elapsed();
    let log = n
        .kubectl(&["-n", NS, "logs", "mem-guaranteed"])
        .unwrap_or_default();
    assert_eq!(
        p["status"]["phase"], "Succeeded",
        "the guaranteed 7 GiB: {log}"
    );
    let alloc_us = kv(&log)["alloc_us"].parse::<u64>().unwrap_or(0);
    let b: Value = wait("the borrower ended", 60, || {
        let p = n.json(&["-n", NS, "get", "pod", "mem-borrower"])?;
        if p["status"]["phase"] == "Failed" {
            Ok(p)
        } else {
            Err(p["status"].to_string())
        }
    });
    let code = &b["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"];
    assert_eq!(code, 137, "SIGKILL: {}", b["status"]);
    let blog = n
        .kubectl(&["-n", NS, "logs", "mem-borrower"])
        .unwrap_or_default();
    assert!(blog.contains("was ended to reclaim GPU memory"), "{blog}");
    assert_eq!(
        driver.count("was ended to reclaim GPU memory"),
        1,
        "the driver's log says it once"
    );
    // A Warning Event on the pod holding the borrower's claim, naming the
    // claim whose allocation needed the memory.
    let ev = event_on(n, "VcudaMemoryReclaimed", "mem-borrower");
    let note = ev["message"].as_str().unwrap_or_default();
    assert!(
        note.contains("claim") && note.contains("was ended to reclaim GPU memory"),
        "{ev}"
    );
    let figure = format!(
        "memory (DRA): a 4 GiB / 12 GiB borrower holding 11 GiB reclaimed for a guaranteed \
         7 GiB cuMemAlloc in {:.1} ms (that pod created to Succeeded: {:.1} s)",
        alloc_us as f64 / 1000.0,
        took.as_secs_f64()
    );
    eprintln!("k8s_dra: {figure}");
    for p in ["mem-borrower", "mem-guaranteed"] {
        n.ok(&["-n", NS, "delete", "pod", p, "--wait=true"]);
    }
    figure
}
