//! GGUF input for `prep convert`: the file's metadata as the Hugging Face
//! `config.json` nflash's checkpoint path parses (so one code path builds
//! the model config of both), its vocabulary as a `tokenizer.json`
//! ([`vocab`]), and its tensors under Hugging Face names, read as f32 or,
//! for Q4_0/Q8_0, as their blocks unchanged ([`GgufStore::blocks`]).

mod arch;
pub mod file;
mod vocab;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use serde_json::{json, Map, Value};

use file::{GgmlType, GgufFile, TensorInfo};
use nflash_format::ModelConfig;

/// Checks that `files` are the parts of one split GGUF, in order: each
/// part's `split.no`, and `split.count` and `split.tensors.count` in the
/// first (llama.cpp `llama_model_loader`).
///
/// # Errors
/// A part number, count or tensor total that does not match (named).
fn check_split(files: &[GgufFile]) -> Result<()> {
    let get = |f: &GgufFile, k: &str| f.opt_u64(k).with_context(|| f.path.display().to_string());
    let first = &files[0];
    let count = get(first, "split.count")?;
    if files.len() == 1 {
        if count.is_some_and(|n| n > 1) {
            bail!(
                "{} is part of a split GGUF (split.count {}), but its name is not PREFIX-00001-of-NNNNN.gguf: rename the parts as llama.cpp's gguf-split writes them",
                first.path.display(),
                count.unwrap_or(0)
            );
        }
        return Ok(());
    }
    if count != Some(files.len() as u64) {
        bail!(
            "{}: split.count is {}, but the file names say {} parts: the split GGUF is inconsistent",
            first.path.display(),
            count.map_or("missing".to_string(), |n| n.to_string()),
            files.len()
        );
    }
    for (i, f) in files.iter().enumerate() {
        let no = get(f, "split.no")?;
        if no != Some(i as u64) {
            bail!(
                "{}: split.no is {}, but it is part {} of {}: the split GGUF is inconsistent",
                f.path.display(),
                no.map_or("missing".to_string(), |n| n.to_string()),
                i + 1,
                files.len()
            );
        }
    }
    let total: usize = files.iter().map(|f| f.tensors.len()).sum();
    if let Some(n) = get(first, "split.tensors.count")? {
        if n != total as u64 {
            bail!(
                "{}: split.tensors.count is {n}, but the {} parts hold {total} tensors: a part is missing or damaged",
                first.path.display(),
                files.len()
            );
        }
    }
    Ok(())
}

/// Whether `path` names GGUF input: a `.gguf` file, or a directory holding
/// `.gguf` files and no `config.json`.
pub fn is_gguf(path: &Path) -> bool {
    if path.is_dir() {
        !path.join("config.json").exists() && gguf_files_in(path).is_ok_and(|v| !v.is_empty())
    } else {
        path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    }
}

fn gguf_files_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")))
        .collect();
    v.sort();
    Ok(v)
}

/// `(prefix, n)` of a split GGUF's part name `PREFIX-0000i-of-0000N.gguf` (llama.cpp `llama_split_path`).
fn split_name(path: &Path) -> Option<(String, u32, u32)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, n) = stem.rsplit_once("-of-")?;
    let (prefix, i) = rest.rsplit_once('-')?;
    if i.len() != 5 || n.len() != 5 {
        return None;
    }
    Some((prefix.to_string(), i.parse().ok()?, n.parse().ok()?))
}

/// The files of the model `path` names: one GGUF, or every part of a split
/// one (given its first part, or a directory holding one model).
///
/// # Errors
/// No GGUF in a directory, several models in one, a later part given
/// instead of the first, a missing part.
fn model_files(path: &Path) -> Result<Vec<PathBuf>> {
    let first = if path.is_dir() {
        let files = gguf_files_in(path)?;
        let firsts: Vec<&PathBuf> = files.iter().filter(|p| split_name(p).is_none_or(|(_, i, _)| i == 1)).collect();
        match firsts.as_slice() {
            [one] => (*one).clone(),
            [] => bail!("{} holds no .gguf file (or only later parts of a split one)", path.display()),
            many => bail!(
                "{} holds {} GGUF models ({}); pass the file to convert with --model",
                path.display(),
                many.len(),
                many.iter().map(|p| p.file_name().unwrap_or_default().to_string_lossy()).collect::<Vec<_>>().join(", ")
            ),
        }
    } else {
        path.to_path_buf()
    };
    if !first.exists() {
        bail!("{} does not exist; pass a .gguf file or a Hugging Face checkpoint directory", first.display());
    }
    let Some((prefix, i, n)) = split_name(&first) else { return Ok(vec![first]) };
    if i != 1 {
        bail!("{} is part {i} of a split GGUF; pass its first part, {prefix}-00001-of-{n:05}.gguf", first.display());
    }
    let dir = first.parent().unwrap_or(Path::new("."));
    let parts: Vec<PathBuf> = (1..=n).map(|k| dir.join(format!("{prefix}-{k:05}-of-{n:05}.gguf"))).collect();
    if let Some(missing) = parts.iter().find(|p| !p.exists()) {
        bail!("{} is missing: a split GGUF needs all {n} parts beside its first", missing.display());
    }
    Ok(parts)
}

/// Which rows of a GGUF tensor make a Hugging Face tensor.
#[derive(Debug, Clone, Copy)]
enum Rows {
    /// All, in order.
    All,
    /// Rows `row0 .. row0 + rows` (one expert of a stacked `*_exps` tensor,
    /// or one projection of a fused one).
    Range { row0: usize, rows: usize },
    /// llama.cpp's converter permuted the rows of each of `heads` heads of
    /// a `llama`-architecture Q or K projection for its RoPE
    /// (`LlamaModel.permute`: HF row `(h, p, j)` is GGUF row `(h, j, p)`,
    /// `p` in 0..2, `j` in 0..head_dim/2): the inverse.
    Unpermute { heads: usize },
}

/// A Hugging Face tensor nflash reads, as the GGUF stores it.
#[derive(Debug, Clone)]
struct Source {
    /// Index of the file (part) holding it; `None` where the GGUF lacks it.
    file: Option<usize>,
    /// Its GGUF tensor.
    tensor: String,
    rows: Rows,
}

/// An opened GGUF model: its parts, the Hugging Face-style config and
/// tokenizer built from its metadata, and its tensors by Hugging Face name.
pub struct GgufStore {
    files: Vec<GgufFile>,
    /// The HF tensor names and where each is stored.
    map: HashMap<String, Source>,
    /// GGUF tensors read into the config (Phi-3's LongRoPE factors).
    consumed: Vec<String>,
    /// `config.json` as Hugging Face would write it for this model.
    pub config_json: Value,
    /// `generation_config.json` (the special token ids).
    pub generation_json: Value,
    /// The tokenizer.
    pub tokenizer_json: Vec<u8>,
    /// `tokenizer_config.json`.
    pub tokenizer_config: Value,
}

impl GgufStore {
    /// Opens the GGUF model at `path` (a file, a split GGUF's first part, or a directory holding one).
    ///
    /// # Errors
    /// As [`GgufFile::open`] for each part; parts that do not make one
    /// model (split keys); an architecture nflash does not convert
    /// (named); missing or inconsistent metadata (named); a tensor stored
    /// in two parts; a tokenizer [`vocab::build`] refuses.
    pub fn open(path: &Path) -> Result<Self> {
        let paths = model_files(path)?;
        let files: Vec<GgufFile> = paths.iter().map(|p| GgufFile::open(p)).collect::<Result<_>>()?;
        check_split(&files)?;
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for t in &f.tensors {
                if let Some(j) = seen.insert(&t.name, i) {
                    bail!(
                        "tensor {:?} is stored in two parts, {} and {}: the split GGUF is inconsistent",
                        t.name,
                        files[j].path.display(),
                        f.path.display()
                    );
                }
            }
        }
        let g = &files[0];
        let vocab = vocab::build(g).with_context(|| format!("the tokenizer of {}", g.path.display()))?;
        let built = arch::build(&files, &seen, &vocab).with_context(|| format!("{}", g.path.display()))?;
        if vocab.eos.is_none() && vocab.eot.is_none() {
            nflash_runtime::message!(
                "warning: {} names no end-of-text token (tokenizer.ggml.eos_token_id); generation stops only at --max-tokens",
                g.path.display()
            );
        }
        let mut generation = Map::new();
        for (k, v) in [("bos_token_id", vocab.bos), ("eos_token_id", vocab.eos)] {
            if let Some(v) = v {
                generation.insert(k.into(), json!(v));
            }
        }
        if let (Some(eos), Some(eot)) = (vocab.eos, vocab.eot) {
            generation.insert("eos_token_id".into(), json!([eos, eot]));
        }
        drop(seen);
        Ok(Self {
            files,
            map: built.map,
            consumed: built.consumed,
            config_json: built.config,
            generation_json: Value::Object(generation),
            tokenizer_json: vocab.tokenizer_json,
            tokenizer_config: vocab.tokenizer_config,
        })
    }

    /// Maps the stacked expert tensors (`blk.N.ffn_{gate,up,down}_exps`,
    /// `[n_expert, rows, cols]`) and the routers (`blk.N.ffn_gate_inp`)
    /// onto the Hugging Face names `cfg` gives each expert's projections
    /// (`ModelConfig::ffn_tensor_names`) and router.
    pub fn map_experts(&mut self, cfg: &ModelConfig) {
        if cfg.architecture.moe().is_none() {
            return;
        }
        let (inter, h) = (cfg.intermediate_size as usize, cfg.hidden_size as usize);
        for u in 0..cfg.ffn_units() as usize {
            let (l, e) = cfg.unit_layer_expert(u);
            let names = cfg.ffn_tensor_names(u);
            for ((name, t), rows) in
                names.into_iter().zip(["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]).zip([inter, inter, h])
            {
                let tensor = format!("blk.{l}.{t}.weight");
                let file = self.file_of(&tensor);
                self.map.insert(name, Source { file, tensor, rows: Rows::Range { row0: e * rows, rows } });
            }
            if let Some(router) = cfg.router_name(l).filter(|_| e == 0) {
                let tensor = format!("blk.{l}.ffn_gate_inp.weight");
                let file = self.file_of(&tensor);
                self.map.insert(router, Source { file, tensor, rows: Rows::All });
            }
        }
    }

    fn file_of(&self, tensor: &str) -> Option<usize> {
        self.files.iter().position(|f| f.tensor(tensor).is_some())
    }

    /// The pack type that keeps the most of the model's weight matrices
    /// (the type of most 2-D tensors), and why: Q8_0 or Q4_0 for a GGUF of
    /// that type (their blocks are copied); Q8_0 for the types nflash has
    /// no kernels for (Q4_1, Q5_x, K-quants: a second 4-bit rounding would
    /// add as much error again); `None` for F32/F16/BF16 (the usual default).
    pub fn own_quant(&self) -> Option<(nflash_format::DType, &'static str)> {
        let mut counts: HashMap<GgmlType, usize> = HashMap::new();
        for t in self.files.iter().flat_map(|f| &f.tensors).filter(|t| t.ne.len() >= 2) {
            *counts.entry(t.ggml).or_default() += 1;
        }
        let (&most, _) = counts.iter().max_by_key(|(t, n)| (**n, t.0))?;
        match most {
            GgmlType::Q8_0 => Some((nflash_format::DType::Q8_0, "the GGUF's own type (its blocks are copied)")),
            GgmlType::Q4_0 => Some((nflash_format::DType::Q4_0, "the GGUF's own type (its blocks are copied)")),
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => None,
            _ => Some((
                nflash_format::DType::Q8_0,
                "since the GGUF's type has no nflash kernels and a second 4-bit rounding (q4_0) would add about as much error again",
            )),
        }
    }

    /// The first part's path (for messages).
    pub fn path(&self) -> &Path {
        &self.files[0].path
    }

    fn source(&self, name: &str) -> Result<(&Source, &GgufFile, &TensorInfo)> {
        let missing = |what: &str| {
            anyhow!(
                "tensor {what} is missing from {}: the GGUF lacks a tensor its metadata implies; the file is incomplete or corrupt",
                self.path().display()
            )
        };
        let s = self.map.get(name).ok_or_else(|| missing(name))?;
        let Some(i) = s.file else { return Err(missing(&format!("{} (nflash's {name})", s.tensor))) };
        let f = &self.files[i];
        let t = f.tensor(&s.tensor).expect("mapped tensors exist");
        Ok((s, f, t))
    }

    /// Whether the model has tensor `name` (a Hugging Face name).
    pub fn has(&self, name: &str) -> bool {
        self.map.get(name).is_some_and(|s| s.file.is_some())
    }

    /// Number of GGUF tensors.
    pub fn tensor_count(&self) -> usize {
        self.files.iter().map(|f| f.tensors.len()).sum()
    }

    /// The GGUF tensor `name` is read from.
    pub fn source_of<'n>(&'n self, name: &'n str) -> &'n str {
        self.map.get(name).map_or(name, |s| s.tensor.as_str())
    }

    /// The GGUF tensors none of `used` (GGUF names) is, sorted.
    pub fn unused_tensors(&self, used: &std::collections::HashSet<&str>) -> Vec<String> {
        let mut v: Vec<String> = self
            .files
            .iter()
            .flat_map(|f| f.tensors.iter().map(|t| t.name.clone()))
            .filter(|n| !used.contains(n.as_str()) && !self.consumed.contains(n))
            .collect();
        v.sort();
        v
    }

    /// The row-major shape of tensor `name` (HF name).
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let (s, _, t) = self.source(name)?;
        let shape = t.shape();
        Ok(match s.rows {
            // A stacked or fused tensor, `[n, rows, cols]` or `[n · rows, cols]`: its rows.
            Rows::Range { rows, .. } => vec![rows, *shape.last().unwrap_or(&1)],
            _ => shape,
        })
    }

    /// The GGUF type of tensor `name` (HF name).
    pub fn ggml_type(&self, name: &str) -> Result<GgmlType> {
        Ok(self.source(name)?.2.ggml)
    }

    /// The stored bytes of tensor `name`'s rows in Hugging Face order, checked to be `shape`.
    fn row_bytes(&self, name: &str, shape: &[usize]) -> Result<(GgmlType, Vec<u8>)> {
        let (s, f, t) = self.source(name)?;
        let have = self.shape(name)?;
        if have != shape {
            bail!(
                "tensor {} (for {name}) has shape {have:?} in {}, expected {shape:?} from the GGUF's metadata",
                t.name,
                f.path.display()
            );
        }
        // A vector's rows are its elements (a permuted bias).
        let (n_rows, rb) = if shape.len() == 1 {
            (shape[0], t.bytes as usize / shape[0].max(1))
        } else {
            (shape[..shape.len() - 1].iter().product(), t.row_bytes() as usize)
        };
        let mut out = vec![0u8; n_rows * rb];
        match s.rows {
            Rows::All => f.read(t, 0, &mut out)?,
            Rows::Range { row0, rows } => {
                let total = t.shape().iter().rev().skip(1).product::<usize>();
                if row0 + rows > total {
                    bail!(
                        "tensor {} has {total} rows; rows {row0}..{} are asked for: the file is corrupt",
                        t.name,
                        row0 + rows
                    );
                }
                f.read(t, (row0 * rb) as u64, &mut out)?
            }
            Rows::Unpermute { heads } => {
                let mut stored = vec![0u8; out.len()];
                f.read(t, 0, &mut stored)?;
                let hd = n_rows / heads;
                if !hd.is_multiple_of(2) || hd * heads != n_rows {
                    bail!("tensor {} has {n_rows} rows, not {heads} heads of an even size", t.name);
                }
                for (r, row) in out.chunks_exact_mut(rb).enumerate() {
                    let (h, p, j) = (r / hd, (r % hd) / (hd / 2), r % (hd / 2));
                    let g = h * hd + 2 * j + p;
                    row.copy_from_slice(&stored[g * rb..(g + 1) * rb]);
                }
            }
        }
        Ok((t.ggml, out))
    }

    /// Tensor `name` (HF name) as f32, checked to be `shape`; quantized
    /// types are dequantized (ggml's formulas, through candle-core).
    ///
    /// # Errors
    /// A missing tensor, another shape, a read failure.
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (ty, bytes) = self.row_bytes(name, shape)?;
        dequantize(ty, &bytes, shape.iter().product()).with_context(|| format!("tensor {}", self.source_of(name)))
    }

    /// Rows `rows` of the 2-D tensor `name` (`[rows.len(), shape[1]]`), as f32.
    ///
    /// # Errors
    /// As [`Self::tensor_f32`]; a row index ≥ `shape[0]`.
    pub fn rows_f32(&self, name: &str, shape: &[usize], rows: &[u32]) -> Result<Vec<f32>> {
        let (s, f, t) = self.source(name)?;
        let have = self.shape(name)?;
        if have != shape || shape.len() != 2 {
            bail!("tensor {} (for {name}) has shape {have:?}, expected {shape:?}", t.name);
        }
        let row0 = match s.rows {
            Rows::All => 0,
            Rows::Range { row0, .. } => row0,
            Rows::Unpermute { .. } => {
                let all = self.tensor_f32(name, shape)?;
                return Ok(rows.iter().flat_map(|&r| all[r as usize * shape[1]..][..shape[1]].to_vec()).collect());
            }
        };
        let rb = t.row_bytes() as usize;
        let mut buf = vec![0u8; rb];
        let mut out = Vec::with_capacity(rows.len() * shape[1]);
        for &r in rows {
            if r as usize >= shape[0] {
                bail!("row {r} of {name} is out of range: it has {} rows", shape[0]);
            }
            f.read(t, ((row0 + r as usize) * rb) as u64, &mut buf)?;
            out.extend(dequantize(t.ggml, &buf, shape[1]).with_context(|| format!("tensor {}", t.name))?);
        }
        Ok(out)
    }

    /// A fingerprint of the weights, 16 hex digits: CRC-32 (two seeds) over
    /// every tensor's name, type, shape and 64 bytes at the start, middle
    /// and end of its data. It tells two GGUF files of one shape apart (a
    /// fine-tune from its base) without reading gigabytes; profiles store it.
    ///
    /// # Errors
    /// Read failures, naming the file.
    pub fn fingerprint(&self) -> Result<String> {
        let mut all: Vec<(&GgufFile, &TensorInfo)> =
            self.files.iter().flat_map(|f| f.tensors.iter().map(move |t| (f, t))).collect();
        all.sort_by(|a, b| a.1.name.cmp(&b.1.name));
        let (mut a, mut b) = (crc32fast::Hasher::new(), crc32fast::Hasher::new_with_initial(0x9E37_79B9));
        let mut buf = [0u8; 64];
        for (f, t) in all {
            let head = format!("{}|{}|{:?}|", t.name, t.ggml.0, t.ne);
            a.update(head.as_bytes());
            b.update(head.as_bytes());
            let n = 64.min(t.bytes) as usize;
            for at in [0, t.bytes / 2, t.bytes - n as u64] {
                let n = n.min((t.bytes - at) as usize);
                f.read(t, at, &mut buf[..n])?;
                a.update(&buf[..n]);
                b.update(&buf[..n]);
            }
        }
        Ok(format!("{:08x}{:08x}", a.finalize(), b.finalize()))
    }

    /// Tensor `name`'s blocks as stored, in Hugging Face row order, when
    /// the GGUF stores it as `ty`; `None` when it stores another type.
    ///
    /// # Errors
    /// As [`Self::tensor_f32`].
    pub fn blocks(&self, name: &str, shape: &[usize], ty: GgmlType) -> Result<Option<Vec<u8>>> {
        if self.ggml_type(name)? != ty {
            return Ok(None);
        }
        Ok(Some(self.row_bytes(name, shape)?.1))
    }
}

/// Little-endian F32, F16 or BF16 bytes (`ty`) as f32 (also the
/// safetensors checkpoint's decoding).
pub fn decode_floats(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    match ty {
        GgmlType::F32 => bytes.par_chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        GgmlType::F16 => bytes.par_chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        GgmlType::BF16 => bytes.par_chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => unreachable!("{} is not a float type", other.name()),
    }
}

/// Bytes of GGUF type `ty` holding `n` elements, as f32.
///
/// # Errors
/// A byte count that does not match `n`, or a type without a dequantizer.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    let (per, size) = ty.block().ok_or_else(|| anyhow!("type {} cannot be read", ty.name()))?;
    if !(n as u64).is_multiple_of(per) || bytes.len() as u64 != n as u64 / per * size {
        bail!("{} bytes of {} do not hold {n} elements", bytes.len(), ty.name());
    }
    Ok(match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => decode_floats(ty, bytes),
        _ => {
            use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
            let dt = match ty {
                GgmlType::Q4_0 => GgmlDType::Q4_0,
                GgmlType::Q4_1 => GgmlDType::Q4_1,
                GgmlType::Q5_0 => GgmlDType::Q5_0,
                GgmlType::Q5_1 => GgmlDType::Q5_1,
                GgmlType::Q8_0 => GgmlDType::Q8_0,
                GgmlType::Q2_K => GgmlDType::Q2K,
                GgmlType::Q3_K => GgmlDType::Q3K,
                GgmlType::Q4_K => GgmlDType::Q4K,
                GgmlType::Q5_K => GgmlDType::Q5K,
                GgmlType::Q6_K => GgmlDType::Q6K,
                _ => unreachable!("block() lists these"),
            };
            // candle views the bytes as its block structs (alignment 2):
            // hand it a buffer aligned to 8.
            let mut words = vec![0u64; bytes.len().div_ceil(8)];
            let aligned = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()];
            aligned.copy_from_slice(bytes);
            let cpu = candle_core::Device::Cpu;
            let q = qtensor_from_ggml(dt, aligned, vec![n], &cpu)?;
            q.dequantize(&cpu)?.to_vec1::<f32>()?
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};

    #[test]
    fn every_readable_type_dequantizes_with_its_block_size() {
        // Blocks made by candle-core's quantizers (ggml's formulas), read
        // back through `dequantize`: the GGUF type numbers, block sizes and
        // the alignment copy are what is tested; the values must come back
        // within each type's rounding.
        let cpu = candle_core::Device::Cpu;
        let n = 512;
        let x: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        let t = candle_core::Tensor::from_vec(x.clone(), (2, 256), &cpu).unwrap();
        for (ty, dt, tol) in [
            (GgmlType::Q4_0, GgmlDType::Q4_0, 0.3),
            (GgmlType::Q4_1, GgmlDType::Q4_1, 0.2),
            (GgmlType::Q5_0, GgmlDType::Q5_0, 0.15),
            (GgmlType::Q5_1, GgmlDType::Q5_1, 0.1),
            (GgmlType::Q8_0, GgmlDType::Q8_0, 0.01),
            (GgmlType::Q2_K, GgmlDType::Q2K, 0.8),
            (GgmlType::Q3_K, GgmlDType::Q3K, 0.5),
            (GgmlType::Q4_K, GgmlDType::Q4K, 0.2),
            (GgmlType::Q5_K, GgmlDType::Q5K, 0.1),
            (GgmlType::Q6_K, GgmlDType::Q6K, 0.05),
        ] {
            let q = QTensor::quantize(&t, dt).unwrap();
            let bytes = q.data().unwrap();
            let (per, size) = ty.block().unwrap();
            assert_eq!(bytes.len() as u64, n as u64 / per * size, "{}", ty.name());
            // Unaligned input: one byte in.
            let mut shifted = vec![0u8; bytes.len() + 1];
            shifted[1..].copy_from_slice(&bytes);
            let ours = dequantize(ty, &shifted[1..], n).unwrap();
            let theirs = q.dequantize(&cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(ours, theirs, "{}", ty.name());
            let err = ours.iter().zip(&x).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < tol, "{}: max error {err}", ty.name());
            assert!(dequantize(ty, &bytes[..bytes.len() - 1], n).is_err());
        }
        let h: Vec<u8> = x.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect();
        assert_eq!(
            dequantize(GgmlType::F16, &h, n).unwrap(),
            x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect::<Vec<_>>()
        );
    }
}
