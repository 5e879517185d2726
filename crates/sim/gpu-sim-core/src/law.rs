//! How long a simulated kernel runs: a law per kernel, declared in the
//! fake module image it comes from, that the interposer never sees.
//!
//! A real kernel's device time follows from its body (what it computes,
//! how it touches memory, how many registers and how much shared memory
//! it needs), not from its launch shape alone, so a quota enforcer that
//! prices launches by their shape must learn the difference from feedback.
//! The simulator plays that part: a module image may declare, one line per
//! kernel,
//!
//! ```text
//! // gpu-sim kernel <name> <law> [key=value ...]
//! ```
//!
//! with the laws
//!
//! * `waves block_ns= regs= smem= tail=`: a compute-bound kernel. An SM
//!   holds as many blocks as its threads, registers (`regs` per thread, of
//!   65,536 per SM) and shared memory (`smem` per block plus the launch's
//!   dynamic bytes) allow, at most 32; each full wave takes `block_ns`, the
//!   last partial one `block_ns x (tail + (1 - tail) x fill)` (a lone block
//!   has the memory system to itself).
//! * `per_block ns= launch_ns=`: blocks that serialise on something (an
//!   atomic, a lock): `launch_ns + blocks x ns` whatever the SM count.
//! * `bandwidth bytes_per_block= gbps= saturate_threads= launch_ns=`: a
//!   memory-bound kernel. Achieved bandwidth grows with threads in flight
//!   until `saturate_threads` saturate the device at `gbps`; small grids
//!   are latency-bound (constant time), large ones linear in their bytes.
//! * `fixed ns=`: the grid is ignored (a persistent kernel looping over a
//!   work queue, a cooperative kernel spinning on a flag).
//!
//! and on any law `noise=f`: each launch's time is multiplied by a factor
//! uniform in `[1 - f, 1 + f]`, and `arg_ns=t`: each launch takes `t` more
//! per unit of its first kernel parameter (read as a 32-bit integer: a
//! length, a sequence size), work the launch shape does not show. Kernels
//! no line names follow [`Law::default_for`].
//!
//! Nothing here knows how `cuda-shim` prices a launch, and nothing may:
//! the point is a device whose timing the interposer can only observe.

use crate::node::GpuSpec;

/// Registers of one SM (every architecture since Maxwell).
const REGS_PER_SM: u64 = 65_536;
/// Resident blocks per SM at most.
const MAX_RESIDENT_BLOCKS: u64 = 32;
/// What a line must start with to declare a law.
pub const DECLARATION: &str = "// gpu-sim kernel ";

/// One kernel's timing law.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Law {
    pub shape: Shape,
    /// Relative half-width of the per-launch jitter (0 = deterministic).
    pub noise: f64,
    /// Device time per unit of the launch's first parameter.
    pub arg_ns: f64,
    /// Registers per thread (`CU_FUNC_ATTRIBUTE_NUM_REGS`).
    pub regs: u32,
    /// Static shared memory per block (`CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES`).
    pub smem: u32,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Shape {
    Waves {
        block_ns: f64,
        tail: f64,
    },
    PerBlock {
        ns: f64,
        launch_ns: f64,
    },
    Bandwidth {
        bytes_per_block: f64,
        gbps: f64,
        saturate_threads: f64,
        launch_ns: f64,
    },
    Fixed {
        ns: f64,
    },
}

/// A launch as the device sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    /// Dynamic shared memory per block.
    pub shared: u32,
    /// The first kernel parameter as a 32-bit integer (0 when unknown).
    pub arg: u32,
}

impl Launch {
    pub fn new(grid: [u32; 3], block: [u32; 3], shared: u32) -> Launch {
        Launch {
            grid,
            block,
            shared,
            arg: 0,
        }
    }
    /// The same launch with its first parameter's value.
    pub fn with_arg(self, arg: u32) -> Launch {
        Launch { arg, ..self }
    }
    fn blocks(&self) -> u64 {
        self.grid.iter().map(|&x| u64::from(x.max(1))).product()
    }
    fn threads(&self) -> u64 {
        self.block.iter().map(|&x| u64::from(x.max(1))).product()
    }
}

impl Law {
    /// The law of kernels no declaration names: compute-bound waves of the
    /// node's `kernel_wave_ns` whose last partial wave runs faster the
    /// emptier it is, 32 registers per thread, no shared memory.
    pub fn default_for(block_ns: u64) -> Law {
        Law {
            shape: Shape::Waves {
                block_ns: block_ns as f64,
                tail: 0.5,
            },
            noise: 0.0,
            arg_ns: 0.0,
            regs: 32,
            smem: 0,
        }
    }

    /// The law of a kernel of a binary image (a real fatbinary or cubin,
    /// which declares none): drawn from the kernel's name, so every kernel
    /// of a real library has a law of its own that its launch shape does
    /// not show — occupancy cut by registers or shared memory, a
    /// memory-bound kernel that saturates with its grid, one that ignores
    /// its grid — at 0.5 to 2.4 times the node's `block_ns`, with up to
    /// 10 % jitter. A real GPU's kernels differ by their bodies; these by
    /// their names, the one thing of a body the simulator has.
    pub fn undeclared(name: &str, gpu: &GpuSpec, block_ns: u64) -> Law {
        let h = mix(crate::fnv1a(name.as_bytes()));
        let pick = |shift: u32, n: u64| (h >> shift) % n;
        let ns = block_ns as f64 * (0.5 + pick(8, 16) as f64 / 8.0);
        let shape = match pick(0, 4) {
            0 | 1 => Shape::Waves {
                block_ns: ns,
                tail: 0.2 + pick(12, 8) as f64 / 10.0,
            },
            2 => {
                // Saturates at full occupancy; a grid of 256-thread blocks
                // that fills the device once takes about `ns`.
                let threads = f64::from(gpu.sm_count) * f64::from(gpu.max_threads_per_sm);
                let gbps = 1_000.0;
                Shape::Bandwidth {
                    bytes_per_block: ns * gbps / (threads / 256.0),
                    gbps,
                    saturate_threads: threads,
                    launch_ns: ns / 4.0,
                }
            }
            _ => Shape::Fixed { ns },
        };
        Law {
            shape,
            noise: pick(16, 11) as f64 / 100.0,
            arg_ns: 0.0,
            regs: [32, 64, 96, 128][pick(24, 4) as usize],
            smem: if pick(28, 4) == 0 { 32 << 10 } else { 0 },
        }
    }

    /// Device time of one launch on `gpu`. `random`: a uniformly random
    /// 64-bit word for the jitter (ignored without noise).
    pub fn duration_ns(&self, gpu: &GpuSpec, l: Launch, random: u64) -> u64 {
        let blocks = l.blocks() as f64;
        let t = match self.shape {
            Shape::Waves { block_ns, tail } => {
                let resident = (gpu.sm_count as u64 * self.blocks_per_sm(gpu, l)) as f64;
                let full = (blocks / resident).floor();
                let fill = blocks / resident - full;
                let last = if fill > 0.0 {
                    tail + (1.0 - tail) * fill
                } else {
                    0.0
                };
                (full + last) * block_ns
            }
            Shape::PerBlock { ns, launch_ns } => launch_ns + blocks * ns,
            Shape::Bandwidth {
                bytes_per_block,
                gbps,
                saturate_threads,
                launch_ns,
            } => {
                let in_flight = blocks * l.threads() as f64;
                let share = (in_flight / saturate_threads).min(1.0);
                launch_ns + blocks * bytes_per_block / (gbps * share)
            }
            Shape::Fixed { ns } => ns,
        };
        let jitter = if self.noise > 0.0 {
            let u = (random >> 11) as f64 / (1u64 << 53) as f64;
            1.0 + self.noise * (2.0 * u - 1.0)
        } else {
            1.0
        };
        ((t + self.arg_ns * f64::from(l.arg)) * jitter).max(1.0) as u64
    }

    /// The share of `gpu` a launch occupies while it runs (its blocks over
    /// the blocks the device holds at once, at most 1): kernels of one
    /// process on different streams run side by side while they fit.
    pub fn occupancy(&self, gpu: &GpuSpec, l: Launch) -> f64 {
        let resident = gpu.sm_count as u64 * self.blocks_per_sm(gpu, l);
        (l.blocks() as f64 / resident as f64).min(1.0)
    }

    /// Blocks one SM holds at once: the tightest of threads, registers and
    /// shared memory, 1 to 32.
    fn blocks_per_sm(&self, gpu: &GpuSpec, l: Launch) -> u64 {
        let threads = l.threads();
        let by_threads = gpu.max_threads_per_sm as u64 / threads;
        let by_regs = REGS_PER_SM / (u64::from(self.regs.max(1)) * threads);
        let smem = u64::from(self.smem) + u64::from(l.shared);
        let by_smem = shared_per_sm(gpu).checked_div(smem).unwrap_or(u64::MAX);
        by_threads
            .min(by_regs)
            .min(by_smem)
            .clamp(1, MAX_RESIDENT_BLOCKS)
    }

    /// Parses one declaration's `<name> <law> key=value ...` (the part
    /// after [`DECLARATION`]).
    pub fn parse(decl: &str) -> Result<(String, Law), String> {
        let mut words = decl.split_whitespace();
        let name = words.next().ok_or("no kernel name")?.to_string();
        let kind = words.next().ok_or("no law")?;
        let mut kv = std::collections::HashMap::new();
        for w in words {
            let (k, v) = w.split_once('=').ok_or(format!("{w:?} is not key=value"))?;
            let v: f64 = v
                .parse()
                .map_err(|_| format!("{k}: {v:?} is not a number"))?;
            if !v.is_finite() || v < 0.0 {
                return Err(format!("{k}: {v} must be a finite number >= 0"));
            }
            kv.insert(k, v);
        }
        let mut take = |k: &str, default: f64| kv.remove(k).unwrap_or(default);
        let regs = take("regs", 32.0).clamp(1.0, 255.0) as u32;
        let smem = take("smem", 0.0) as u32;
        let noise = take("noise", 0.0).min(0.99);
        let arg_ns = take("arg_ns", 0.0);
        let shape = match kind {
            "waves" => Shape::Waves {
                block_ns: take("block_ns", 10_000.0),
                tail: take("tail", 1.0).min(1.0),
            },
            "per_block" => Shape::PerBlock {
                ns: take("ns", 1_000.0),
                launch_ns: take("launch_ns", 2_000.0),
            },
            "bandwidth" => Shape::Bandwidth {
                bytes_per_block: take("bytes_per_block", 65_536.0),
                gbps: take("gbps", 1_500.0).max(1e-3),
                saturate_threads: take("saturate_threads", 110_592.0).max(1.0),
                launch_ns: take("launch_ns", 3_000.0),
            },
            "fixed" => Shape::Fixed {
                ns: take("ns", 100_000.0),
            },
            other => return Err(format!("unknown law {other:?}")),
        };
        if let Some(k) = kv.keys().next() {
            return Err(format!("law {kind} has no parameter {k:?}"));
        }
        Ok((
            name,
            Law {
                shape,
                noise,
                arg_ns,
                regs,
                smem,
            },
        ))
    }
}

/// splitmix64's finaliser: every bit of `h` reaches every bit.
fn mix(mut h: u64) -> u64 {
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Shared memory of one SM by compute capability (what a block may use).
fn shared_per_sm(gpu: &GpuSpec) -> u64 {
    match gpu.compute_capability() {
        (9, _) => 228 << 10,
        (8, 0) => 164 << 10,
        (8, _) => 100 << 10,
        _ => 96 << 10,
    }
}

/// The laws a module image declares (a PTX-like text), by kernel name;
/// malformed lines are reported, not fatal.
pub fn declared(image: &str) -> (Vec<(String, Law)>, Vec<String>) {
    let (mut laws, mut errors) = (Vec::new(), Vec::new());
    for line in image.lines() {
        if let Some(decl) = line.trim_start().strip_prefix(DECLARATION) {
            match Law::parse(decl) {
                Ok(l) => laws.push(l),
                Err(e) => errors.push(format!("{line:?}: {e}")),
            }
        }
    }
    (laws, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a100() -> GpuSpec {
        GpuSpec {
            name: "A100".into(),
            uuid: "GPU-x".into(),
            memory_mib: 1,
            sm_count: 108,
            max_threads_per_sm: 2048,
            compute_capability: "8.0".into(),
            pci_bus_id: "00000000:07:00.0".into(),
            minor: 0,
            numa_node: 0,
            power_limit_w: 400,
            context_overhead_mib: 0,
            mig: None,
        }
    }

    fn t(law: &str, grid: u32, threads: u32, shared: u32) -> u64 {
        let (_, l) = Law::parse(&format!("k {law}")).unwrap();
        l.duration_ns(
            &a100(),
            Launch::new([grid, 1, 1], [threads, 1, 1], shared),
            0,
        )
    }

    /// Kernel names as real libraries carry them (mangled).
    fn names() -> Vec<String> {
        (0..64)
            .map(|i| format!("_ZN2at6native29vectorized_elementwise_kernelILi{i}EEvi"))
            .collect()
    }

    #[test]
    fn binary_kernels_get_laws_their_launch_shape_does_not_show() {
        let gpu = a100();
        let laws: Vec<Law> = names()
            .iter()
            .map(|n| Law::undeclared(n, &gpu, 10_000))
            .collect();
        // A kernel's law is its own, the same at every load.
        assert_eq!(laws[7], Law::undeclared(&names()[7], &gpu, 10_000));
        let kinds = |f: fn(&Shape) -> bool| laws.iter().filter(|l| f(&l.shape)).count();
        assert!(kinds(|s| matches!(s, Shape::Waves { .. })) >= 16);
        assert!(kinds(|s| matches!(s, Shape::Bandwidth { .. })) >= 8);
        assert!(kinds(|s| matches!(s, Shape::Fixed { .. })) >= 8);
        assert!(laws.iter().any(|l| l.regs > 32) && laws.iter().any(|l| l.smem > 0));
        // One launch shape, 8 waves of 256-thread blocks as the threads
        // alone allow: what a wave-priced launch costs is the same for all,
        // what the device takes is not. The slowest takes over 4 times the
        // fastest per wave priced, and over a sixth of them (the grid-blind)
        // grow less than 4 times from 1 wave to 8.
        let at = |l: &Law, waves: u32| {
            l.duration_ns(
                &gpu,
                Launch::new([864 * waves, 1, 1], [256, 1, 1], 0),
                1 << 52,
            ) as f64
        };
        let per_wave: Vec<f64> = laws.iter().map(|l| at(l, 8) / 8.0).collect();
        let (lo, hi) = per_wave
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        assert!(hi > 4.0 * lo, "{lo} .. {hi} ns per wave");
        let flat = laws.iter().filter(|l| at(l, 8) < 4.0 * at(l, 1)).count();
        assert!(
            flat * 6 > laws.len(),
            "{flat} of {} grow slowly",
            laws.len()
        );
    }

    #[test]
    fn default_law_runs_full_waves_and_a_cheaper_tail() {
        let l = Law::default_for(10_000);
        let d = |g| l.duration_ns(&a100(), Launch::new([g, 1, 1], [256, 1, 1], 0), 0);
        // 108 SMs x 8 blocks of 256 threads = 864 per wave.
        assert_eq!(d(86_400), 1_000_000);
        assert_eq!(d(1), 5_005, "a lone block: half a wave and a bit");
        assert_eq!(d(864 + 432), 10_000 + 7_500);
    }

    #[test]
    fn registers_and_shared_memory_limit_occupancy() {
        assert_eq!(t("waves block_ns=1000", 864, 256, 0), 1_000);
        // 128 registers x 256 threads: 2 blocks per SM, not 8.
        assert_eq!(t("waves block_ns=1000 regs=128", 864, 256, 0), 4_000);
        // 48 KiB of dynamic shared memory: 3 blocks per SM of 164 KiB.
        assert_eq!(t("waves block_ns=1000", 324, 256, 48 << 10), 1_000);
        assert_eq!(t("waves block_ns=1000", 325, 256, 48 << 10), 2_000);
    }

    #[test]
    fn occupancy_is_the_share_of_resident_blocks() {
        let l = Law::default_for(10_000);
        let occ = |g, t| l.occupancy(&a100(), Launch::new([g, 1, 1], [t, 1, 1], 0));
        assert_eq!(occ(432, 256), 0.5);
        assert_eq!(occ(86_400, 256), 1.0);
        assert!(occ(1, 32) < 0.001);
    }

    #[test]
    fn other_laws() {
        assert_eq!(
            t("per_block ns=100 launch_ns=1000", 10_000, 256, 0),
            1_001_000
        );
        assert_eq!(t("fixed ns=7000", 1, 1, 0), 7_000);
        assert_eq!(t("fixed ns=7000", 100_000, 1024, 0), 7_000);
        // 1 GB/s = 1 byte/ns; 1000 threads saturate.
        let bw = "bandwidth bytes_per_block=1000 gbps=1 saturate_threads=1000 launch_ns=0";
        assert_eq!(t(bw, 1, 10, 0), 100_000, "latency-bound");
        assert_eq!(t(bw, 2, 10, 0), 100_000, "still latency-bound");
        assert_eq!(t(bw, 1000, 10, 0), 1_000_000, "saturated: linear");
    }

    #[test]
    fn noise_stays_within_its_band_and_averages_out() {
        let (_, l) = Law::parse("k fixed ns=1000 noise=0.5").unwrap();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut sum = 0;
        for _ in 0..10_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let d = l.duration_ns(&a100(), Launch::new([1; 3], [1; 3], 0), x);
            assert!((500..=1500).contains(&d), "{d}");
            sum += d;
        }
        assert!((sum as f64 / 10_000.0 - 1000.0).abs() < 20.0);
    }

    #[test]
    fn data_dependent_time_follows_the_first_parameter() {
        let (_, l) = Law::parse("k fixed ns=1000 arg_ns=10").unwrap();
        let d = |arg| l.duration_ns(&a100(), Launch::new([1; 3], [1; 3], 0).with_arg(arg), 0);
        assert_eq!(d(0), 1_000);
        assert_eq!(d(500), 6_000, "same shape, more data");
    }

    #[test]
    fn declarations_are_read_from_the_image_text() {
        let image = "// a module\n// gpu-sim kernel gemm waves block_ns=20000 regs=64\n\
                     .entry gemm\n  // gpu-sim kernel spin fixed ns=5\n\
                     // gpu-sim kernel bad waves block_ns=x\n// gpu-sim kernel odd warp\n";
        let (laws, errors) = declared(image);
        let names: Vec<_> = laws.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["gemm", "spin"]);
        assert_eq!(laws[0].1.regs, 64);
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(Law::parse("k waves bogus=1").is_err());
    }
}
