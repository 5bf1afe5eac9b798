//! The fixed 64-byte file header (SPEC §2).

/// `NFLASHPK`: the first 8 bytes of every pack.
pub const MAGIC: [u8; 8] = *b"NFLASHPK";
/// Format major version this build writes and reads.
pub const VERSION_MAJOR: u16 = 3;
/// Format minor version this build writes; packs with a larger minor are refused.
pub const VERSION_MINOR: u16 = 5;
/// Size of [`Header`] on disk, bytes.
pub const HEADER_BYTES: usize = 64;
/// Default segment alignment, bytes: 16 KiB so one file maps on 4 KiB and 16 KiB page devices.
pub const DEFAULT_ALIGNMENT: u32 = 16 * 1024;

/// The fixed header at offset 0. All integers little-endian (SPEC §2).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// [`MAGIC`].
    pub magic: [u8; 8],
    /// Format major version ([`VERSION_MAJOR`]).
    pub major: u16,
    /// Format minor version ([`VERSION_MINOR`]).
    pub minor: u16,
    /// Segment alignment in bytes; a power of two ≥ 4096.
    pub alignment: u32,
    /// Absolute offset of the manifest, bytes.
    pub manifest_offset: u64,
    /// Length of the manifest, bytes.
    pub manifest_bytes: u64,
    /// CRC32 (IEEE) of the manifest bytes.
    pub manifest_crc32: u32,
    /// Reserved flags, 0 in v1.
    pub flags: u32,
    /// Reserved, zero.
    pub reserved: [u8; 20],
    /// CRC32 (IEEE) of header bytes 0..60.
    pub header_crc32: u32,
}

const _: () = assert!(std::mem::size_of::<Header>() == HEADER_BYTES);

impl Header {
    /// Encodes to the on-disk little-endian form, filling `header_crc32`.
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..8].copy_from_slice(&self.magic);
        b[8..10].copy_from_slice(&self.major.to_le_bytes());
        b[10..12].copy_from_slice(&self.minor.to_le_bytes());
        b[12..16].copy_from_slice(&self.alignment.to_le_bytes());
        b[16..24].copy_from_slice(&self.manifest_offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.manifest_bytes.to_le_bytes());
        b[32..36].copy_from_slice(&self.manifest_crc32.to_le_bytes());
        b[36..40].copy_from_slice(&self.flags.to_le_bytes());
        b[40..60].copy_from_slice(&self.reserved);
        let crc = crc32fast::hash(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes the on-disk form. Performs no validation beyond layout; the
    /// reader checks magic, version, CRC and ranges.
    pub fn from_bytes(b: &[u8; HEADER_BYTES]) -> Header {
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let mut magic = [0u8; 8];
        magic.copy_from_slice(&b[0..8]);
        let mut reserved = [0u8; 20];
        reserved.copy_from_slice(&b[40..60]);
        Header {
            magic,
            major: u16_at(8),
            minor: u16_at(10),
            alignment: u32_at(12),
            manifest_offset: u64_at(16),
            manifest_bytes: u64_at(24),
            manifest_crc32: u32_at(32),
            flags: u32_at(36),
            reserved,
            header_crc32: u32_at(60),
        }
    }

    /// CRC32 of header bytes 0..60 as they would be written.
    pub fn computed_crc32(b: &[u8; HEADER_BYTES]) -> u32 {
        crc32fast::hash(&b[0..60])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SPEC.md describes the version this crate writes (its title and §2).
    #[test]
    fn the_spec_states_this_version() {
        let spec = include_str!("../SPEC.md");
        let title = spec.lines().next().unwrap_or_default();
        assert!(title.ends_with(&format!("version {VERSION_MAJOR}.{VERSION_MINOR}")), "SPEC.md title: {title}");
    }

    #[test]
    fn header_roundtrip() {
        let h = Header {
            magic: MAGIC,
            major: 1,
            minor: 0,
            alignment: DEFAULT_ALIGNMENT,
            manifest_offset: 123456,
            manifest_bytes: 789,
            manifest_crc32: 0xdeadbeef,
            flags: 0,
            reserved: [0; 20],
            header_crc32: 0,
        };
        let b = h.to_bytes();
        let back = Header::from_bytes(&b);
        assert_eq!(back.manifest_offset, 123456);
        assert_eq!(back.header_crc32, Header::computed_crc32(&b));
        assert_eq!(&b[0..8], b"NFLASHPK");
    }
}
