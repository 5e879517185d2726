use super::*;

const P: u64 = DEFAULT_PERIOD_NS;

/// A device model: the container launches at most `rate` units/ns
/// (or `demand` if lower) and each unit costs `k` ns.
fn run(quota: Quota, k: f64, demand: f64, others: f64, periods: usize) -> (Controller, f64) {
    let mut c = Controller::new(quota);
    let mut rate = f64::INFINITY;
    let mut units = 0.0;
    let mut t = 0;
    let mut own = 0.0;
    c.record_launched(t, 0);
    for _ in 0..periods {
        let r = rate.min(demand);
        let room = (100.0 - others) / 100.0 / k;
        let r = r.min(room);
        // Ticks of 20 ms within the period.
        for _ in 0..5 {
            t += P / 5;
            units += r * (P / 5) as f64;
            c.record_launched(t, units as u64);
        }
        own = r * k * 100.0;
        let p = Period {
            end_ns: t,
            len_ns: P,
            own,
            others,
            cost: c.cost_between(t - P, t),
        };
        if let Some(d) = c.add_period(p, rate < demand) {
            rate = d.rate;
        }
    }
    (c, own)
}

fn hard(utilization: f64) -> Quota {
    Quota {
        utilization,
        soft_limit: None,
    }
}

/// Launches at `r` units/ns for one period ending at `t` + [`P`]; the
/// period's cost.
fn one_period(c: &mut Controller, t: &mut u64, units: &mut f64, r: f64) -> Option<u64> {
    *t += P;
    *units += r * P as f64;
    c.record_launched(*t, *units as u64);
    c.cost_between(*t - P, *t)
}

#[test]
fn hard_limit_lands_on_the_target_whatever_the_scale() {
    for k in [1e-3, 0.05, 7.0] {
        for l in [10.0, 30.0, 90.0] {
            let q = Quota {
                utilization: l,
                soft_limit: None,
            };
            let (c, own) = run(q, k, f64::INFINITY, 0.0, 40);
            assert!((own - l).abs() < 0.5, "k={k} L={l}: {own}");
            assert!((c.scale().unwrap() - k).abs() / k < 1e-3);
        }
    }
}

#[test]
fn an_idle_container_does_not_wind_up() {
    let q = Quota {
        utilization: 50.0,
        soft_limit: None,
    };
    // Wants only 20% worth of work.
    let (c, own) = run(q, 0.01, 0.2 / 0.01, 0.0, 50);
    assert!((own - 20.0).abs() < 0.5, "{own}");
    assert!((c.integral() - 1.0).abs() < 1e-9, "{}", c.integral());
}

#[test]
fn soft_limit_takes_what_others_leave() {
    let q = Quota {
        utilization: 30.0,
        soft_limit: Some(100.0),
    };
    assert_eq!(q.target(0.0), 100.0);
    assert_eq!(q.target(40.0), 60.0);
    assert_eq!(q.target(90.0), 30.0);
    let capped = Quota {
        utilization: 30.0,
        soft_limit: Some(60.0),
    };
    assert_eq!(capped.target(0.0), 60.0);
    let (_, own) = run(capped, 0.02, f64::INFINITY, 0.0, 30);
    assert!((own - 60.0).abs() < 0.5, "{own}");
    let (_, own) = run(q, 0.02, f64::INFINITY, 50.0, 30);
    assert!((own - 50.0).abs() < 0.5, "{own}");
}

/// A soft share (30, cap 70) alone at its cap; a neighbour arrives
/// that submits `wants` percent worth. On a full device each gets its
/// share of what both submit (contexts time-slice). Returns the soft
/// share's use per period after the arrival.
fn neighbour_arrives(wants: f64) -> Vec<f64> {
    neighbour_wants(|_| wants)
}

/// [`neighbour_arrives`] with what the neighbour submits in each period
/// after its arrival (0: the first).
fn neighbour_wants(wants: impl Fn(usize) -> f64) -> Vec<f64> {
    let q = Quota {
        utilization: 30.0,
        soft_limit: Some(70.0),
    };
    let k = 0.01;
    let mut c = Controller::new(q);
    let (mut t, mut units, mut rate) = (0u64, 0.0, f64::INFINITY);
    c.record_launched(0, 0);
    let mut after = Vec::new();
    for i in 0..60 {
        let submits = (rate * k * 100.0).min(100.0);
        let other = if i < 20 { 0.0 } else { wants(i - 20) };
        let scale = (100.0 / (submits + other)).min(1.0);
        let (own, others) = (submits * scale, other * scale);
        t += P;
        units += own / 100.0 / k * P as f64;
        c.record_launched(t, units as u64);
        let p = Period {
            end_ns: t,
            len_ns: P,
            own,
            others,
            cost: c.cost_between(t - P, t),
        };
        rate = c.add_period(p, true).map_or(rate, |d| d.rate);
        if i >= 20 {
            after.push(own);
        }
    }
    after
}

#[test]
fn a_soft_share_yields_to_a_neighbour_that_wants_more_and_keeps_what_is_left() {
    let greedy = neighbour_arrives(70.0);
    assert!(
        greedy[5..].iter().all(|&o| o <= 31.0),
        "soft share beside a neighbour that wants 70: {greedy:.1?}"
    );
    let modest = neighbour_arrives(40.0);
    let end = modest[30..].iter().sum::<f64>() / 10.0;
    assert!(
        end >= 55.0,
        "soft share beside a neighbour at 40: {modest:.1?}"
    );
}

/// A neighbour's controller dips for a period while it relearns its scale
/// (the accuracy test's hard 70 at 58 % for 100 ms): the soft share that
/// yielded keeps yielding through it, and still takes the device back
/// within a few periods once the neighbour is gone.
#[test]
fn a_soft_share_holds_through_a_neighbours_dip_and_takes_back_a_gap() {
    let dip = neighbour_wants(|i| match i {
        15 | 16 => 55.0,
        i if i >= 30 => 0.0,
        _ => 70.0,
    });
    assert!(
        dip[5..30].iter().all(|&o| o <= 31.0),
        "soft share through a 2-period dip of its neighbour: {:.1?}",
        &dip[..30]
    );
    let back = dip[30..].iter().position(|&o| o >= 65.0);
    assert!(
        back.is_some_and(|p| p <= 8),
        "neighbour gone at period 30, the soft share back at its cap after {back:?} periods: {:.1?}",
        &dip[30..]
    );
}

#[test]
fn integral_corrects_a_bias() {
    // Feed-forward misses by 20% (e.g. tokens lost): achieved is 0.8 of
    // what the rate says; the integral brings it back.
    let q = Quota {
        utilization: 40.0,
        soft_limit: None,
    };
    let mut c = Controller::new(q);
    let (mut t, mut units, mut rate, mut own) = (0u64, 0.0, 1.0, 0.0);
    c.record_launched(0, 0);
    for _ in 0..100 {
        t += P;
        units += rate * P as f64;
        c.record_launched(t, units as u64);
        // k = 0.01 on what was launched, but only 80% of it "counts".
        own = rate * 0.01 * 100.0 * 0.8;
        let p = Period {
            end_ns: t,
            len_ns: P,
            own,
            others: 0.0,
            cost: c.cost_between(t - P, t),
        };
        rate = c.add_period(p, true).unwrap().rate;
    }
    assert!((own - 40.0).abs() < 1.0, "{own}");
}

/// Issue 12: a history of 1-thread kernels (one 10 us wave each, 25%
/// busy) must not price a 1 ms kernel (100 waves) out of reach: its
/// first wait is what its device time takes to earn at the quota.
#[test]
fn a_scale_learned_on_tiny_kernels_prices_big_ones_by_device_time() {
    use crate::throttle::cost::{WAVE_UNITS, waves};
    let cost = |g, b| waves(108, 2048, [g, 1, 1], [b, 1, 1]) * WAVE_UNITS;
    let (tiny, big) = (cost(1, 1), cost(86_400, 256));
    let wave_ns = 10_000.0;
    let mut c = Controller::new(Quota {
        utilization: 30.0,
        soft_limit: None,
    });
    let (mut t, mut units) = (0u64, 0u64);
    c.record_launched(0, 0);
    let mut rate = None;
    for _ in 0..20 {
        // 2500 tiny kernels per 100 ms period: 25 ms busy.
        t += P;
        units += 2500 * tiny;
        c.record_launched(t, units);
        let p = Period {
            end_ns: t,
            len_ns: P,
            own: 2500.0 * wave_ns / P as f64 * 100.0,
            others: 0.0,
            cost: c.cost_between(t - P, t),
        };
        rate = c.add_period(p, false).map(|d| d.rate);
    }
    let wait_ns = big as f64 / rate.unwrap();
    let earn_ns = 100.0 * wave_ns / 0.30;
    assert!(
        wait_ns < 1.5 * earn_ns,
        "a 1 ms kernel waits {:.1} ms at 30% (earned in {:.1} ms)",
        wait_ns / 1e6,
        earn_ns / 1e6
    );
}

/// Samples that never name the container's PIDs (its work shows as
/// "others"): after a second the controller charges it the device's
/// whole busy time and lands on the quota instead of running open.
#[test]
fn unattributed_samples_are_noticed_and_the_quota_still_holds() {
    let q = Quota {
        utilization: 30.0,
        soft_limit: None,
    };
    let mut c = Controller::new(q);
    let k = 10_000.0 / 16.0; // ns per unit: 10 us waves
    let (mut t, mut units, mut rate, mut true_own) = (0u64, 0.0, f64::INFINITY, 0.0);
    c.record_launched(0, 0);
    for i in 0..60 {
        let r = rate.min(1.0 / k); // at most the whole device
        let cost = one_period(&mut c, &mut t, &mut units, r);
        true_own = r * k * 100.0;
        let p = Period {
            end_ns: t,
            len_ns: P,
            own: 0.0,
            others: true_own,
            cost,
        };
        if let Some(d) = c.add_period(p, rate < f64::INFINITY) {
            rate = d.rate;
        }
        if i < 5 {
            assert_eq!(c.blind(), None, "not after {i} periods");
        }
    }
    assert_eq!(c.blind(), Some(Blind::OtherPids));
    assert!((true_own - 30.0).abs() < 1.0, "achieved {true_own}");
    // Its own samples come back: attributed again.
    let p = Period {
        end_ns: t + P,
        len_ns: P,
        own: 30.0,
        others: 0.0,
        cost: None,
    };
    c.add_period(p, false);
    assert_eq!(c.blind(), None);
}

/// A small quota, from the start-up rate as the bucket really starts:
/// the ramp tops out below [`BLIND_MIN_UNITS`] per period, and samples
/// that never name the container's PIDs must be noticed all the same.
#[test]
fn a_small_quota_from_its_start_up_rate_notices_unattributed_samples() {
    let q = Quota {
        utilization: 10.0,
        soft_limit: None,
    };
    let mut c = Controller::new(q);
    let k = 10_000.0 / 16.0; // ns per unit: 10 us waves
    let (mut t, mut units, mut rate) = (0u64, 0.0, startup_rate(q));
    c.record_launched(0, 0);
    for _ in 0..40 {
        t += P;
        units += rate * P as f64;
        c.record_launched(t, units as u64);
        let p = Period {
            end_ns: t,
            len_ns: P,
            own: 0.0,
            others: (rate * k * 100.0).round(),
            cost: c.cost_between(t - P, t),
        };
        if let Some(d) = c.add_period(p, true) {
            rate = d.rate;
        }
    }
    assert_eq!(c.blind(), Some(Blind::OtherPids));
}

#[test]
fn no_samples_at_all_hold_a_rate_never_none() {
    let q = Quota {
        utilization: 30.0,
        soft_limit: None,
    };
    let mut c = Controller::new(q);
    let mut units = 0;
    for i in 0..=100u64 {
        units += 100_000;
        c.record_launched(i * 20_000_000, units);
        let d = c.check_samples(i * 20_000_000);
        if i * 20 < 2000 {
            assert_eq!((d, c.blind()), (None, None), "at {i}");
        } else {
            assert_eq!(c.blind(), Some(Blind::NoSamples));
            let d = d.expect("a rate when none was learned");
            let expect = 0.30 * super::super::cost::WAVE_UNITS as f64 / ASSUMED_WAVE_NS;
            assert!((d.rate - expect).abs() < 1e-12, "{d:?}");
            break;
        }
    }
    assert_eq!(c.check_samples(3_000_000_000), None, "said once");
}

#[test]
fn a_seeded_scale_holds_until_three_periods_say_otherwise() {
    let mut c = Controller::new(Quota {
        utilization: 50.0,
        soft_limit: None,
    });
    c.seed_scale(2.0);
    c.record_launched(0, 0);
    let mut units = 0;
    for i in 1..=3u64 {
        units += 1_000_000;
        c.record_launched(i * P, units);
        // A noisy estimate (own 90% of 1e6 units: k = 90).
        let p = Period {
            end_ns: i * P,
            len_ns: P,
            own: 90.0,
            others: 0.0,
            cost: c.cost_between((i - 1) * P, i * P),
        };
        let d = c.add_period(p, false).unwrap();
        if i < 3 {
            assert_eq!(c.scale(), Some(2.0), "period {i}");
            assert!((d.rate - 0.5 / 2.0).abs() < 1e-12);
        }
    }
    assert!((c.scale().unwrap() - 90.0).abs() < 1e-9);
}

/// Waves of 5 us at a start-up rate sized for 0.5 ms waves: 0.3 % of
/// the device, which NVML rounds to 0. The rate doubles per such
/// period up to the 50 us-wave rate, where NVML shows the container
/// (3 %) and the controller learns its scale.
#[test]
fn a_start_too_slow_for_nvml_to_see_ramps_up_until_it_is_seen() {
    let q = Quota {
        utilization: 30.0,
        soft_limit: None,
    };
    let k = 5_000.0 / super::super::cost::WAVE_UNITS as f64; // ns per unit
    let mut c = Controller::new(q);
    let (mut t, mut units, mut rate) = (0u64, 0.0, startup_rate(q));
    c.record_launched(0, 0);
    let mut rates = vec![rate];
    for _ in 0..8 {
        t += P;
        units += rate * P as f64;
        c.record_launched(t, units as u64);
        let own = (rate * k * 100.0).round();
        let p = Period {
            end_ns: t,
            len_ns: P,
            own,
            others: 0.0,
            cost: c.cost_between(t - P, t),
        };
        rate = c.add_period(p, true).unwrap().rate;
        rates.push(rate);
    }
    assert!(rates[1] > rates[0] && rates[2] > rates[1], "{rates:?}");
    assert!(c.scale().is_some(), "never seen: {rates:?}");
    let own = rate * k * 100.0;
    assert!((own - 30.0).abs() < 3.0, "{own} {rates:?}");
}

#[test]
fn launched_interpolates() {
    let mut c = Controller::new(Quota {
        utilization: 10.0,
        soft_limit: None,
    });
    assert_eq!(c.launched_at(5), None);
    c.record_launched(100, 1000);
    c.record_launched(200, 2000);
    c.record_launched(150, 5); // out of order: ignored
    assert_eq!(c.launched_at(150), Some(1500.0));
    assert_eq!(c.launched_at(200), Some(2000.0));
    assert_eq!(c.launched_at(201), None);
    assert_eq!(c.cost_between(100, 200), Some(1000));
}

/// Long kernels (0.7 ms waves, as a CUDA graph of 8192² matmuls on an H100)
/// whose samples never name the container (an MPS client): from the
/// start-up rate, the admitted units stay under what counts towards
/// blindness, so the controller alone never notices and the share runs
/// open (85 % under a hard 30 % on the H100, tests/gpu/README.md);
/// told at once ([`Controller::assume_blind`], what the interposer does
/// for an MPS client), it lands on the quota.
#[test]
fn long_kernels_of_an_mps_client_hold_only_when_told() {
    let q = Quota {
        utilization: 30.0,
        soft_limit: None,
    };
    let run = |told: bool| {
        let mut c = Controller::new(q);
        if told {
            c.assume_blind();
        }
        let k = 700_000.0 / 16.0; // ns per unit: 0.7 ms waves
        let (mut t, mut units, mut rate, mut true_own) = (0u64, 0.0, startup_rate(q), 0.0);
        c.record_launched(0, 0);
        for _ in 0..100 {
            let r = rate.min(1.0 / k); // at most the whole device
            t += P;
            units += r * P as f64;
            c.record_launched(t, units as u64);
            true_own = r * k * 100.0;
            let p = Period {
                end_ns: t,
                len_ns: P,
                own: 0.0,
                others: true_own.round(),
                cost: c.cost_between(t - P, t),
            };
            if let Some(d) = c.add_period(p, true) {
                rate = d.rate;
            }
        }
        (c.blind(), true_own)
    };
    let (blind, share) = run(false);
    assert_eq!(blind, None);
    assert!(share > 60.0, "the limit this test documents moved: {share}");
    let (blind, share) = run(true);
    assert_eq!(blind, Some(Blind::OtherPids));
    assert!((share - 30.0).abs() < 2.0, "achieved {share}");
}

/// A container a busier neighbour eclipses in every period (a real driver
/// names one process a sample period: [`Controller::add_eclipsed`]),
/// `demand` units/ns at `k` ns each, beside a neighbour at `others` %.
/// Returns its true use at the end and the last decided rate.
fn eclipsed_run(quota: Quota, k: f64, demand: f64, others: f64) -> (Controller, f64, f64) {
    eclipsed_run_as(quota, k, demand, others, Named::OwnShare, None)
}

/// What NVML gives the neighbour it names.
#[derive(Clone, Copy, PartialEq)]
enum Named {
    OwnShare,
    /// The device's whole busy percent (driver 580 on an H200).
    DeviceTotal,
}

/// [`eclipsed_run`] with the named neighbour's figure as `named` and the
/// container's timed scale `timed`.
fn eclipsed_run_as(
    quota: Quota,
    k: f64,
    demand: f64,
    others: f64,
    named: Named,
    timed: Option<f64>,
) -> (Controller, f64, f64) {
    let mut c = Controller::new(quota);
    let (mut t, mut units, mut rate, mut own) = (0u64, 0.0, f64::INFINITY, 0.0);
    c.record_launched(0, 0);
    for _ in 0..60 {
        c.set_timed(timed.map(|k| Timed::new(k, 0.0)));
        let r = rate.min(demand).min((100.0 - others) / 100.0 / k);
        let cost = one_period(&mut c, &mut t, &mut units, r);
        own = r * k * 100.0;
        let p = Period {
            end_ns: t,
            len_ns: P,
            own: 0.0,
            others: match named {
                Named::OwnShare => others,
                Named::DeviceTotal => others + own,
            },
            cost,
        };
        if let Some(d) = c.add_eclipsed(p, Some(others + own), rate < demand) {
            rate = d.rate;
        }
    }
    (c, own, rate)
}

/// The latency tenant of tests/gpu's `qos` case on an H200: 5 % of the
/// device beside a batch share at 50 %, never named by NVML. Charged what
/// the device was busy beyond the batch share, it stays unthrottled and
/// is never called blind (charged the batch's 50 %, its p99 was 370 ms).
#[test]
fn a_share_a_busier_neighbour_eclipses_is_charged_what_the_device_leaves() {
    let q = hard(50.0);
    let k = 10_000.0 / 16.0;
    let demand = 0.05 / k;
    let (c, own, rate) = eclipsed_run(q, k, demand, 50.0);
    assert_eq!(c.blind(), None);
    assert!((own - 5.0).abs() < 0.1, "achieved {own}");
    assert!(
        rate > 2.0 * demand,
        "throttled: rate {rate}, demand {demand}"
    );
}

/// A saturating share under a hard 30 % that NVML never names (its
/// neighbour at 60 % is always busier): the device's busy time beyond
/// the neighbour still lands it on its quota.
#[test]
fn a_share_never_named_still_holds_its_quota() {
    let q = hard(30.0);
    let k = 10_000.0 / 16.0;
    let (c, own, _) = eclipsed_run(q, k, f64::INFINITY, 60.0);
    assert_eq!(c.blind(), None);
    assert!((own - 30.0).abs() < 1.5, "achieved {own} under a hard 30 %");
}

/// A saturating share that NVML names every period with the device's
/// whole busy percent (a real driver's busiest process; its neighbour
/// uses `others` unseen), with `timed` the scale its timed launches give.
fn named_at_device_total(quota: Quota, k: f64, others: f64, timed: Option<f64>) -> f64 {
    let exact = timed.map(|k| Timed::new(k, 0.0));
    named_at_device_total_timed(quota, k, others, |_| exact)
}

/// [`named_at_device_total`] with the timed estimate of each period.
fn named_at_device_total_timed(
    quota: Quota,
    k: f64,
    others: f64,
    timed: impl Fn(usize) -> Option<Timed>,
) -> f64 {
    let mut c = Controller::new(quota);
    let (mut t, mut units, mut rate, mut own) = (0u64, 0.0, f64::INFINITY, 0.0);
    c.record_launched(0, 0);
    for i in 0..80 {
        c.set_timed(timed(i));
        let r = rate.min((100.0 - others) / 100.0 / k);
        let cost = one_period(&mut c, &mut t, &mut units, r);
        own = r * k * 100.0;
        let p = Period {
            end_ns: t,
            len_ns: P,
            own: (own + others).min(100.0),
            others: 0.0,
            cost,
        };
        if let Some(d) = c.add_period(p, true) {
            rate = d.rate;
        }
    }
    own
}

/// Hard 60 % beside a neighbour at 30 % on a driver whose NVML names the
/// busiest process with the device's total: charged its neighbour's use
/// too, it held 30 % (48 % on an H200, where the two took turns being
/// named); with its launches timed (5 % long) it holds 57 %. Alone,
/// timed launches that read long change nothing.
#[test]
fn timed_launches_cap_what_a_share_named_at_the_device_total_is_charged() {
    let q = hard(60.0);
    let k = 10_000.0 / 16.0;
    let blind = named_at_device_total(q, k, 30.0, None);
    assert!((blind - 30.0).abs() < 2.0, "without timing: {blind}");
    let timed = named_at_device_total(q, k, 30.0, Some(k * 1.05));
    assert!((timed - 60.0 / 1.05).abs() < 2.0, "timed: {timed}");
    let alone = named_at_device_total(q, k, 0.0, Some(k * 1.3));
    assert!((alone - 60.0).abs() < 1.5, "alone, timed long: {alone}");
}

/// The cap engages beyond four standard errors and, once on, holds until
/// the timed ratio is within one of NVML's scale: through seconds whose
/// timed launches disagree more than they did (a standard error of 0.3 of
/// the ratio, where three would not start it) it holds, where let go the
/// rate would follow NVML's scale, which counts the neighbour's use too.
#[test]
fn a_cap_in_force_holds_through_noisy_timed_seconds() {
    let q = hard(60.0);
    let k = 10_000.0 / 16.0;
    let noisy_after =
        |n: usize, e: f64| move |i: usize| Some(Timed::new(k, if i < n { 0.0 } else { e * k }));
    let never_capped = named_at_device_total_timed(q, k, 30.0, noisy_after(0, 1.0));
    assert!(
        (never_capped - 30.0).abs() < 2.0,
        "noisy from the start: {never_capped}"
    );
    let held = named_at_device_total_timed(q, k, 30.0, noisy_after(20, 0.3));
    assert!((held - 60.0).abs() < 1.5, "noisy after 2 s: {held}");
}

/// An eclipsed share (never named) with timed launches is charged their
/// device time, not what the device leaves beside the named neighbour
/// (nothing, on a driver that gives the named one the device's total: it
/// then never learned a scale and stayed on its start-up ramp's ceiling,
/// 6 % of a hard 30 %).
#[test]
fn an_eclipsed_share_with_timed_launches_is_charged_their_time() {
    let q = hard(30.0);
    let k = 10_000.0 / 16.0;
    let (_, untimed, _) = eclipsed_run_as(q, k, f64::INFINITY, 60.0, Named::DeviceTotal, None);
    assert!(
        (untimed - 30.0).abs() > 10.0,
        "the case fails without timing: {untimed}"
    );
    let (c, own, _) = eclipsed_run_as(q, k, f64::INFINITY, 60.0, Named::DeviceTotal, Some(k));
    assert_eq!(c.blind(), None);
    assert!((own - 30.0).abs() < 1.5, "achieved {own} under a hard 30 %");
}

/// A saturating share that NVML never samples at all (a MIG instance on a
/// GPU without GPM), its launches timed (`timed`) or not: returns its use.
fn unsampled_run(quota: Quota, k: f64, timed: Option<f64>) -> (Controller, f64) {
    let mut c = Controller::new(quota);
    let (mut t, mut units, mut rate, mut own) = (0u64, 0.0, f64::INFINITY, 0.0);
    c.record_launched(0, 0);
    for _ in 0..100 {
        let r = rate.min(1.0 / k);
        t += P;
        units += r * P as f64;
        c.record_launched(t, units as u64);
        own = r * k * 100.0;
        if let Some(d) = c.check_samples(t) {
            rate = d.rate;
        }
        c.set_timed(timed.map(|k| Timed::new(k, 0.0)));
        if let Some(d) = c.add_timed_period(t, || true) {
            rate = d.rate;
        }
    }
    (c, own)
}

/// No samples at all: the blind rule's assumed wave time (50 us) held a
/// share of 10 us waves at a fifth of its quota; its timed launches,
/// a period of their own every 100 ms, bring it to its quota.
#[test]
fn with_no_samples_at_all_timed_launches_hold_the_quota() {
    let q = hard(50.0);
    let k = ASSUMED_WAVE_NS / 5.0 / super::super::cost::WAVE_UNITS as f64;
    let (c, untimed) = unsampled_run(q, k, None);
    assert_eq!(c.blind(), Some(Blind::NoSamples));
    assert!(
        (untimed - 10.0).abs() < 1.0,
        "the blind rule alone: {untimed}"
    );
    let (c, own) = unsampled_run(q, k, Some(k));
    assert_eq!(c.blind(), Some(Blind::NoSamples), "NVML still sees nothing");
    assert!((own - 50.0).abs() < 1.5, "achieved {own} under a hard 50 %");
}
