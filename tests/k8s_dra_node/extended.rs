//! Whole GPUs without a claim (KEP-5004, DeviceClass `extendedResourceName`,
//! GA in 1.37, beta and on in 1.36): the driver's whole-GPU class maps
//! `vcuda.tencent.com/gpu`, so a container's `limits:
//! {vcuda.tencent.com/gpu: 1}` is one whole GPU. The scheduler writes the
//! pod's claim itself (named in `status.extendedResourceClaimStatus`), the
//! driver prepares it like any whole-GPU claim, and the program sees the
//! whole card. Field names from k8s.io/api core/v1 types.go
//! (`PodExtendedResourceClaimStatus`).

use crate::parts::*;
use serde_json::Value;
use std::path::Path;
use test_support::k8s::util::{MIB, get_u64, wait};
use test_support::kv;

/// The card's memory on the suite's node file (sim-4gpu-pcie: 15360 MiB).
const CARD_MIB: u64 = 15360;

pub fn extended_resource_phase(n: &Node, bin: &Path, sim: &Path, minor: u32) {
    let class = n
        .json(&["get", "deviceclass", "vcuda-gpu.vcuda.tencent.com"])
        .unwrap();
    let mapped = class["spec"]["extendedResourceName"].as_str();
    if minor < 36 {
        // DRAExtendedResource is alpha and off there: the API server drops
        // the field, and the driver says so in its log.
        eprintln!(
            "k8s_dra: 1.{minor}: no extendedResourceName (DRAExtendedResource off); whole GPUs by resource name not checked"
        );
        return;
    }
    assert_eq!(
        mapped,
        Some("vcuda.tencent.com/gpu"),
        "the whole-GPU class maps the extended resource on 1.{minor}: {class}"
    );
    eprintln!(
        "k8s_dra: one whole GPU asked as limits {{vcuda.tencent.com/gpu: 1}}, no claim written"
    );
    n.apply(&pod_with_limits(
        "by-resource",
        "limits: {vcuda.tencent.com/gpu: \"1\"}",
        "ls /dev; echo visible=$NVIDIA_VISIBLE_DEVICES; \
         CUDA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES /work/shim_client quota 1024; \
         echo ---done; sleep 100000",
        bin,
        sim,
    ));
    wait_running(n, "by-resource", 120);
    let out = log_with(n, "by-resource", "---done");
    let pod = n.json(&["-n", NS, "get", "pod", "by-resource"]).unwrap();
    let status = &pod["status"]["extendedResourceClaimStatus"];
    let claim_name = status["resourceClaimName"]
        .as_str()
        .unwrap_or_else(|| panic!("the scheduler names the pod's claim: {}", pod["status"]));
    let mapping = &status["requestMappings"][0];
    assert_eq!(mapping["resourceName"], "vcuda.tencent.com/gpu", "{status}");
    assert_eq!(mapping["containerName"], "main", "{status}");
    let claim = n
        .json(&["-n", NS, "get", "resourceclaim", claim_name])
        .unwrap();
    let results = claim["status"]["allocation"]["devices"]["results"]
        .as_array()
        .unwrap_or_else(|| panic!("the claim is allocated: {claim}"));
    assert_eq!(results.len(), 1, "one device for a count of 1: {claim}");
    let r: &Value = &results[0];
    assert_eq!(r["driver"], "vcuda.tencent.com", "{claim}");
    let gpu = r["device"].as_str().unwrap().trim_start_matches("gpu-");
    let devs: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("nvidia") && l[6..].parse::<u32>().is_ok())
        .collect();
    assert_eq!(
        devs,
        [format!("nvidia{gpu}")],
        "its GPU's node alone:\n{out}"
    );
    let visible = kv(&out).get("visible").cloned().unwrap_or_default();
    assert_eq!(visible.split(',').count(), 1, "one GPU visible:\n{out}");
    let total = get_u64(&kv(&out), "start_total", &out);
    assert_eq!(total, CARD_MIB * MIB, "the whole card, not a share:\n{out}");
    n.ok(&["-n", NS, "delete", "pod", "by-resource", "--wait=true"]);
    wait(
        "the scheduler's claim deleted with its pod",
        60,
        || match n.json(&["-n", NS, "get", "resourceclaim", claim_name]) {
            Ok(c) => Err(format!(
                "still there: {}",
                c["metadata"]["deletionTimestamp"]
            )),
            Err(_) => Ok(()),
        },
    );
}
