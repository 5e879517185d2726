//! Phase 1c: memory requests below limits under the real kubelet
//! (docs/qos.md, "Memory"). A pod with `vcuda-memory: 16` (4 GiB) and
//! `tencent.com/vcuda-memory-limit: 12Gi` fills 11 GiB of a 15 GiB T4 (plus
//! its context); a guaranteed pod (`vcuda-memory: 32`, 8 GiB) packed on the
//! same GPU then allocates 7 GiB. Only the borrower's lent memory can make
//! room: its process is ended (exit 137, a line in its log saying why, a
//! `VcudaMemoryReclaimed` Event on its pod) and the guaranteed pod
//! succeeds.

use std::time::Instant;
use test_support::k8s::cluster::{Cluster, Work, pod_yaml};
use test_support::k8s::util::wait;
use test_support::kv;

fn with_annotations(yaml: String, annotations: &str) -> String {
    yaml.replacen(
        "  namespace: default\n",
        &format!("  namespace: default\n  annotations: {{{annotations}}}\n"),
        1,
    )
}

fn gpu_of(c: &Cluster, name: &str) -> String {
    wait(&format!("{name}'s GPU annotation"), 60, || {
        let p = c.pod(name)?;
        p["metadata"]["annotations"]["tencent.com/predicate-gpu-idx-0"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("annotations {}", p["metadata"]["annotations"]))
    })
}

pub fn run(c: &Cluster, w: &Work, figures: &mut Vec<String>) {
    eprintln!("k8s_node: phase 1c: a memory limit above the guarantee, and its reclaim");
    let borrower = with_annotations(
        pod_yaml(
            w,
            "mem-borrower",
            30,
            16,
            // Held until killed: stdin a FIFO it opened itself.
            "mkfifo /tmp/hold && exec /work/hold_memory 11264 <> /tmp/hold",
            "",
        ),
        "tencent.com/vcuda-memory-limit: 12Gi",
    );
    c.apply(&borrower);
    let line = wait("the borrower's allocation", 120, || {
        let log = c.logs("mem-borrower");
        match log
            .lines()
            .find(|l| l.starts_with("pid=") || l.starts_with("FAIL"))
        {
            Some(l) => Ok(l.to_string()),
            None => Err(format!("log {log:?}")),
        }
    });
    assert!(
        line.starts_with("pid="),
        "11 GiB on a 4 GiB guarantee with a 12 GiB limit: {line}"
    );
    assert_eq!(
        kv(&line)["total_mib"],
        "12288",
        "a borrower sees its limit: {line}"
    );

    let t = Instant::now();
    c.apply(&pod_yaml(
        w,
        "mem-guaranteed",
        30,
        32,
        "/work/hold_memory 7168 < /dev/null",
        "",
    ));
    let p = c.wait_phase("mem-guaranteed", &["Succeeded", "Failed"], 120);
    let took = t.elapsed();
    let log = c.logs("mem-guaranteed");
    assert_eq!(
        gpu_of(c, "mem-borrower"),
        gpu_of(c, "mem-guaranteed"),
        "the guaranteed pod packs beside the borrower"
    );
    assert_eq!(
        p["status"]["phase"], "Succeeded",
        "the guaranteed 7 GiB: {log}"
    );
    let alloc_us = kv(&log)["alloc_us"].parse::<u64>().unwrap_or(0);

    // The borrower was ended and says why.
    let b = c.wait_phase("mem-borrower", &["Failed"], 60);
    let code = &b["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"];
    assert_eq!(code, 137, "SIGKILL: {}", b["status"]);
    let blog = c.logs("mem-borrower");
    assert!(blog.contains("was ended to reclaim GPU memory"), "{blog}");
    let ev = wait("the VcudaMemoryReclaimed event", 30, || {
        let list = c.json(&["events", "--field-selector", "reason=VcudaMemoryReclaimed"])?;
        test_support::k8s::util::event_about(&list, "mem-borrower")
    });
    let note = ev["message"].as_str().unwrap_or_default();
    assert!(note.contains("default/mem-guaranteed"), "{ev}");
    figures.push(format!(
        "memory: a 4 GiB / 12 GiB borrower holding 11 GiB reclaimed for a guaranteed 7 GiB \
         cuMemAlloc in {:.1} ms (that pod created to Succeeded: {:.1} s)",
        alloc_us as f64 / 1000.0,
        took.as_secs_f64()
    ));
    for p in ["mem-borrower", "mem-guaranteed"] {
        let _ = c.kubectl(&["delete", "pod", p, "--wait=false"]);
    }
}
