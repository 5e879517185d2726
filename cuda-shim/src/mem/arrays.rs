//! What arrays and pitched allocations are charged: from their
//! descriptors, before the driver is called.

/// `CUDA_ARRAY_DESCRIPTOR` (`_v2`: size_t extents).
#[repr(C)]
pub struct ArrayDesc {
    pub width: usize,
    pub height: usize,
    pub format: u32,
    pub num_channels: u32,
}

/// The legacy `CUDA_ARRAY_DESCRIPTOR_v1` (unsigned int extents).
#[repr(C)]
pub struct ArrayDescV1 {
    pub width: u32,
    pub height: u32,
    pub format: u32,
    pub num_channels: u32,
}

/// `CUDA_ARRAY3D_DESCRIPTOR` (`_v2`).
#[repr(C)]
pub struct Array3dDesc {
    pub width: usize,
    pub height: usize,
    pub depth: usize,
    pub format: u32,
    pub num_channels: u32,
    pub flags: u32,
}

/// The legacy `CUDA_ARRAY3D_DESCRIPTOR_v1`.
#[repr(C)]
pub struct Array3dDescV1 {
    pub width: u32,
    pub height: u32,
    pub depth: u32,
    pub format: u32,
    pub num_channels: u32,
    pub flags: u32,
}

const CUDA_ARRAY3D_LAYERED: u32 = 0x01;
const CUDA_ARRAY3D_CUBEMAP: u32 = 0x04;

/// Bytes per element of one channel of a `CUarray_format`. Block-compressed
/// and video formats are charged one byte per pixel or more (over, never
/// under, the real size); unknown formats 16 bytes.
pub fn format_bytes(format: u32) -> u64 {
    match format {
        0x01 | 0x08 => 1,               // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2,        // (UN)SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4,        // (UN)SIGNED_INT32, FLOAT
        0xc0 | 0xc6 => 1,               // UNORM/SNORM_INT8X1
        0xc1 | 0xc7 | 0xc3 | 0xc9 => 2, // INT8X2, INT16X1
        0xc2 | 0xc8 | 0xc4 | 0xca => 4, // INT8X4, INT16X2
        0xc5 | 0xcb => 8,               // INT16X4
        0x91..=0x9e => 1,               // BC1..BC7 (<= 1 byte per pixel)
        0xb0 => 2,                      // NV12 (1.5 bytes per pixel)
        _ => 16,
    }
}

/// Bytes of an array of `w` x `h` x `d` elements (0 extents count as 1).
pub fn array_bytes(w: u64, h: u64, d: u64, format: u32, channels: u32) -> u64 {
    w.max(1)
        .saturating_mul(h.max(1))
        .saturating_mul(d.max(1))
        .saturating_mul(format_bytes(format))
        .saturating_mul(u64::from(channels.max(1)))
}

/// Bytes of a mipmapped array: every level halves each extent (but not the
/// layer count of layered or cubemap arrays).
pub fn mipmapped_bytes(desc: &Array3dDesc, levels: u32) -> u64 {
    let keep_depth = desc.flags & (CUDA_ARRAY3D_LAYERED | CUDA_ARRAY3D_CUBEMAP) != 0;
    let (w, h, d) = (desc.width as u64, desc.height as u64, desc.depth as u64);
    (0..levels.clamp(1, 64)).fold(0u64, |acc, l| {
        let half = |x: u64| if x == 0 { 0 } else { (x >> l).max(1) };
        let dd = if keep_depth { d } else { half(d) };
        acc.saturating_add(array_bytes(
            half(w),
            half(h),
            dd,
            desc.format,
            desc.num_channels,
        ))
    })
}

/// Pitch the driver will most likely choose: rows padded to 512 bytes.
pub fn pitch_estimate(width: u64, height: u64) -> u64 {
    width
        .div_ceil(512)
        .saturating_mul(512)
        .saturating_mul(height.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_sizes() {
        assert_eq!(array_bytes(1024, 0, 0, 0x20, 4), 16 * 1024);
        assert_eq!(array_bytes(64, 64, 4, 0x01, 1), 64 * 64 * 4);
        assert_eq!(format_bytes(0x10), 2);
        assert_eq!(format_bytes(0x7f), 16, "unknown formats are charged high");
        let d = Array3dDesc {
            width: 256,
            height: 256,
            depth: 0,
            format: 0x01,
            num_channels: 1,
            flags: 0,
        };
        assert_eq!(mipmapped_bytes(&d, 1), 65536);
        assert_eq!(mipmapped_bytes(&d, 3), 65536 + 16384 + 4096);
        let layered = Array3dDesc {
            depth: 6,
            flags: CUDA_ARRAY3D_LAYERED,
            ..d
        };
        assert_eq!(mipmapped_bytes(&layered, 2), 6 * 65536 + 6 * 16384);
        assert_eq!(pitch_estimate(100, 10), 5120);
    }
}
