//! The runtime's integrity check (table `D4082055-BDE6-704B-8D34-BA123C66E1F2`,
//! slot 1): libcudart hands the driver a version and the time, and compares
//! the 16 bytes it gets back with its own computation over the same inputs.
//! What is hashed and how was published by ZLUDA's reverse engineering
//! (`dark_api/src/lib.rs`, `integrity_check`, in github.com/vosen/ZLUDA):
//! HMAC (RFC 2104) over MD2 (RFC 1319) with a fixed 16-byte key, of the
//! caller's inputs, the process, the thread, three addresses of the driver's
//! tables and every device's UUID and PCI location. Written here from those
//! facts and the RFCs. Runtimes 12.4 to 13.5 ask three times at start-up
//! (versions ending in 0, 1 and 2, e.g. 12040..12042) and fail everything
//! with cudaErrorSoftwareValidityNotEstablished on a wrong answer (tried by
//! flipping one bit): tests/sim_cudart.rs passing checks this hash.

/// MD2's substitution table (RFC 1319, section 3.2; from the digits of pi).
const S: [u8; 256] = [
    41, 46, 67, 201, 162, 216, 124, 1, 61, 54, 84, 161, 236, 240, 6, 19, 98, 167, 5, 243, 192, 199,
    115, 140, 152, 147, 43, 217, 188, 76, 130, 202, 30, 155, 87, 60, 253, 212, 224, 22, 103, 66,
    111, 24, 138, 23, 229, 18, 190, 78, 196, 214, 218, 158, 222, 73, 160, 251, 245, 142, 187, 47,
    238, 122, 169, 104, 121, 145, 21, 178, 7, 63, 148, 194, 16, 137, 11, 34, 95, 33, 128, 127, 93,
    154, 90, 144, 50, 39, 53, 62, 204, 231, 191, 247, 151, 3, 255, 25, 48, 179, 72, 165, 181, 209,
    215, 94, 146, 42, 172, 86, 170, 198, 79, 184, 56, 210, 150, 164, 125, 182, 118, 252, 107, 226,
    156, 116, 4, 241, 69, 157, 112, 89, 100, 113, 135, 32, 134, 91, 207, 101, 230, 45, 168, 2, 27,
    96, 37, 173, 174, 176, 185, 246, 28, 70, 97, 105, 52, 64, 126, 15, 85, 71, 163, 35, 221, 81,
    175, 58, 195, 92, 249, 206, 186, 197, 234, 38, 44, 83, 13, 110, 133, 40, 132, 9, 211, 223, 205,
    244, 65, 129, 77, 82, 106, 220, 55, 200, 108, 193, 171, 250, 36, 225, 123, 8, 12, 189, 177, 74,
    120, 136, 149, 139, 227, 99, 232, 109, 233, 203, 213, 254, 59, 0, 29, 57, 242, 239, 183, 14,
    102, 88, 208, 228, 166, 119, 114, 248, 235, 117, 75, 10, 49, 68, 80, 180, 143, 237, 31, 26,
    219, 153, 141, 51, 159, 17, 131, 20,
];

/// Streaming MD2 (RFC 1319): 16-byte blocks, a 48-byte state, a checksum.
#[derive(Clone)]
struct Md2 {
    x: [u8; 48],
    checksum: [u8; 16],
    block: [u8; 16],
    len: usize,
}

impl Md2 {
    fn new() -> Md2 {
        Md2 {
            x: [0; 48],
            checksum: [0; 16],
            block: [0; 16],
            len: 0,
        }
    }

    fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.block[self.len] = b;
            self.len += 1;
            if self.len == 16 {
                self.compress();
                self.len = 0;
            }
        }
    }

    /// One block into the state and the checksum (with RFC 1319's erratum:
    /// the checksum byte is XORed, not replaced).
    fn compress(&mut self) {
        let mut l = self.checksum[15];
        for j in 0..16 {
            self.checksum[j] ^= S[usize::from(self.block[j] ^ l)];
            l = self.checksum[j];
        }
        for j in 0..16 {
            self.x[16 + j] = self.block[j];
            self.x[32 + j] = self.x[16 + j] ^ self.x[j];
        }
        let mut t = 0u8;
        for round in 0..18u8 {
            for k in 0..48 {
                self.x[k] ^= S[usize::from(t)];
                t = self.x[k];
            }
            t = t.wrapping_add(round);
        }
    }

    fn finish(mut self) -> [u8; 16] {
        let pad = (16 - self.len) as u8;
        self.update(&vec![pad; usize::from(pad)]);
        let checksum = self.checksum;
        self.update(&checksum);
        let mut out = [0; 16];
        out.copy_from_slice(&self.x[..16]);
        out
    }
}

/// HMAC-MD2 of `message` under `key` (one MD2 block long).
fn hmac_md2(key: &[u8; 16], message: &[u8]) -> [u8; 16] {
    let pad = |mask: u8| key.map(|b| b ^ mask);
    let mut inner = Md2::new();
    inner.update(&pad(0x36));
    inner.update(message);
    let inner = inner.finish();
    let mut outer = Md2::new();
    outer.update(&pad(0x5c));
    outer.update(&inner);
    outer.finish()
}

/// The runtime's key (ZLUDA: the result of the check's first pass, which
/// depends on no input).
const KEY: [u8; 16] = [
    0x14, 0x6A, 0xDD, 0xAE, 0x53, 0xA9, 0xA7, 0x52, 0xAA, 0x08, 0x41, 0x36, 0x0B, 0xF5, 0x5A, 0x9F,
];

/// What the check covers besides the devices, in the order hashed (the
/// layout of a C struct: four u32, three pointers, a u64; 48 bytes).
pub(crate) struct Inputs {
    pub driver_version: u32,
    pub version: u32,
    pub process: u32,
    pub thread: u32,
    pub cudart_table: usize,
    pub integrity_table: usize,
    pub check_fn: usize,
    pub unix_seconds: u64,
}

/// One device as hashed: its UUID, then PCI domain, bus and device.
pub(crate) struct DeviceInfo {
    pub uuid: [u8; 16],
    pub pci: [i32; 3],
}

/// The check's answer: two words, as the runtime reads them.
pub(crate) fn check(i: &Inputs, devices: &[DeviceInfo]) -> [u64; 2] {
    // Versions ending in 0 and 1 get fixed answers (older runtimes').
    match i.version % 10 {
        0 => return [0x3341181C03CB675C, 0x8ED383AA1F4CD1E8],
        1 => return [0x1841181C03CB675C, 0x8ED383AA1F4CD1E8],
        _ => {}
    }
    let mut m = Vec::with_capacity(48 + 28 * devices.len());
    for w in [i.driver_version, i.version, i.process, i.thread] {
        m.extend_from_slice(&w.to_le_bytes());
    }
    for p in [i.cudart_table, i.integrity_table, i.check_fn] {
        m.extend_from_slice(&(p as u64).to_le_bytes());
    }
    m.extend_from_slice(&i.unix_seconds.to_le_bytes());
    for d in devices {
        m.extend_from_slice(&d.uuid);
        for v in d.pci {
            m.extend_from_slice(&v.to_le_bytes());
        }
    }
    let h = hmac_md2(&KEY, &m);
    let word = |r: std::ops::Range<usize>| u64::from_le_bytes(h[r].try_into().unwrap());
    [word(0..8), word(8..16)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md2(data: &[u8]) -> String {
        let mut h = Md2::new();
        h.update(data);
        h.finish().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// RFC 1319's test suite (section A.5).
    #[test]
    fn md2_matches_rfc_1319() {
        assert_eq!(md2(b""), "8350e5a3e24c153df2275c9f80692773");
        assert_eq!(md2(b"a"), "32ec01ec4a6dac72c0ab96fb34c0b5d1");
        assert_eq!(md2(b"abc"), "da853b0d3f88d99b30283a69e6ded6bb");
        assert_eq!(
            md2(b"abcdefghijklmnopqrstuvwxyz"),
            "4e8ddff3650292ab5a4108c3aa47940b"
        );
        assert_eq!(
            md2(
                b"12345678901234567890123456789012345678901234567890123456789012345678901234567890"
            ),
            "d5976f79d83d3a0dc9806c3c66f3efd8"
        );
    }

    #[test]
    fn old_runtimes_get_fixed_answers() {
        let i = Inputs {
            driver_version: 12040,
            version: 120,
            process: 1,
            thread: 2,
            cudart_table: 3,
            integrity_table: 4,
            check_fn: 5,
            unix_seconds: 6,
        };
        assert_eq!(check(&i, &[])[0], 0x3341181C03CB675C);
        let i = Inputs { version: 121, ..i };
        assert_eq!(check(&i, &[])[0], 0x1841181C03CB675C);
        let i = Inputs { version: 122, ..i };
        let a = check(&i, &[]);
        let b = check(
            &i,
            &[DeviceInfo {
                uuid: [1; 16],
                pci: [0, 7, 0],
            }],
        );
        assert_ne!(a, b, "devices are hashed");
    }
}
