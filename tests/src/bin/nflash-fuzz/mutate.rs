//! Mutations of valid inputs, each a pure function of the input bytes and
//! a seeded random stream, so any input can be made again from its number.

use rand::rngs::StdRng;
use rand::Rng;
use serde_json::Value;

/// What was done to a seed file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// 1 to 8 random bytes XORed with random non-zero masks.
    Flip,
    /// Cut at a random length.
    Truncate,
    /// An extreme integer written at an 8-byte-aligned offset of a header
    /// or table, walking every such offset in turn.
    Extreme,
    /// The start of one seed file joined to the end of another.
    Splice,
    /// A JSON value replaced by an extreme or mistyped one (JSON files);
    /// byte flips elsewhere.
    Json,
}

impl Kind {
    pub const ALL: [Kind; 5] = [Kind::Flip, Kind::Truncate, Kind::Extreme, Kind::Splice, Kind::Json];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Flip => "flip",
            Kind::Truncate => "truncate",
            Kind::Extreme => "extreme",
            Kind::Splice => "splice",
            Kind::Json => "json",
        }
    }
}

/// Integers written by [`Kind::Extreme`]: each as a little-endian `u64`
/// and, at the odd steps, as a `u32` (in the low half of the slot).
pub fn extremes(file_len: u64) -> [u64; 12] {
    [
        0,
        1,
        0xff,
        0x7fff_ffff,
        0xffff_ffff,
        1 << 32,
        i64::MAX as u64,
        u64::MAX,
        1 << 63,
        file_len,
        file_len + 1,
        u64::MAX - 63,
    ]
}

/// Byte ranges of the valid pack at `path` that hold headers and tables
/// (where [`Kind::Extreme`] writes): its header, manifest and checksum table.
pub fn pack_tables(path: &std::path::Path) -> Vec<(usize, usize)> {
    let p = nflash_format::Pack::open(path).expect("seed packs are valid");
    let h = p.header();
    let mut v = vec![(0, 64), (h.manifest_offset as usize, (h.manifest_offset + h.manifest_bytes) as usize)];
    for s in p.manifest().segments.iter().filter(|s| s.kind == nflash_format::SegmentKind::ClusterChecksums) {
        v.push((s.offset as usize, (s.offset + s.bytes) as usize));
    }
    v
}

/// The header of a safetensors file: its 8-byte length and JSON.
pub fn safetensors_tables(bytes: &[u8]) -> Vec<(usize, usize)> {
    let n = bytes.get(..8).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()) as usize);
    vec![(0, 8usize.saturating_add(n).min(bytes.len()))]
}

/// Recomputes a damaged pack's header and manifest CRCs (where the header
/// still frames a manifest inside the file), so the damage reaches the
/// checks behind them: validation of the manifest's values and ranges.
pub fn fix_pack_crcs(bytes: &mut [u8]) {
    if bytes.len() < 64 {
        return;
    }
    let off = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
    let len = u64::from_le_bytes(bytes[24..32].try_into().unwrap());
    if let Some(end) = off.checked_add(len).filter(|&e| e <= bytes.len() as u64) {
        let crc = crc32fast::hash(&bytes[off as usize..end as usize]);
        bytes[32..36].copy_from_slice(&crc.to_le_bytes());
    }
    let crc = crc32fast::hash(&bytes[..60]);
    bytes[60..64].copy_from_slice(&crc.to_le_bytes());
}

/// Every 8-byte-aligned offset inside `tables` (`[n]`).
pub fn aligned_offsets(tables: &[(usize, usize)]) -> Vec<usize> {
    tables.iter().flat_map(|&(a, b)| (a.next_multiple_of(8)..b.saturating_sub(7)).step_by(8)).collect()
}

/// XORs 1 to 8 random bytes (never with 0).
pub fn flip(bytes: &mut [u8], rng: &mut StdRng) {
    if bytes.is_empty() {
        return;
    }
    for _ in 0..rng.random_range(1..=8) {
        let i = rng.random_range(0..bytes.len());
        bytes[i] ^= rng.random_range(1..=255u8);
    }
}

/// Cuts `bytes` at a random length: anywhere, or near the end (the manifest).
pub fn truncate(bytes: &mut Vec<u8>, rng: &mut StdRng) {
    let n = bytes.len();
    let keep =
        if rng.random_bool(0.5) { rng.random_range(0..n.max(1)) } else { n - rng.random_range(1..=n.clamp(1, 256)) };
    bytes.truncate(keep);
}

/// Writes extreme integer number `step` of the walk over `offsets` × [`extremes`].
pub fn extreme(bytes: &mut [u8], offsets: &[usize], step: u64) {
    if offsets.is_empty() {
        return;
    }
    let values = extremes(bytes.len() as u64);
    let at = offsets[(step % offsets.len() as u64) as usize];
    let vi = (step / offsets.len() as u64) as usize;
    let v = values[vi % values.len()];
    if (vi / values.len()) % 2 == 1 {
        bytes[at..at + 4].copy_from_slice(&(v as u32).to_le_bytes());
    } else {
        bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
}

/// The start of `a` (random length) followed by the end of `b` (random start).
pub fn splice(a: &[u8], b: &[u8], rng: &mut StdRng) -> Vec<u8> {
    let cut_a = rng.random_range(0..=a.len());
    let cut_b = rng.random_range(0..=b.len());
    [&a[..cut_a], &b[cut_b..]].concat()
}

/// Replaces one value of a JSON document (any depth) with an extreme or
/// mistyped one, or removes an object key; `None` if `bytes` is not JSON.
pub fn json(bytes: &[u8], rng: &mut StdRng) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(bytes).ok()?;
    let mut paths = Vec::new();
    collect(&v, &mut Vec::new(), &mut paths);
    let path = paths.get(rng.random_range(0..paths.len().max(1)))?.clone();
    let replacements = [
        serde_json::json!(-1),
        serde_json::json!(0),
        serde_json::json!(1),
        serde_json::json!(2_147_483_648u64),
        serde_json::json!(4_294_967_297u64),
        serde_json::json!(9_007_199_254_740_993u64),
        serde_json::json!(u64::MAX),
        serde_json::json!(1e308),
        serde_json::json!(-1e308),
        serde_json::json!(0.5),
        serde_json::json!("x"),
        serde_json::json!(""),
        Value::Null,
        serde_json::json!(true),
        serde_json::json!([]),
        serde_json::json!({}),
        serde_json::json!("w".repeat(4096)),
    ];
    let pick = rng.random_range(0..=replacements.len());
    let target = locate(&mut v, &path)?;
    if pick == replacements.len() {
        // Remove the key (or empty the array element) instead.
        *target = Value::Null;
        remove_last(&mut v, &path);
    } else {
        *target = replacements[pick].clone();
    }
    serde_json::to_vec_pretty(&v).ok()
}

/// Paths (keys and indices) to every value of `v`, the root excluded.
fn collect(v: &Value, at: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    // Large arrays (a vocabulary, a weight map) get a few sampled entries, not all.
    match v {
        Value::Object(m) => {
            for (k, c) in m.iter().take(64) {
                at.push(Step::Key(k.clone()));
                out.push(at.clone());
                collect(c, at, out);
                at.pop();
            }
        }
        Value::Array(a) => {
            for i in [0, 1, a.len() / 2, a.len().saturating_sub(1)] {
                if i < a.len()
                    && !out.iter().any(|p| {
                        p.len() == at.len() + 1 && p[..at.len()] == at[..] && p.last() == Some(&Step::Index(i))
                    })
                {
                    at.push(Step::Index(i));
                    out.push(at.clone());
                    collect(&a[i], at, out);
                    at.pop();
                }
            }
        }
        _ => {}
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Key(String),
    Index(usize),
}

fn locate<'v>(v: &'v mut Value, path: &[Step]) -> Option<&'v mut Value> {
    path.iter().try_fold(v, |v, s| match s {
        Step::Key(k) => v.get_mut(k.as_str()),
        Step::Index(i) => v.get_mut(*i),
    })
}

fn remove_last(v: &mut Value, path: &[Step]) {
    let Some((last, parent)) = path.split_last() else { return };
    if let (Some(p), Step::Key(k)) = (locate(v, parent), last) {
        if let Some(m) = p.as_object_mut() {
            m.remove(k);
        }
    }
}

/// The header fields of a valid GGUF file ([`nflash_tests::gguf_layout`])
/// and each tensor's `ne` fields apart (for [`gguf_overflow`]): where
/// llama.cpp's GGUF loader had its integer overflows (n_tensors × size,
/// n_dims, array and string lengths, `ne` products).
pub fn gguf_fields(b: &[u8]) -> (Vec<(usize, usize)>, Vec<Vec<usize>>) {
    let l = nflash_tests::gguf_layout(b);
    (l.fields, l.tensors.into_iter().map(|t| t.1).collect())
}

/// Writes extreme integer number `step` of the walk over the GGUF header
/// `fields` × [`extremes`], at each field's width.
pub fn gguf_extreme(bytes: &mut [u8], fields: &[(usize, usize)], step: u64) {
    if fields.is_empty() {
        return;
    }
    let values = extremes(bytes.len() as u64);
    let (at, w) = fields[(step % fields.len() as u64) as usize];
    let v = values[(step / fields.len() as u64) as usize % values.len()];
    bytes[at..at + w].copy_from_slice(&v.to_le_bytes()[..w]);
}

/// Makes one tensor's element count overflow: two of its dimensions set to
/// large values whose product wraps (`2^32 · 2^32`, `2^62 · 4`, …), or one
/// dimension so large that its byte size wraps.
pub fn gguf_overflow(bytes: &mut [u8], dims: &[Vec<usize>], rng: &mut StdRng) {
    let Some(ne) = dims.get(rng.random_range(0..dims.len().max(1))) else { return };
    const PAIRS: [(u64, u64); 5] =
        [(1 << 32, 1 << 32), (1 << 62, 4), (u64::MAX / 2 + 1, 2), (1 << 61, 1 << 3), (3, 1 << 63)];
    let (a, b) = PAIRS[rng.random_range(0..PAIRS.len())];
    match ne.as_slice() {
        [] => {}
        [only] => bytes[*only..*only + 8].copy_from_slice(&(1u64 << 62).to_le_bytes()),
        [x, y, ..] => {
            bytes[*x..*x + 8].copy_from_slice(&a.to_le_bytes());
            bytes[*y..*y + 8].copy_from_slice(&b.to_le_bytes());
        }
    }
}
