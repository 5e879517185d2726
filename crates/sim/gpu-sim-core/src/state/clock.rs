//! The clocks: the simulated timeline runs on CLOCK_MONOTONIC; NVML reports
//! sample times in microseconds since the Unix epoch.

/// CLOCK_MONOTONIC in nanoseconds. Served by the vDSO: no syscall.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Converts a monotonic timestamp to microseconds since the Unix epoch, as
/// NVML reports sample times.
pub fn mono_to_epoch_us(mono_ns: u64) -> u64 {
    let mut rt = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes our local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut rt) };
    let rt_ns = rt.tv_sec as u64 * 1_000_000_000 + rt.tv_nsec as u64;
    let now = now_ns();
    (rt_ns as i128 - (now as i128 - mono_ns as i128)).max(0) as u64 / 1000
}

/// Inverse of [`mono_to_epoch_us`].
pub fn epoch_us_to_mono(epoch_us: u64) -> u64 {
    let mut rt = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes our local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut rt) };
    let rt_ns = rt.tv_sec as i128 * 1_000_000_000 + rt.tv_nsec as i128;
    let now = now_ns() as i128;
    (now - (rt_ns - epoch_us as i128 * 1000)).max(0) as u64
}
