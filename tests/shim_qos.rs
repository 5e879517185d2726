//! Compute tiers (docs/qos.md) end to end on a simulated node: a latency
//! tenant (tests/c/qos_latency.c, requests of three 200 us kernels at 100
//! a second) and a saturating batch tenant (tests/c/shim_compute.c) run
//! under the interposer in shares whose test managers hand them the GPU's
//! QoS page with their tiers, as the node agent does.
//!
//! Checked here: the latency process holds a slot while it runs and loses
//! it when it exits; batch launches were held while it had work; the batch
//! share (soft, may burst to 100) still gets most of the GPU, with long
//! kernels and with short ones (its queue bounded by device time, not
//! launches); a latency tenant that polls frees batch work when its
//! queries say done; the latency tenant's requests complete. How far the
//! tiers bring its latency back to alone is a benchmark's figure, not a
//! test's (`cargo bench -p cuda-shim --bench qos_latency`). Needs
//! `cargo build --workspace` first.

use qos_page::Tier;
use std::collections::HashMap;
use test_support::shim::server::Qos;
use test_support::shim::simnode::ShimNode;
use test_support::shim::workload;
use test_support::{target_dir, workspace_root};

const SECONDS: f64 = 6.0;

/// The tenants' nice: a GPU server's process gets a core on a real node;
/// here the test host's other work must not starve its launch thread.
const FAVOUR: i32 = -10;

fn kv(out: &str) -> HashMap<String, f64> {
    out.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
        .collect()
}

/// What one run of a latency tenant beside a soft (50..100) batch share
/// of `batch_args` (shim_compute) measured.
struct Run {
    page: Qos,
    /// The batch process's percent of the GPU while the latency one ran.
    batch_busy: f64,
    /// The latency tenant's figures.
    out: HashMap<String, f64>,
    /// The latency share's ledger flag: its controller found its own use
    /// invisible to NVML (and charged it all busy time).
    lat_unattributed: u64,
    /// The batch share's held launches (its ledger): ns waited, holds.
    held: (u64, u64),
    /// What the host's CPUs did in the window (for a figure's message).
    host: String,
}

/// One run at a time: each is two processes timing the sim's device, and
/// the batch figure is what a busy host moves most.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `latency_extra`: more arguments of the latency tenant's.
fn beside_latency(batch_args: &[&str], latency_extra: &[&str]) -> Run {
    beside_latency_with(batch_args, latency_extra, &[])
}

/// As [`beside_latency`], both tenants with `env` (the sim's knobs).
fn beside_latency_with(batch_args: &[&str], latency_extra: &[&str], env: &[(&str, &str)]) -> Run {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (n, batch_prog) = ShimNode::sample(&workspace_root(), &target_dir(), "shim_compute.c");
    let lat_prog = n.compile_c(&workspace_root().join("tests/c/qos_latency.c"));
    let page = Qos::page();
    let lat = n.container(50, true, 0);
    let batch = n.container(50, false, 100);
    lat.manager
        .as_ref()
        .unwrap()
        .set_qos(page.with(Tier::Latency));
    batch
        .manager
        .as_ref()
        .unwrap()
        .set_qos(page.with(Tier::Batch));

    let secs = format!("{}", SECONDS + 2.0);
    let mut args = vec![batch_args[0], secs.as_str()];
    args.extend(&batch_args[1..]);
    let b = workload::start_with(&batch, &batch_prog, &args, env);
    assert_eq!(page.page.latency_live(), 0, "no latency process yet");
    let secs = format!("{SECONDS}");
    let mut lat_args = vec![secs.as_str(), "100", "3", "17280", "warmup=1"];
    lat_args.extend(latency_extra);
    let l = workload::start_with(&lat, &lat_prog, &lat_args, env);
    // What is measured is how the tiers keep the device fed, not how fast a
    // busy host wakes the tenants: the two favoured over the rest of the host.
    b.favour(FAVOUR);
    l.favour(FAVOUR);
    assert_eq!(
        page.page.latency_live(),
        1,
        "the latency process holds a slot"
    );
    let (from, to) = (
        l.start + workload::s(1.0),
        l.start + workload::s(SECONDS - 0.5),
    );
    workload::sleep_until(from);
    let cpu = test_support::process::HostCpu::now(&[b.pid as u32, l.pid as u32]);
    workload::sleep_until(to);
    let host = cpu.since();
    let batch_busy = n.busy(&[b.pid], from, to);
    let out = kv(&workload::finish(l));
    workload::finish(b);
    let held = {
        let l = batch.manager.as_ref().unwrap().ledger();
        (l.qos_held_ns(), l.qos_holds())
    };
    Run {
        host,
        page,
        batch_busy,
        out,
        held,
        lat_unattributed: lat
            .manager
            .as_ref()
            .unwrap()
            .ledger()
            .compute_unattributed(),
    }
}

/// Each test's figures are a share of the sim's device time two
/// processes keep busy: what a busy host moves most. `tests/run.sh` skips
/// `quiet_host::` in the workspace run and the glibc-2.17 run (beside the 1.20
/// cluster, the short-kernel batch share fell to 64 %) and runs them, for
/// both builds, once no cluster runs.
/// CI's glibc-2.17 run got 64.8 % with no cluster up (at 09da4e7); two
/// busy loops here give 70-74 %, and 85-87 % with the tenants at nice -10
/// ([`FAVOUR`]); each figure's message says what the host's CPUs did.
mod quiet_host {
    use super::*;

    #[test]
    fn a_batch_share_holds_while_the_latency_share_has_work_and_keeps_the_rest() {
        let Run {
            page,
            batch_busy,
            out,
            held: (held_ns, holds),
            host,
            ..
        } = beside_latency(&["saturate", "4"], &[]);
        assert!(
            holds > 0 && held_ns > 0,
            "batch launches were held: {holds} holds, {held_ns} ns"
        );
        // Dropped when its registration connection closed (the process exited).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while page.page.latency_live() != 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(
            page.page.latency_live(),
            0,
            "the exited process's slot was freed"
        );
        // Requests are 6 % of the GPU: a soft batch share keeps most of the rest
        // (about 88 % on an idle machine; one launch in flight costs it little
        // with 1 ms kernels).
        assert!(
            batch_busy > 50.0,
            "batch got {batch_busy:.1} % of the GPU ({host})"
        );
        let requests = out["requests"];
        assert!(requests >= 400.0, "{requests} requests counted: {out:?}");
        // Not a latency target (see the bench): a request never waits out a
        // whole hold (100 ms) or a stuck batch queue.
        assert!(out["p99_us"] < 50_000.0, "{out:?}");
    }

    #[test]
    fn a_batch_share_of_short_kernels_keeps_the_device_fed_beside_a_latency_share() {
        // 120 us and 10 us kernels, the program synchronising every 50: the
        // interposer's queue bound (about 200 us of device time, not one
        // launch) is what drains the batch stream between the latency
        // tenant's requests. One launch in flight left the device idle for
        // each wake-up: 59–63 % of the GPU here on an idle machine (debug
        // builds); the bound keeps 88–90 %, with a CPU hog beside it too.
        let r = beside_latency(&["blockmix", "50"], &[]);
        eprintln!(
            "shim_qos: batch of short kernels kept {:.1} % of the GPU ({})",
            r.batch_busy, r.host
        );
        assert!(
            r.batch_busy > 72.0,
            "batch got {:.1} % of the GPU ({})",
            r.batch_busy,
            r.host
        );
        assert!(r.out["requests"] >= 400.0, "{:?}", r.out);
        assert!(r.out["p99_us"] < 50_000.0, "{:?}", r.out);
    }

    #[test]
    fn a_latency_share_that_polls_for_its_end_frees_batch_work_when_it_is_done() {
        // Its requests take about 6 % of the device; a query that says done
        // is its synchronize. Counted as busy until 20 ms after each launch
        // instead (a request every 10 ms), it would hold batch launches
        // nearly all the time.
        let r = beside_latency(&["saturate", "4"], &["poll"]);
        let (held_ns, holds) = r.held;
        let held = held_ns as f64 / 1e9 / (SECONDS + 2.0);
        eprintln!(
            "shim_qos: beside a polling latency tenant batch was held {:.1} % of its run ({holds} holds), kept {:.1} % of the GPU ({})",
            held * 100.0,
            r.batch_busy,
            r.host
        );
        assert!(holds > 0, "batch launches were held");
        assert!(held < 0.4, "batch held {:.1} % of its run", held * 100.0);
        assert!(
            r.batch_busy > 50.0,
            "batch got {:.1} % ({})",
            r.batch_busy,
            r.host
        );
        assert!(r.out["requests"] >= 400.0, "{:?}", r.out);
    }

    /// A real driver's NVML names one process a sample period, the busiest:
    /// on an H200 (driver 580) the latency tenant beside batch work was never
    /// named (tests/gpu/probes/nvml_util.py). Its controller took that for
    /// "NVML cannot see my processes", charged itself the batch share's
    /// 50-99 % and throttled its own requests: p99 0.8 ms alone, 370 ms
    /// beside a hard batch share and 55 ms beside a soft one (tests/gpu, the
    /// `qos` case). With the sim naming only the busiest process, the latency
    /// share must stay attributed and keep pace.
    #[test]
    fn a_latency_share_nvml_never_names_beside_busier_batch_is_not_charged_its_use() {
        let r = beside_latency_with(
            &["saturate", "4"],
            &[],
            &[(gpu_sim_core::SAMPLE_BUSIEST_ONLY_ENV, "1")],
        );
        eprintln!(
            "shim_qos: NVML naming the busiest process only: latency {:?}, batch {:.1} %",
            r.out, r.batch_busy
        );
        assert_eq!(r.lat_unattributed, 0, "the latency share was called blind");
        assert!(r.out["requests"] >= 400.0, "{:?}", r.out);
        assert!(r.out["p99_us"] < 50_000.0, "{:?}", r.out);
    }
}
