//! A checked reader of GGUF files (v2 and v3): metadata, tensor infos,
//! alignment and tensor data, as the GGUF specification
//! (ggml `docs/gguf.md`) and llama.cpp's `ggml/src/gguf.cpp` define them.
//!
//! nflash reads GGUF with this reader, not candle-core's `gguf_file`: that
//! one keeps the last of two tensors or keys of one name without a word,
//! turns invalid UTF-8 into U+FFFD, holds every metadata array element as a
//! 32-byte `Value` (a file of N bytes can ask for 32·N), and its errors name
//! neither the key, the tensor nor the offset. Here every count is capped
//! and checked against the bytes left in the file before anything is
//! allocated, all arithmetic is checked, and each error names the key or
//! tensor and the byte offset where it was read.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};

/// `GGUF` as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// At most this many tensors (llama.cpp's largest models hold a few thousand).
pub const MAX_TENSORS: u64 = 1 << 20;
/// At most this many metadata key-value pairs.
pub const MAX_KV: u64 = 1 << 20;
/// At most this many elements in one metadata array (vocabularies and merge
/// lists hold a few hundred thousand).
pub const MAX_ARRAY: u64 = 1 << 24;
/// At most this many metadata array elements in all (each is held in 8 to
/// 32 bytes of memory, so a file of many small arrays cannot ask for more
/// than a few hundred MiB).
pub const MAX_ARRAY_TOTAL: u64 = 1 << 25;
/// At most this many bytes in one string (chat templates are kilobytes).
pub const MAX_STRING: u64 = 64 << 20;
/// A tensor name is shorter than this (ggml's `GGML_MAX_NAME`).
pub const MAX_NAME: usize = 64;
/// At most this many dimensions (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// The data alignment without `general.alignment` (GGUF spec).
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A ggml tensor type (ggml.h `enum ggml_type`), by its number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: Self = Self(0);
    pub const F16: Self = Self(1);
    pub const Q4_0: Self = Self(2);
    pub const Q4_1: Self = Self(3);
    pub const Q5_0: Self = Self(6);
    pub const Q5_1: Self = Self(7);
    pub const Q8_0: Self = Self(8);
    pub const Q2_K: Self = Self(10);
    pub const Q3_K: Self = Self(11);
    pub const Q4_K: Self = Self(12);
    pub const Q5_K: Self = Self(13);
    pub const Q6_K: Self = Self(14);
    pub const BF16: Self = Self(30);

    /// ggml's name of the type (`ggml_type_name`), or `type N` for a number ggml does not define.
    pub fn name(self) -> String {
        const NAMES: [&str; 43] = [
            "F32",
            "F16",
            "Q4_0",
            "Q4_1",
            "Q4_2",
            "Q4_3",
            "Q5_0",
            "Q5_1",
            "Q8_0",
            "Q8_1",
            "Q2_K",
            "Q3_K",
            "Q4_K",
            "Q5_K",
            "Q6_K",
            "Q8_K",
            "IQ2_XXS",
            "IQ2_XS",
            "IQ3_XXS",
            "IQ1_S",
            "IQ4_NL",
            "IQ3_S",
            "IQ2_S",
            "IQ4_XS",
            "I8",
            "I16",
            "I32",
            "I64",
            "F64",
            "IQ1_M",
            "BF16",
            "Q4_0_4_4",
            "Q4_0_4_8",
            "Q4_0_8_8",
            "TQ1_0",
            "TQ2_0",
            "IQ4_NL_4_4",
            "IQ4_NL_4_8",
            "IQ4_NL_8_8",
            "MXFP4",
            "NVFP4",
            "Q1_0",
            "Q2_0",
        ];
        NAMES.get(self.0 as usize).map_or_else(|| format!("unknown ({})", self.0), |n| (*n).to_string())
    }

    /// `(elements per block, bytes per block)` of the types nflash reads:
    /// F32/F16/BF16, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and Q2_K–Q6_K (ggml
    /// `type_traits`); `None` for any other.
    pub fn block(self) -> Option<(u64, u64)> {
        Some(match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q2_K => (256, 84),
            Self::Q3_K => (256, 110),
            Self::Q4_K => (256, 144),
            Self::Q5_K => (256, 176),
            Self::Q6_K => (256, 210),
            _ => return None,
        })
    }

    /// Why nflash cannot read a tensor of this type (for a type [`Self::block`] refuses).
    fn refusal(self) -> String {
        let n = self.name();
        if n.starts_with("IQ") || n.starts_with("TQ") || matches!(n.as_str(), "MXFP4" | "NVFP4" | "Q1_0" | "Q2_0") {
            format!("{n} is a codebook or sub-4-bit type nflash has no kernels for and cannot requantize faithfully; use a GGUF of Q4_0, Q8_0, a K-quant, F16, BF16 or F32")
        } else if n.starts_with("unknown") {
            format!("{n} is not a ggml type this reader knows (ggml.h defines 0..42); is the file from a newer llama.cpp, or corrupt?")
        } else {
            format!(
                "{n} is not a type GGUF weights are stored as; use a GGUF of Q4_0, Q8_0, a K-quant, F16, BF16 or F32"
            )
        }
    }
}

/// A metadata value (GGUF `gguf_metadata_value_t`). Arrays keep their
/// element type; integers and floats of every width are widened.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// u8, u16, u32, u64 (as read; u64 above `i64::MAX` stays `U64`).
    U64(u64),
    /// i8, i16, i32, i64.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// A bool (1 byte, 0 or 1).
    Bool(bool),
    /// A UTF-8 string.
    Str(String),
    /// An array of one element type (arrays of arrays are refused, as llama.cpp refuses them).
    Array(MetaArray),
}

/// The elements of a metadata array, by kind.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaArray {
    /// Unsigned and signed integers and bools, widened to i64 (u64 elements above `i64::MAX` are refused).
    Int(Vec<i64>),
    /// f32 or f64 elements.
    Float(Vec<f64>),
    /// Strings.
    Str(Vec<String>),
}

impl MetaValue {
    /// The value as an unsigned integer (any integer type, non-negative).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U64(v) => Some(v),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// The value as a float (any float or integer type).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F64(v) => Some(v),
            Self::U64(v) => Some(v as f64),
            Self::I64(v) => Some(v as f64),
            _ => None,
        }
    }
    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }
    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Str(v) => Some(v),
            _ => None,
        }
    }
    /// What the value is, for errors: `u64`, `string`, `array of 3 strings`.
    pub fn kind(&self) -> String {
        match self {
            Self::U64(_) => "an unsigned integer".into(),
            Self::I64(_) => "a signed integer".into(),
            Self::F64(_) => "a float".into(),
            Self::Bool(_) => "a bool".into(),
            Self::Str(_) => "a string".into(),
            Self::Array(MetaArray::Int(v)) => format!("an array of {} integers", v.len()),
            Self::Array(MetaArray::Float(v)) => format!("an array of {} floats", v.len()),
            Self::Array(MetaArray::Str(v)) => format!("an array of {} strings", v.len()),
        }
    }
}

/// One tensor of the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// The tensor's GGUF name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Its type.
    pub ggml: GgmlType,
    /// ggml's `ne`: elements per dimension, fastest-varying first
    /// (`[in_features, out_features]` for a weight matrix).
    pub ne: Vec<u64>,
    /// Absolute byte offset of its data in the file.
    pub offset: u64,
    /// Its data size, bytes.
    pub bytes: u64,
}

impl TensorInfo {
    /// The shape in row-major order (`ne` reversed), as safetensors and
    /// nflash give shapes: `[out_features, in_features]`.
    pub fn shape(&self) -> Vec<usize> {
        self.ne.iter().rev().map(|&n| n as usize).collect()
    }
    /// Bytes of one row (`ne[0]` elements).
    pub fn row_bytes(&self) -> u64 {
        let (per, size) = self.ggml.block().expect("checked at open");
        self.ne.first().copied().unwrap_or(1) / per * size
    }
}

/// An opened GGUF file: its metadata and tensor infos; data is read on demand with `pread`.
pub struct GgufFile {
    /// The file.
    pub path: PathBuf,
    file: File,
    /// Metadata, by key.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Tensors in file order.
    pub tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

/// A reader that counts the bytes it has read and knows how many are left.
struct Counted<R> {
    inner: R,
    pos: u64,
    len: u64,
}

impl<R: Read> Counted<R> {
    fn left(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }
    fn bytes(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<Vec<u8>> {
        if n > self.left() {
            bail!(
                "{} needs {n} bytes at offset {}, but only {} are left: the file is truncated",
                what(),
                self.pos,
                self.left()
            );
        }
        let mut buf = vec![0u8; n as usize];
        self.inner.read_exact(&mut buf).with_context(|| format!("cannot read {} at offset {}", what(), self.pos))?;
        self.pos += n;
        Ok(buf)
    }
    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let v = self.bytes(N as u64, what)?;
        Ok(v.try_into().expect("N bytes"))
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn string(&mut self, max: u64, what: &dyn Fn() -> String) -> Result<String> {
        let at = self.pos;
        let n = self.u64(&|| format!("the length of {}", what()))?;
        if n > max {
            bail!("{} at offset {at} claims {n} bytes, more than the cap of {max}: the file is corrupt", what());
        }
        let bytes = self.bytes(n, what)?;
        String::from_utf8(bytes).map_err(|e| {
            anyhow!(
                "{} at offset {at} is not UTF-8 (invalid byte at {}): the file is corrupt",
                what(),
                at + 8 + e.utf8_error().valid_up_to() as u64
            )
        })
    }
}

/// GGUF value type numbers (`gguf_metadata_value_type`).
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// Bytes one element of value type `t` takes at least (`None`: not a type).
fn min_size(t: u32) -> Option<u64> {
    Some(match t {
        T_U8 | T_I8 | T_BOOL => 1,
        T_U16 | T_I16 => 2,
        T_U32 | T_I32 | T_F32 => 4,
        T_U64 | T_I64 | T_F64 | T_STRING => 8,
        T_ARRAY => 12,
        _ => return None,
    })
}

/// One scalar of type `t` (not an array).
fn scalar<R: Read>(r: &mut Counted<R>, t: u32, key: &str) -> Result<MetaValue> {
    let what = || format!("metadata key {key:?}");
    Ok(match t {
        T_U8 => MetaValue::U64(u8::from_le_bytes(r.array(&what)?) as u64),
        T_I8 => MetaValue::I64(i8::from_le_bytes(r.array(&what)?) as i64),
        T_U16 => MetaValue::U64(u16::from_le_bytes(r.array(&what)?) as u64),
        T_I16 => MetaValue::I64(i16::from_le_bytes(r.array(&what)?) as i64),
        T_U32 => MetaValue::U64(u32::from_le_bytes(r.array(&what)?) as u64),
        T_I32 => MetaValue::I64(i32::from_le_bytes(r.array(&what)?) as i64),
        T_U64 => MetaValue::U64(u64::from_le_bytes(r.array(&what)?)),
        T_I64 => MetaValue::I64(i64::from_le_bytes(r.array(&what)?)),
        T_F32 => MetaValue::F64(f32::from_le_bytes(r.array(&what)?) as f64),
        T_F64 => MetaValue::F64(f64::from_le_bytes(r.array(&what)?)),
        T_BOOL => {
            let at = r.pos;
            match r.array::<1>(&what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => bail!("metadata key {key:?}: bool at offset {at} is {b}, not 0 or 1: the file is corrupt"),
            }
        }
        T_STRING => MetaValue::Str(r.string(MAX_STRING, &what)?),
        _ => unreachable!("checked by the caller"),
    })
}

/// The value of metadata key `key`, of type `t`; `budget` is the number of
/// array elements the file may still hold ([`MAX_ARRAY_TOTAL`]).
fn value<R: Read>(r: &mut Counted<R>, t: u32, key: &str, at: u64, budget: &mut u64) -> Result<MetaValue> {
    if min_size(t).is_none() {
        bail!("metadata key {key:?} at offset {at} has value type {t}, which GGUF does not define (0..=12): the file is corrupt");
    }
    if t != T_ARRAY {
        return scalar(r, t, key);
    }
    let et = r.u32(&|| format!("the element type of metadata array {key:?}"))?;
    let n_at = r.pos;
    let n = r.u64(&|| format!("the length of metadata array {key:?}"))?;
    let Some(min) = min_size(et) else {
        bail!("metadata array {key:?} at offset {at} has element type {et}, which GGUF does not define: the file is corrupt");
    };
    if et == T_ARRAY {
        bail!("metadata key {key:?} at offset {at} is an array of arrays, which GGUF readers (llama.cpp) refuse");
    }
    if n > MAX_ARRAY {
        bail!("metadata array {key:?} at offset {n_at} claims {n} elements, more than the cap of {MAX_ARRAY}: the file is corrupt");
    }
    if n > *budget {
        bail!("metadata array {key:?} at offset {n_at} brings the metadata arrays to more than {MAX_ARRAY_TOTAL} elements in all: the file is corrupt");
    }
    *budget -= n;
    // Checked before allocating: n elements need at least n·min bytes.
    if n * min > r.left() {
        bail!(
            "metadata array {key:?} at offset {n_at} claims {n} elements ({} bytes at least), but only {} bytes are left: the file is truncated or corrupt",
            n * min,
            r.left()
        );
    }
    let n = n as usize;
    Ok(MetaValue::Array(match et {
        T_STRING => {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                v.push(r.string(MAX_STRING, &|| format!("element {i} of metadata array {key:?}"))?);
            }
            MetaArray::Str(v)
        }
        T_F32 | T_F64 => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(scalar(r, et, key)?.as_f64().expect("float"));
            }
            MetaArray::Float(v)
        }
        _ => {
            let mut v = Vec::with_capacity(n);
            for i in 0..n {
                v.push(match scalar(r, et, key)? {
                    MetaValue::I64(x) => x,
                    MetaValue::Bool(b) => b as i64,
                    MetaValue::U64(x) => i64::try_from(x).map_err(|_| {
                        anyhow!("element {i} of metadata array {key:?} is {x}, beyond the range nflash reads: the file is corrupt")
                    })?,
                    _ => unreachable!("integer types"),
                });
            }
            MetaArray::Int(v)
        }
    }))
}

impl GgufFile {
    /// Opens `path` and reads its header: metadata and tensor infos. Tensor
    /// data is not read.
    ///
    /// # Errors
    /// Not a GGUF file (magic), a version other than 2 or 3, a count above
    /// its cap or beyond the file, a string that is not UTF-8, a duplicated
    /// key or tensor name, a nested array, an unknown value type, a tensor
    /// type nflash does not read (IQ types, named), a shape whose size
    /// overflows, an offset that is not aligned or runs past the end of the
    /// file. Each names the key or tensor and the byte offset.
    pub fn open(path: &Path) -> Result<Self> {
        if let Some(kind) = nflash_format::reader::special_file_kind(path) {
            bail!("{} is {kind}, not a file; pass a .gguf file", path.display());
        }
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let len = file.metadata().with_context(|| format!("cannot stat {}", path.display()))?.len();
        let r = Counted { inner: BufReader::with_capacity(1 << 16, file.try_clone()?), pos: 0, len };
        Self::parse(r, file, path).with_context(|| format!("GGUF file {}", path.display()))
    }

    fn parse<R: Read>(mut r: Counted<R>, file: File, path: &Path) -> Result<Self> {
        let magic = r.u32(&|| "the GGUF magic".into())?;
        if magic != MAGIC {
            bail!("not a GGUF file: it starts with {:02x?}, not \"GGUF\"", magic.to_le_bytes());
        }
        let version = r.u32(&|| "the GGUF version".into())?;
        if !(2..=3).contains(&version) {
            bail!("GGUF version {version} is not supported (nflash reads versions 2 and 3; version 1 files predate 2023: convert the model again with a current llama.cpp)");
        }
        let n_tensors = r.u64(&|| "the tensor count".into())?;
        let n_kv = r.u64(&|| "the metadata count".into())?;
        if n_tensors > MAX_TENSORS {
            bail!("the header claims {n_tensors} tensors, more than the cap of {MAX_TENSORS}: the file is corrupt");
        }
        if n_kv > MAX_KV {
            bail!("the header claims {n_kv} metadata pairs, more than the cap of {MAX_KV}: the file is corrupt");
        }
        // A key-value pair takes at least 8 + 4 + 1 bytes, a tensor info 8 + 4 + 4 + 8.
        let least = n_kv * 13 + n_tensors * 24;
        if least > r.left() {
            bail!(
                "the header claims {n_tensors} tensors and {n_kv} metadata pairs ({least} bytes at least), but only {} bytes follow: the file is truncated or corrupt",
                r.left()
            );
        }

        let mut metadata = BTreeMap::new();
        let mut budget = MAX_ARRAY_TOTAL;
        for i in 0..n_kv {
            let at = r.pos;
            let key = r.string(1 << 16, &|| format!("metadata key {i}"))?;
            if key.is_empty() {
                bail!("metadata key {i} at offset {at} is empty: the file is corrupt");
            }
            let t = r.u32(&|| format!("the type of metadata key {key:?}"))?;
            let v = value(&mut r, t, &key, at, &mut budget)?;
            if metadata.insert(key.clone(), v).is_some() {
                bail!("metadata key {key:?} at offset {at} appears twice: the file is corrupt");
            }
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(MetaValue::U64(a)) if a.is_power_of_two() && *a <= 1 << 20 => *a,
            Some(MetaValue::U64(a)) => bail!(
                "metadata key \"general.alignment\" is {a}; nflash reads powers of two up to 1 MiB (GGUF spec: a power of two): the file is corrupt"
            ),
            Some(v) => bail!("metadata key \"general.alignment\" is {}, not an unsigned integer (GGUF spec: a u32)", v.kind()),
        };

        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut by_name = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors {
            let at = r.pos;
            let name = r.string(MAX_NAME as u64, &|| format!("the name of tensor {i}"))?;
            if name.len() >= MAX_NAME {
                bail!(
                    "the name of tensor {i} at offset {at} has {} bytes; ggml allows at most {}",
                    name.len(),
                    MAX_NAME - 1
                );
            }
            let what = || format!("tensor {name:?} (tensor info at offset {at})");
            let n_dims = r.u32(&what)?;
            if n_dims > MAX_DIMS {
                bail!("{} has {n_dims} dimensions; ggml allows at most {MAX_DIMS}: the file is corrupt", what());
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                let d = r.u64(&what)?;
                if d > i64::MAX as u64 {
                    bail!("{} has a dimension of {d} elements: the file is corrupt", what());
                }
                ne.push(d);
            }
            let ggml = GgmlType(r.u32(&what)?);
            let rel = r.u64(&what)?;
            let Some((per, size)) = ggml.block() else {
                bail!("{} is of ggml type {}: {}", what(), ggml.name(), ggml.refusal());
            };
            let elems = ne.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or_else(|| {
                anyhow!("{} has shape {ne:?}, whose element count overflows: the file is corrupt", what())
            })?;
            let row = ne.first().copied().unwrap_or(1);
            if !row.is_multiple_of(per) {
                bail!(
                    "{} has {row} elements per row, not a multiple of {}'s block of {per}: the file is corrupt",
                    what(),
                    ggml.name()
                );
            }
            let bytes = (elems / per).checked_mul(size).ok_or_else(|| {
                anyhow!("{} has shape {ne:?}, whose byte size overflows: the file is corrupt", what())
            })?;
            if rel % alignment != 0 {
                bail!(
                    "{} has data offset {rel}, not a multiple of the alignment {alignment}: the file is corrupt",
                    what()
                );
            }
            if by_name.insert(name.clone(), tensors.len()).is_some() {
                bail!("tensor {name:?} (tensor info at offset {at}) appears twice: the file is corrupt");
            }
            tensors.push(TensorInfo { name, ggml, ne, offset: rel, bytes });
        }
        // The data section starts at the next multiple of the alignment.
        let data_start = r.pos.div_ceil(alignment) * alignment;
        for t in &mut tensors {
            let end = data_start.checked_add(t.offset).and_then(|o| o.checked_add(t.bytes));
            match end {
                Some(end) if end <= r.len => t.offset += data_start,
                _ => bail!(
                    "tensor {:?} ({} bytes at data offset {}) runs past the end of the file ({} bytes): the file is truncated or corrupt; download it again",
                    t.name,
                    t.bytes,
                    t.offset,
                    r.len
                ),
            }
        }
        // No two tensors share bytes (llama.cpp requires them laid out one
        // after another): a tensor whose type or offset was damaged would
        // read its neighbour's data.
        let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.bytes > 0).collect();
        order.sort_by_key(|t| t.offset);
        for w in order.windows(2) {
            if w[0].offset + w[0].bytes > w[1].offset {
                bail!(
                    "tensors {:?} ({} bytes at file offset {}) and {:?} (at file offset {}) overlap: the file is corrupt",
                    w[0].name,
                    w[0].bytes,
                    w[0].offset,
                    w[1].name,
                    w[1].offset
                );
            }
        }
        Ok(Self { path: path.to_path_buf(), file, metadata, tensors, by_name })
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Reads `buf.len()` bytes of tensor `t` starting `at` bytes into its data.
    ///
    /// # Errors
    /// A range outside the tensor, or a read failure (naming the tensor and offset).
    pub fn read(&self, t: &TensorInfo, at: u64, buf: &mut [u8]) -> Result<()> {
        if at.checked_add(buf.len() as u64).is_none_or(|e| e > t.bytes) {
            bail!("bytes {at}..+{} of tensor {:?} are outside its {} bytes", buf.len(), t.name, t.bytes);
        }
        self.file.read_exact_at(buf, t.offset + at).with_context(|| {
            format!(
                "cannot read tensor {:?} at offset {} of {} (truncated or unreadable); download the file again",
                t.name,
                t.offset + at,
                self.path.display()
            )
        })
    }

    /// Metadata key `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// Metadata key `key` as an unsigned integer (any integer type, not
    /// negative); `None` where the key is absent.
    ///
    /// # Errors
    /// A value of another type or a negative one, naming the key.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a non-negative integer", MetaValue::as_u64)
    }

    /// Metadata key `key` as a string; `None` where the key is absent.
    ///
    /// # Errors
    /// A value of another type, naming the key.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", MetaValue::as_str)
    }

    /// Metadata key `key` as a bool; `None` where the key is absent.
    ///
    /// # Errors
    /// A value of another type, naming the key.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", MetaValue::as_bool)
    }

    fn typed<'a, T>(&'a self, key: &str, what: &str, read: impl Fn(&'a MetaValue) -> Option<T>) -> Result<Option<T>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => read(v).map(Some).ok_or_else(|| anyhow!("metadata key {key:?} is {}, not {what}", v.kind())),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A GGUF writer for tests, byte by byte, so that tests can write what
    /// no well-behaved writer would.
    #[derive(Default)]
    pub struct Builder {
        pub kv: Vec<u8>,
        pub n_kv: u64,
        pub infos: Vec<u8>,
        pub n_tensors: u64,
        pub data: Vec<u8>,
    }

    pub fn s(out: &mut Vec<u8>, v: &str) {
        out.extend((v.len() as u64).to_le_bytes());
        out.extend(v.as_bytes());
    }

    impl Builder {
        pub fn kv_raw(&mut self, key: &str, t: u32, payload: &[u8]) -> &mut Self {
            s(&mut self.kv, key);
            self.kv.extend(t.to_le_bytes());
            self.kv.extend(payload);
            self.n_kv += 1;
            self
        }
        pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
            let mut p = Vec::new();
            s(&mut p, v);
            self.kv_raw(key, T_STRING, &p)
        }
        pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.kv_raw(key, T_U32, &v.to_le_bytes())
        }
        pub fn kv_strs(&mut self, key: &str, v: &[&str]) -> &mut Self {
            let mut p = T_STRING.to_le_bytes().to_vec();
            p.extend((v.len() as u64).to_le_bytes());
            v.iter().for_each(|x| s(&mut p, x));
            self.kv_raw(key, T_ARRAY, &p)
        }
        /// A tensor of type `t` and `ne` whose data is `data`, placed at the next aligned offset.
        pub fn tensor(&mut self, name: &str, t: GgmlType, ne: &[u64], data: &[u8]) -> &mut Self {
            let off = self.data.len().div_ceil(32) * 32;
            self.data.resize(off, 0);
            self.data.extend(data);
            self.tensor_info(name, t.0, ne, off as u64)
        }
        pub fn tensor_info(&mut self, name: &str, t: u32, ne: &[u64], offset: u64) -> &mut Self {
            s(&mut self.infos, name);
            self.infos.extend((ne.len() as u32).to_le_bytes());
            ne.iter().for_each(|d| self.infos.extend(d.to_le_bytes()));
            self.infos.extend(t.to_le_bytes());
            self.infos.extend(offset.to_le_bytes());
            self.n_tensors += 1;
            self
        }
        pub fn bytes(&self) -> Vec<u8> {
            let mut out = MAGIC.to_le_bytes().to_vec();
            out.extend(3u32.to_le_bytes());
            out.extend(self.n_tensors.to_le_bytes());
            out.extend(self.n_kv.to_le_bytes());
            out.extend(&self.kv);
            out.extend(&self.infos);
            out.resize(out.len().div_ceil(32) * 32, 0);
            out.extend(&self.data);
            out
        }
    }

    fn parse(bytes: &[u8]) -> Result<GgufFile> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        std::fs::write(&p, bytes).unwrap();
        GgufFile::open(&p)
    }

    fn err(bytes: &[u8]) -> String {
        format!("{:#}", parse(bytes).err().expect("refused"))
    }

    fn good() -> Builder {
        let mut b = Builder::default();
        b.kv_str("general.architecture", "llama").kv_u32("llama.block_count", 2).kv_strs("tok", &["a", "é", ""]);
        b.tensor("w", GgmlType::F32, &[4, 2], &[0u8; 32]);
        b.tensor("q", GgmlType::Q8_0, &[32, 1], &[7u8; 34]);
        b
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let g = parse(&good().bytes()).unwrap();
        assert_eq!(g.get("general.architecture").and_then(MetaValue::as_str), Some("llama"));
        assert_eq!(g.get("llama.block_count").and_then(MetaValue::as_u64), Some(2));
        assert_eq!(g.get("tok"), Some(&MetaValue::Array(MetaArray::Str(vec!["a".into(), "é".into(), String::new()]))));
        let q = g.tensor("q").unwrap();
        assert_eq!((q.shape(), q.bytes, q.row_bytes()), (vec![1, 32], 34, 34));
        let mut buf = [0u8; 34];
        g.read(q, 0, &mut buf).unwrap();
        assert_eq!(buf, [7u8; 34]);
        assert!(g.read(q, 1, &mut buf).is_err());
        assert_eq!(g.tensor("w").unwrap().shape(), vec![2, 4]);
    }

    #[test]
    fn refuses_bad_headers_naming_what_and_where() {
        let ok = good().bytes();
        // Truncated anywhere: never a panic, always an error.
        for cut in 0..ok.len() {
            let e = err(&ok[..cut]);
            assert!(e.contains("GGUF file"), "{e}");
        }
        assert!(err(b"GGUX\x03\0\0\0").contains("not a GGUF file"));
        let mut v1 = ok.clone();
        v1[4] = 1;
        assert!(err(&v1).contains("version 1"));

        // Counts above the caps or beyond the file, before allocating.
        let mut n = ok.clone();
        n[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(err(&n).contains("tensors, more than the cap"));
        let mut n = ok.clone();
        n[16..24].copy_from_slice(&(1u64 << 19).to_le_bytes());
        assert!(err(&n).contains("bytes at least"));

        let mut b = good();
        b.kv_raw("arr", T_ARRAY, &[T_U8.to_le_bytes().as_slice(), &u64::MAX.to_le_bytes()].concat());
        assert!(err(&b.bytes()).contains("\"arr\" at offset"));
        let mut b = good();
        b.kv_raw("arr", T_ARRAY, &[T_STRING.to_le_bytes().as_slice(), &(1u64 << 23).to_le_bytes()].concat());
        assert!(err(&b.bytes()).contains("only"));
        let mut b = good();
        b.kv_raw("nested", T_ARRAY, &[T_ARRAY.to_le_bytes().as_slice(), &0u64.to_le_bytes()].concat());
        assert!(err(&b.bytes()).contains("array of arrays"));
        let mut b = good();
        b.kv_raw("long", T_STRING, &u64::MAX.to_le_bytes());
        assert!(err(&b.bytes()).contains("\"long\""));
        let mut b = good();
        b.kv_raw("bad", T_STRING, &[2u64.to_le_bytes().as_slice(), &[0xff, 0xfe]].concat());
        let e = err(&b.bytes());
        assert!(e.contains("\"bad\"") && e.contains("not UTF-8"), "{e}");
        let mut b = good();
        b.kv_raw("t", 13, &[]);
        assert!(err(&b.bytes()).contains("value type 13"));
        let mut b = good();
        b.kv_raw("flag", T_BOOL, &[2]);
        assert!(err(&b.bytes()).contains("not 0 or 1"));
        let mut b = good();
        b.kv_u32("llama.block_count", 3);
        assert!(err(&b.bytes()).contains("\"llama.block_count\" at offset"));
        let mut b = good();
        b.kv_u32("general.alignment", 48);
        assert!(err(&b.bytes()).contains("power of two"));

        // Tensors.
        let mut b = good();
        b.tensor("w", GgmlType::F32, &[4], &[0u8; 16]);
        assert!(err(&b.bytes()).contains("\"w\"") && err(&b.bytes()).contains("appears twice"));
        let mut b = good();
        b.tensor("iq", GgmlType(16), &[256], &[0u8; 66]);
        let e = err(&b.bytes());
        assert!(e.contains("\"iq\"") && e.contains("IQ2_XXS"), "{e}");
        let mut b = good();
        b.tensor_info("big", 0, &[1 << 40, 1 << 40], 0);
        assert!(err(&b.bytes()).contains("overflows"));
        let mut b = good();
        b.tensor_info("dims", 0, &[1, 1, 1, 1, 1], 0);
        assert!(err(&b.bytes()).contains("5 dimensions"));
        let mut b = good();
        b.tensor_info("past", 0, &[1024], 0);
        let e = err(&b.bytes());
        assert!(e.contains("\"past\"") && e.contains("runs past the end"), "{e}");
        let mut b = good();
        b.tensor_info("wrap", 0, &[8], u64::MAX - 31);
        assert!(err(&b.bytes()).contains("runs past the end"));
        let mut b = good();
        b.tensor_info("odd", 0, &[1], 3);
        assert!(err(&b.bytes()).contains("not a multiple of the alignment"));
        let mut b = good();
        b.tensor_info("rows", GgmlType::Q8_0.0, &[33], 0);
        assert!(err(&b.bytes()).contains("not a multiple of Q8_0's block"));
        let mut b = good();
        b.tensor_info(&"x".repeat(64), 0, &[1], 0);
        assert!(err(&b.bytes()).contains("at most 63"));
        // A quantized scalar (no dimensions): refused, not indexed.
        let mut b = good();
        b.tensor_info("scalar", GgmlType::Q8_0.0, &[], 0);
        assert!(err(&b.bytes()).contains("\"scalar\""));
        // Two tensors over the same bytes (an alias, or a damaged type).
        let mut b = good();
        b.tensor_info("alias", 0, &[8], 0);
        let e = err(&b.bytes());
        assert!(e.contains("overlap") && e.contains("\"alias\""), "{e}");
        // Many arrays each under the cap, together over the total cap.
        let mut b = good();
        let big = [T_U8.to_le_bytes().as_slice(), &(MAX_ARRAY).to_le_bytes(), &vec![0u8; MAX_ARRAY as usize]].concat();
        for k in 0..(MAX_ARRAY_TOTAL / MAX_ARRAY + 1) {
            b.kv_raw(&format!("a{k}"), T_ARRAY, &big);
        }
        assert!(err(&b.bytes()).contains("elements in all"));
        let mut b = good();
        b.tensor_info("t99", 99, &[1], 0);
        assert!(err(&b.bytes()).contains("ggml type unknown (99)"));
    }
}
