//! `cuGetProcAddress` as NVIDIA's drivers answer it, from recordings of the
//! real 535.261.03 and 550.163.01 drivers (`procaddr/<branch>.txt`, written
//! by tests/nvidia_oracle.rs from what those drivers answered, and checked
//! against them on every CI run) — not from cuda-abi's header table, which is
//! the interposer's: the interposer is tested against behaviour it did not
//! generate.
//!
//! What the recordings showed, beyond the per-name answers:
//! * `_v2` answers a name it does not have (or not at that version) with
//!   `CUDA_SUCCESS`, a NULL pointer and the `symbolStatus`; the CUDA 11.3
//!   entry with `CUDA_ERROR_NOT_FOUND`, its pointer left untouched;
//! * a version above the driver's own is answered as the driver's newest:
//!   a 12.2 driver asked at 12.8 hands out `cuCtxCreate_v3`;
//! * `cuGraphInstantiate` at 12.0 and later is `cuGraphInstantiate_v2`;
//! * with the per-thread flag, a name that has a per-thread variant is not
//!   found below that variant's version (`cuEventRecord` at 2.0);
//! * full symbol names ("cuMemAlloc_v2") are not found.
//!
//! A node whose driver branch has no recording (570, 580) is answered from
//! the newest older recording, extended where it cannot know: a name it does
//! not have, or a version above its CUDA version, takes the header table's
//! variant at the node's own CUDA version (an extrapolation, said here).

use cuda_abi::ProcStatus;
use std::collections::HashMap;
use std::sync::OnceLock;

/// The recordings: (driver branch, text).
const RECORDINGS: &[(u32, &str)] = &[
    (535, include_str!("../procaddr/535.txt")),
    (550, include_str!("../procaddr/550.txt")),
];

type Answer = Result<&'static str, ProcStatus>;

/// One driver's answers: per base name, per flag (0, 1, 2), the steps
/// (from cudaVersion, answer), ascending.
struct Recording {
    branch: u32,
    /// The recorded driver's CUDA version (12020 for 535).
    cuda: i32,
    names: HashMap<&'static str, [Vec<(i32, Answer)>; 3]>,
}

fn parse(branch: u32, text: &'static str) -> Recording {
    let mut cuda = 0;
    let mut names: HashMap<&'static str, [Vec<(i32, Answer)>; 3]> = HashMap::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let f: Vec<&'static str> = line.split(' ').collect();
        if f[0] == "cuda" {
            cuda = f[1].parse().expect("recording: cuda <version>");
            continue;
        }
        let [name, flags, from, answer] = f[..] else {
            panic!("recording {branch}: bad line {line:?}");
        };
        let answer = match answer {
            "!1" => Err(ProcStatus::SymbolNotFound),
            "!2" => Err(ProcStatus::VersionNotSufficient),
            s => Ok(s),
        };
        let flags: usize = flags.parse().expect("recording: flags");
        let from = from.parse().expect("recording: version");
        names.entry(name).or_default()[flags].push((from, answer));
    }
    // Flag 1 (legacy stream) is recorded only where it differs from no flag.
    for steps in names.values_mut() {
        if steps[1].is_empty() {
            steps[1] = steps[0].clone();
        }
    }
    Recording {
        branch,
        cuda,
        names,
    }
}

fn recordings() -> &'static [Recording] {
    static R: OnceLock<Vec<Recording>> = OnceLock::new();
    R.get_or_init(|| RECORDINGS.iter().map(|&(b, t)| parse(b, t)).collect())
}

impl Recording {
    fn answer(&self, name: &str, version: i32, flags: u64) -> Answer {
        let Some(steps) = self.names.get(name) else {
            return Err(ProcStatus::SymbolNotFound);
        };
        let steps = &steps[(flags & 3).min(2) as usize];
        steps
            .iter()
            .rev()
            .find(|(from, _)| *from <= version)
            .or(steps.first())
            .map(|&(_, a)| a)
            .unwrap_or(Err(ProcStatus::SymbolNotFound))
    }
}

/// The exported symbol a driver of branch `driver_major` whose CUDA version
/// is `node_cuda` hands out for `name` asked at `version` with `flags`
/// (flags already checked), or why it hands out none.
pub fn answer(name: &str, version: i32, flags: u64, driver_major: u32, node_cuda: i32) -> Answer {
    let all = recordings();
    let rec = all
        .iter()
        .filter(|r| r.branch <= driver_major)
        .max_by_key(|r| r.branch)
        .unwrap_or(&all[0]);
    let recorded = rec.answer(name, version, flags);
    if rec.branch == driver_major || node_cuda <= rec.cuda {
        return recorded;
    }
    // Extrapolation for a driver newer than every recording.
    let unknown = recorded == Err(ProcStatus::SymbolNotFound);
    if unknown || version > rec.cuda {
        let asked = version.min(node_cuda);
        if let Ok(newer) = cuda_abi::resolve(name, asked, flags)
            && (unknown || cuda_abi::resolve(name, rec.cuda, flags) != Ok(newer))
        {
            return Ok(newer);
        }
    }
    recorded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recordings_parse_and_know_the_common_entries() {
        for r in recordings() {
            assert!(r.cuda >= 12020, "{}: cuda {}", r.branch, r.cuda);
            assert_eq!(r.answer("cuMemAlloc", 12000, 0), Ok("cuMemAlloc_v2"));
            assert_eq!(r.answer("cuMemAlloc", 2000, 0), Ok("cuMemAlloc"));
            assert_eq!(
                r.answer("cuLaunchKernel", 12000, 2),
                Ok("cuLaunchKernel_ptsz")
            );
            assert_eq!(r.answer("cuLaunchKernel", 12000, 1), Ok("cuLaunchKernel"));
            assert_eq!(
                r.answer("cuMemAlloc_v2", 12000, 0),
                Err(ProcStatus::SymbolNotFound)
            );
        }
    }

    #[test]
    fn an_old_driver_asked_for_a_newer_version_hands_out_its_newest() {
        assert_eq!(
            answer("cuCtxCreate", 12080, 0, 535, 12020),
            Ok("cuCtxCreate_v3")
        );
        assert_eq!(
            answer("cuGraphInstantiate", 12000, 0, 550, 12040),
            Ok("cuGraphInstantiate_v2")
        );
    }

    #[test]
    fn a_driver_newer_than_every_recording_extends_the_newest() {
        // 580 / CUDA 13.0: cuCtxCreate_v4 (12.5) exists there.
        assert_eq!(
            answer("cuCtxCreate", 13000, 0, 580, 13000),
            Ok("cuCtxCreate_v4")
        );
        assert_eq!(
            answer("cuCtxCreate", 12040, 0, 580, 13000),
            Ok("cuCtxCreate_v3")
        );
        assert_eq!(
            answer("cuMemAlloc", 13000, 0, 580, 13000),
            Ok("cuMemAlloc_v2")
        );
    }
}
