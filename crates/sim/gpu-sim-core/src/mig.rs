//! MIG (Multi-Instance GPU) geometry of the MIG-capable models, as data: the
//! GPU-instance profiles NVIDIA's driver offers on each, their placements,
//! and the compute-instance profiles inside a GPU instance.
//!
//! Sources:
//! - NVIDIA Multi-Instance GPU User Guide, "Supported MIG Profiles" and
//!   "Getting Started with MIG" (`nvidia-smi mig -lgip` / `-lgipp` output),
//!   docs.nvidia.com/datacenter/tesla/mig-user-guide/: names, instance
//!   counts, engine counts, placements `{0,1,..,6}:1`, `{0,2,4,6}:2`
//!   (1g.10gb on A100-40GB), `{0,2,4}:2`, `{0,4}:4`, `{0}:4`, `{0}:8`.
//! - H100 80GB `nvidia-smi mig -lgip` as printed by a driver (memory GiB,
//!   SMs, DEC/ENC/CE/JPEG/OFA per profile).
//! - nvml.h (NVIDIA/go-nvml gen/nvml/nvml.h): the `NVML_GPU_INSTANCE_PROFILE_*`
//!   and `NVML_COMPUTE_INSTANCE_PROFILE_*` indices.
//! - NVIDIA/go-nvml pkg/nvml/mock/gpus/h100.go: compute-instance placements
//!   inside a GPU instance.
//!
//! Placements count memory slices (8 per GPU, 7 usable by compute); a GPU
//! instance's `id` (what `nvmlGpuInstanceGetInfo` reports) is fixed here by
//! its placement ([`gi_id_of`]), so the same placement always gets the same
//! id, as the driver's slice ("swizzle") ids do.

/// NVML_GPU_INSTANCE_PROFILE_* indices (nvml.h).
pub const GI_PROFILE_1_SLICE: u32 = 0x0;
pub const GI_PROFILE_2_SLICE: u32 = 0x1;
pub const GI_PROFILE_3_SLICE: u32 = 0x2;
pub const GI_PROFILE_4_SLICE: u32 = 0x3;
pub const GI_PROFILE_7_SLICE: u32 = 0x4;
pub const GI_PROFILE_1_SLICE_REV1: u32 = 0x7;
pub const GI_PROFILE_1_SLICE_REV2: u32 = 0x9;
/// NVML_GPU_INSTANCE_PROFILE_COUNT: indices at or above are invalid.
pub const GI_PROFILE_COUNT: u32 = 0x12;
/// NVML_COMPUTE_INSTANCE_PROFILE_COUNT.
pub const CI_PROFILE_COUNT: u32 = 0x9;
/// Memory slices of a MIG-capable GPU (placements are within 0..8).
pub const MEMORY_SLICES: u32 = 8;
/// GPU-instance ids a GPU can have (the ids of [`gi_id_of`]: 0..=14).
pub const MAX_GI_IDS: usize = 15;
/// Compute instances one GPU instance can hold (a 7g holds seven 1c).
pub const MAX_CIS: usize = 7;

/// One GPU-instance profile of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GiProfile {
    /// NVML_GPU_INSTANCE_PROFILE_* index (the `profile` argument of
    /// `nvmlDeviceGetGpuInstanceProfileInfo`).
    pub index: u32,
    /// The driver's profile id (`info.id`, the `profileId` argument of
    /// create/list calls; what `nvidia-smi mig -lgip` prints as ID).
    pub id: u32,
    /// "1g.10gb", "1g.10gb+me", ...
    pub name: &'static str,
    /// Compute slices (the "1" of 1g).
    pub slices: u32,
    /// Most instances of this profile at once.
    pub instances: u32,
    pub sms: u32,
    pub memory_mib: u64,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpegs: u32,
    pub ofas: u32,
    /// Allowed placement starts (memory slices), each `placement_size` long.
    pub starts: &'static [u32],
    pub placement_size: u32,
}

/// A model's MIG geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigModel {
    /// The node-file key (`mig = "h100-80gb"`).
    pub key: &'static str,
    pub profiles: &'static [GiProfile],
}

const ONE_SLICE: &[u32] = &[0, 1, 2, 3, 4, 5, 6];
const TWO_SLICE: &[u32] = &[0, 2, 4];
const TWO_MEM_ONE_SLICE: &[u32] = &[0, 2, 4, 6];
const HALF: &[u32] = &[0, 4];
const WHOLE: &[u32] = &[0];

/// A profile row; engines (CE, DEC, ENC, JPEG, OFA) in one tuple.
#[allow(clippy::too_many_arguments)]
const fn p(
    index: u32,
    id: u32,
    name: &'static str,
    slices: u32,
    instances: u32,
    sms: u32,
    memory_mib: u64,
    engines: (u32, u32, u32, u32, u32),
    starts: &'static [u32],
    placement_size: u32,
) -> GiProfile {
    GiProfile {
        index,
        id,
        name,
        slices,
        instances,
        sms,
        memory_mib,
        copy_engines: engines.0,
        decoders: engines.1,
        encoders: engines.2,
        jpegs: engines.3,
        ofas: engines.4,
        starts,
        placement_size,
    }
}

use self::{
    GI_PROFILE_1_SLICE as P1, GI_PROFILE_1_SLICE_REV1 as P1ME, GI_PROFILE_1_SLICE_REV2 as P1X2,
    GI_PROFILE_2_SLICE as P2, GI_PROFILE_3_SLICE as P3, GI_PROFILE_4_SLICE as P4,
    GI_PROFILE_7_SLICE as P7,
};

/// A100-SXM4-40GB (108 SMs; 98 usable under MIG, 14 per slice).
const A100_40GB: &[GiProfile] = &[
    p(
        P1,
        19,
        "1g.5gb",
        1,
        7,
        14,
        4864,
        (1, 0, 0, 0, 0),
        ONE_SLICE,
        1,
    ),
    p(
        P1ME,
        20,
        "1g.5gb+me",
        1,
        1,
        14,
        4864,
        (1, 1, 0, 1, 1),
        ONE_SLICE,
        1,
    ),
    p(
        P1X2,
        15,
        "1g.10gb",
        1,
        4,
        14,
        9984,
        (1, 1, 0, 0, 0),
        TWO_MEM_ONE_SLICE,
        2,
    ),
    p(
        P2,
        14,
        "2g.10gb",
        2,
        3,
        28,
        9984,
        (2, 1, 0, 0, 0),
        TWO_SLICE,
        2,
    ),
    p(P3, 9, "3g.20gb", 3, 2, 42, 20096, (3, 2, 0, 0, 0), HALF, 4),
    p(P4, 5, "4g.20gb", 4, 1, 56, 20096, (4, 2, 0, 0, 0), WHOLE, 4),
    p(P7, 0, "7g.40gb", 7, 1, 98, 40448, (7, 5, 0, 1, 1), WHOLE, 8),
];

/// A100-SXM4-80GB: the 40GB geometry with twice the memory per slice.
const A100_80GB: &[GiProfile] = &[
    p(
        P1,
        19,
        "1g.10gb",
        1,
        7,
        14,
        9984,
        (1, 0, 0, 0, 0),
        ONE_SLICE,
        1,
    ),
    p(
        P1ME,
        20,
        "1g.10gb+me",
        1,
        1,
        14,
        9984,
        (1, 1, 0, 1, 1),
        ONE_SLICE,
        1,
    ),
    p(
        P1X2,
        15,
        "1g.20gb",
        1,
        4,
        14,
        20096,
        (1, 1, 0, 0, 0),
        TWO_MEM_ONE_SLICE,
        2,
    ),
    p(
        P2,
        14,
        "2g.20gb",
        2,
        3,
        28,
        20096,
        (2, 1, 0, 0, 0),
        TWO_SLICE,
        2,
    ),
    p(P3, 9, "3g.40gb", 3, 2, 42, 40448, (3, 2, 0, 0, 0), HALF, 4),
    p(P4, 5, "4g.40gb", 4, 1, 56, 40448, (4, 2, 0, 0, 0), WHOLE, 4),
    p(P7, 0, "7g.80gb", 7, 1, 98, 80896, (7, 5, 0, 1, 1), WHOLE, 8),
];

/// H100 80GB HBM3 (SXM5; 132 SMs).
const H100_80GB: &[GiProfile] = &[
    p(
        P1,
        19,
        "1g.10gb",
        1,
        7,
        16,
        9984,
        (1, 1, 0, 1, 0),
        ONE_SLICE,
        1,
    ),
    p(
        P1ME,
        20,
        "1g.10gb+me",
        1,
        1,
        16,
        9984,
        (1, 1, 0, 1, 1),
        ONE_SLICE,
        1,
    ),
    p(
        P1X2,
        15,
        "1g.20gb",
        1,
        4,
        26,
        20096,
        (1, 1, 0, 1, 0),
        TWO_MEM_ONE_SLICE,
        2,
    ),
    p(
        P2,
        14,
        "2g.20gb",
        2,
        3,
        32,
        20096,
        (2, 2, 0, 2, 0),
        TWO_SLICE,
        2,
    ),
    p(P3, 9, "3g.40gb", 3, 2, 60, 40448, (3, 3, 0, 3, 0), HALF, 4),
    p(P4, 5, "4g.40gb", 4, 1, 64, 40448, (4, 4, 0, 4, 0), WHOLE, 4),
    p(
        P7,
        0,
        "7g.80gb",
        7,
        1,
        132,
        81152,
        (8, 7, 0, 7, 1),
        WHOLE,
        8,
    ),
];

/// H200 141GB (SXM5; 132 SMs): the H100 geometry, more memory per slice.
const H200_141GB: &[GiProfile] = &[
    p(
        P1,
        19,
        "1g.18gb",
        1,
        7,
        16,
        16384,
        (1, 1, 0, 1, 0),
        ONE_SLICE,
        1,
    ),
    p(
        P1ME,
        20,
        "1g.18gb+me",
        1,
        1,
        16,
        16384,
        (1, 1, 0, 1, 1),
        ONE_SLICE,
        1,
    ),
    p(
        P1X2,
        15,
        "1g.35gb",
        1,
        4,
        26,
        33280,
        (1, 1, 0, 1, 0),
        TWO_MEM_ONE_SLICE,
        2,
    ),
    p(
        P2,
        14,
        "2g.35gb",
        2,
        3,
        32,
        33280,
        (2, 2, 0, 2, 0),
        TWO_SLICE,
        2,
    ),
    p(P3, 9, "3g.71gb", 3, 2, 60, 71424, (3, 3, 0, 3, 0), HALF, 4),
    p(P4, 5, "4g.71gb", 4, 1, 64, 71424, (4, 4, 0, 4, 0), WHOLE, 4),
    p(
        P7,
        0,
        "7g.141gb",
        7,
        1,
        132,
        142592,
        (8, 7, 0, 7, 1),
        WHOLE,
        8,
    ),
];

/// Every MIG-capable model the simulator knows, by node-file key.
pub const MODELS: &[MigModel] = &[
    MigModel {
        key: "a100-40gb",
        profiles: A100_40GB,
    },
    MigModel {
        key: "a100-80gb",
        profiles: A100_80GB,
    },
    MigModel {
        key: "h100-80gb",
        profiles: H100_80GB,
    },
    MigModel {
        key: "h200-141gb",
        profiles: H200_141GB,
    },
];

/// The model of a node-file key.
pub fn model(key: &str) -> Option<&'static MigModel> {
    MODELS.iter().find(|m| m.key == key)
}

impl MigModel {
    /// The profile of an NVML_GPU_INSTANCE_PROFILE_* index.
    pub fn by_index(&self, index: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.index == index)
    }
    /// The profile of a driver profile id (`info.id`).
    pub fn by_id(&self, id: u32) -> Option<&'static GiProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }
    /// Most GPU instances (and so MIG devices, one CI each) at once.
    pub fn max_instances(&self) -> u32 {
        self.profiles.iter().map(|p| p.instances).max().unwrap_or(0)
    }
}

/// A placement: `size` memory slices from `start`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub start: u32,
    pub size: u32,
}

impl Placement {
    /// Bit mask of the memory slices it occupies.
    pub fn mask(self) -> u32 {
        ((1u32 << self.size) - 1) << self.start
    }
}

impl GiProfile {
    pub fn placements(&self) -> impl Iterator<Item = Placement> + '_ {
        self.starts.iter().map(|&start| Placement {
            start,
            size: self.placement_size,
        })
    }
    /// Whether `pl` is one of this profile's placements.
    pub fn allows(&self, pl: Placement) -> bool {
        pl.size == self.placement_size && self.starts.contains(&pl.start)
    }
    /// The first of its placements that overlaps none of the memory slices
    /// in `used` (bit i = slice i): where a create without a placement goes.
    pub fn first_free(&self, used: u32) -> Option<Placement> {
        self.placements().find(|p| p.mask() & used == 0)
    }
    /// How many more instances fit beside `used`, `existing` of them of
    /// this profile already (its placements never overlap each other).
    pub fn remaining(&self, used: u32, existing: u32) -> u32 {
        let free = self.placements().filter(|p| p.mask() & used == 0).count() as u32;
        free.min(self.instances.saturating_sub(existing))
    }
    /// Compute-instance profiles inside an instance of this profile.
    pub fn ci_profiles(&'static self) -> impl Iterator<Item = CiProfile> {
        CI_SLICES
            .iter()
            .filter(|&&(_, s)| {
                s == self.slices || (s < self.slices && (s <= 2 || self.slices == 7))
            })
            .map(move |&(index, slices)| CiProfile {
                index,
                slices,
                gi: self,
            })
    }
    pub fn ci_profile(&'static self, index: u32) -> Option<CiProfile> {
        self.ci_profiles().find(|c| c.index == index)
    }
}

/// NVML_COMPUTE_INSTANCE_PROFILE_* index and compute slices: 1c, 2c, 3c,
/// 4c, 7c.
const CI_SLICES: &[(u32, u32)] = &[(0x0, 1), (0x1, 2), (0x2, 3), (0x3, 4), (0x4, 7)];

/// A compute-instance profile within a GPU-instance profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CiProfile {
    /// NVML_COMPUTE_INSTANCE_PROFILE_* index; also the profile's id.
    pub index: u32,
    pub slices: u32,
    pub gi: &'static GiProfile,
}

impl CiProfile {
    /// SMs: the GPU instance's share per compute slice (all of them for a
    /// CI that spans the GI).
    pub fn sms(&self) -> u32 {
        if self.slices == self.gi.slices {
            self.gi.sms
        } else {
            self.gi.sms / self.gi.slices * self.slices
        }
    }
    /// Placements (compute slices within the GI), as NVIDIA's go-nvml H100
    /// mock lists them: 1c at every slice, 2c at even slices, 3c at 0 and 4
    /// (at 0 only in a 3g), 4c and the full CI at 0.
    pub fn placements(&self) -> Vec<Placement> {
        let n = self.gi.slices;
        let starts: Vec<u32> = match self.slices {
            1 => (0..n).collect(),
            2 => (0..n).step_by(2).filter(|s| s + 2 <= n).collect(),
            3 => [0, 4].into_iter().filter(|s| s + 3 <= n).collect(),
            _ => vec![0],
        };
        starts
            .into_iter()
            .map(|start| Placement {
                start,
                size: self.slices,
            })
            .collect()
    }
    /// Most instances of this CI profile in one GI.
    pub fn instances(&self) -> u32 {
        self.placements().len() as u32
    }
    /// "1c.3g.40gb", or the GI's own name when it spans the GI (as
    /// `nvidia-smi -L` names MIG devices).
    pub fn device_name(&self) -> String {
        if self.slices == self.gi.slices {
            self.gi.name.to_string()
        } else {
            format!("{}c.{}", self.slices, self.gi.name)
        }
    }
}

/// The GPU-instance id of a placement: 0 for the whole GPU, 1 and 2 for
/// the halves (4:4, 0:4), 3..=6 for the quarters (0:2 .. 6:2), 7..=14 for
/// single slices. Fixed by placement, so it is the same in every process.
pub fn gi_id_of(pl: Placement) -> u32 {
    match pl.size {
        8 => 0,
        4 => {
            if pl.start == 4 {
                1
            } else {
                2
            }
        }
        2 => 3 + pl.start / 2,
        _ => 7 + pl.start,
    }
}

/// The placement of a GPU-instance id (inverse of [`gi_id_of`]).
pub fn placement_of_gi_id(id: u32) -> Option<Placement> {
    let (start, size) = match id {
        0 => (0, 8),
        1 => (4, 4),
        2 => (0, 4),
        3..=6 => ((id - 3) * 2, 2),
        7..=14 => (id - 7, 1),
        _ => return None,
    };
    Some(Placement { start, size })
}

/// "MIG-xxxxxxxx-xxxx-5xxx-yxxx-xxxxxxxxxxxx": stable for a GPU, GPU
/// instance and compute instance (a hash of the three), in the format of
/// the driver's MIG UUIDs.
pub fn mig_uuid(gpu_uuid: &str, gi: u32, ci: u32) -> String {
    let a = crate::fnv1a(format!("{gpu_uuid}/gi{gi}/ci{ci}").as_bytes());
    let b = crate::fnv1a(&a.to_le_bytes());
    let hex = format!("{a:016x}{b:016x}");
    let h = hex.as_bytes();
    let s = |r: std::ops::Range<usize>| std::str::from_utf8(&h[r]).unwrap_or("0");
    let variant = ["8", "9", "a", "b"][(b & 3) as usize];
    format!(
        "MIG-{}-{}-5{}-{variant}{}-{}",
        s(0..8),
        s(8..12),
        s(13..16),
        s(17..20),
        s(20..32)
    )
}

#[cfg(test)]
mod tests;
