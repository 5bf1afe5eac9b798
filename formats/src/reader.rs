//! Opening and validating a pack (SPEC §6). Every offset and length is
//! checked against the file size before any byte is touched.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::checksums::ClusterChecksums;
use crate::config::{Architecture, RopeScaling};
use crate::error::{Error, Result};
use crate::header::{Header, HEADER_BYTES, MAGIC, VERSION_MAJOR, VERSION_MINOR};
use crate::manifest::{bincode_options, FfnLayer, Manifest, Segment, SegmentKind, TensorEntry};
use crate::writer::MAX_MANIFEST_BYTES;

/// Largest `tokenizer.json` accepted, bytes.
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// Where a pack's segment bytes live.
enum Storage {
    /// The whole file memory-mapped read-only (tools, [`Pack::open`]).
    Mmap(Mmap),
    /// Tokenizer and resident segments copied into memory; FFN segments stay
    /// on flash for the runtime's own reads ([`Pack::open_resident`]).
    Loaded {
        /// Segment bytes by segment index; `None` for FFN segments.
        /// `Vec<u64>` so tensor views are 8-byte aligned.
        segments: Vec<Option<(Vec<u64>, usize)>>,
        file: File,
    },
}

/// An open, validated pack: memory-mapped ([`Pack::open`]) or with its
/// resident segments read into memory ([`Pack::open_resident`]).
pub struct Pack {
    path: PathBuf,
    storage: Storage,
    file_len: u64,
    header: Header,
    manifest: Manifest,
    tensor_index: HashMap<String, usize>,
    /// Per tensor: bytes reordered to the ×8 layout ([`Pack::interleave`]).
    interleaved: Vec<bool>,
    /// Per segment: CRC32 checked before its bytes were reordered in memory.
    checked_before_reorder: Vec<bool>,
}

impl std::fmt::Debug for Pack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pack").field("path", &self.path).finish_non_exhaustive()
    }
}

fn range_check(
    path: &Path,
    what: impl FnOnce() -> String,
    offset: u64,
    len: u64,
    region: &'static str,
    limit: u64,
) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= limit => Ok(()),
        _ => Err(Error::OutOfRange { path: path.to_path_buf(), what: what(), offset, len, region, limit }),
    }
}

/// What `path` is when it is neither a regular file nor a directory (after
/// symlinks): "a FIFO", "a character device", "a block device" or "a
/// socket"; `None` for files, directories and paths that cannot be
/// inspected (opening them reports why). Input files are checked with it
/// before they are opened: opening a FIFO blocks until a writer comes, and
/// a device reads as an empty or endless file.
pub fn special_file_kind(path: &Path) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    let t = std::fs::metadata(path).ok()?.file_type();
    if t.is_fifo() {
        Some("a FIFO (named pipe)")
    } else if t.is_char_device() {
        Some("a character device")
    } else if t.is_block_device() {
        Some("a block device")
    } else if t.is_socket() {
        Some("a socket")
    } else {
        None
    }
}

impl Pack {
    /// Opens and validates the pack at `path`: header (magic, version, CRC),
    /// manifest (range, CRC, decoding, size caps), and every segment, tensor
    /// and neuron-cluster range. Segment checksums are checked by [`Self::verify`].
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::TruncatedHeader`], [`Error::BadMagic`],
    /// [`Error::Missing`], [`Error::IsDirectory`], [`Error::NewerVersion`],
    /// [`Error::OlderVersion`], [`Error::Checksum`] (header, manifest),
    /// [`Error::Truncated`], [`Error::OutOfRange`], [`Error::Manifest`], [`Error::Invalid`].
    pub fn open(path: impl AsRef<Path>) -> Result<Pack> {
        Self::open_mode(path.as_ref(), false)
    }

    /// Opens and validates the pack at `path` like [`Self::open`], then reads
    /// the tokenizer and resident segments into memory with `pread`; FFN
    /// segments are not mapped or read (the runtime reads neuron clusters
    /// itself). Nothing is memory-mapped, so a file truncated or damaged
    /// later gives read errors, never SIGBUS.
    ///
    /// # Errors
    /// As [`Self::open`]; [`Error::Io`] if a segment cannot be read in full.
    pub fn open_resident(path: impl AsRef<Path>) -> Result<Pack> {
        Self::open_mode(path.as_ref(), true)
    }

    fn open_mode(path: &Path, resident: bool) -> Result<Pack> {
        use std::os::unix::fs::FileExt;
        let path = path.to_path_buf();
        // Before opening: opening a FIFO blocks until a writer comes.
        if let Some(kind) = special_file_kind(&path) {
            return Err(Error::NotRegularFile { path, kind });
        }
        let file = File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::Missing { path: path.clone() },
            _ => Error::io(&path, e),
        })?;
        let meta = file.metadata().map_err(|e| Error::io(&path, e))?;
        if meta.is_dir() {
            return Err(Error::IsDirectory { path });
        }
        let len = meta.len();
        if len < HEADER_BYTES as u64 {
            return Err(Error::TruncatedHeader { path, len, need: HEADER_BYTES as u64 });
        }
        let file_len = len;
        let read_at = |offset: u64, n: usize| -> Result<Vec<u8>> {
            let mut buf = vec![0u8; n];
            file.read_exact_at(&mut buf, offset).map_err(|e| Error::io(&path, e))?;
            Ok(buf)
        };
        let hbuf = read_at(0, HEADER_BYTES)?;
        let hb: &[u8; HEADER_BYTES] = hbuf[..].try_into().expect("length checked");
        let header = Header::from_bytes(hb);
        if header.magic != MAGIC {
            if header.magic.starts_with(b"GGUF") {
                return Err(Error::Gguf { path });
            }
            return Err(Error::BadMagic { path, found: header.magic });
        }
        if header.major < VERSION_MAJOR {
            return Err(Error::OlderVersion {
                path,
                major: header.major,
                minor: header.minor,
                sup_major: VERSION_MAJOR,
                sup_minor: VERSION_MINOR,
            });
        }
        if header.major != VERSION_MAJOR || header.minor > VERSION_MINOR {
            return Err(Error::NewerVersion {
                path,
                major: header.major,
                minor: header.minor,
                sup_major: VERSION_MAJOR,
                sup_minor: VERSION_MINOR,
                need: format!("supporting format {}.{}", header.major, header.minor),
            });
        }
        let computed = Header::computed_crc32(hb);
        if computed != header.header_crc32 {
            return Err(Error::Checksum { path, what: "header".into(), stored: header.header_crc32, computed });
        }
        if !header.alignment.is_power_of_two() || header.alignment < 4096 {
            return Err(Error::Invalid {
                path,
                what: "header alignment".into(),
                why: format!("{} is not a power of two ≥ 4096", header.alignment),
            });
        }
        if let Some(end) = header.manifest_offset.checked_add(header.manifest_bytes) {
            if end > file_len && header.manifest_bytes <= MAX_MANIFEST_BYTES {
                return Err(Error::Truncated {
                    path,
                    len: file_len,
                    expected: end,
                    manifest_offset: header.manifest_offset,
                });
            }
        }
        range_check(&path, || "manifest".into(), header.manifest_offset, header.manifest_bytes, "file", file_len)?;
        if header.manifest_bytes > MAX_MANIFEST_BYTES {
            return Err(Error::Invalid {
                path,
                what: "manifest length".into(),
                why: format!("{} bytes exceeds the {} byte maximum", header.manifest_bytes, MAX_MANIFEST_BYTES),
            });
        }
        let mbuf = read_at(header.manifest_offset, header.manifest_bytes as usize)?;
        let mb = &mbuf[..];
        let computed = crc32fast::hash(mb);
        if computed != header.manifest_crc32 {
            return Err(Error::Checksum { path, what: "manifest".into(), stored: header.manifest_crc32, computed });
        }
        let manifest: Manifest =
            bincode::Options::deserialize(bincode_options(header.manifest_bytes), mb).map_err(|e| Error::Manifest {
                path: path.clone(),
                offset: header.manifest_offset,
                len: header.manifest_bytes,
                why: decode_error(&e),
            })?;
        validate(&path, file_len, &header, &manifest)?;
        let tensor_index = manifest.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        let (n_tensors, n_segments) = (manifest.tensors.len(), manifest.segments.len());
        let storage = if resident {
            let mut segments = Vec::with_capacity(manifest.segments.len());
            for s in &manifest.segments {
                if s.kind == SegmentKind::Ffn {
                    segments.push(None);
                    continue;
                }
                let n = s.bytes as usize;
                let mut words = vec![0u64; n.div_ceil(8)];
                // SAFETY: `words` owns n.div_ceil(8) * 8 ≥ n initialized bytes; u8 has no alignment or validity requirements.
                let bytes = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, n) };
                file.read_exact_at(bytes, s.offset).map_err(|e| Error::io(&path, e))?;
                segments.push(Some((words, n)));
            }
            // The copies are what the process holds: drop the file's pages from
            // the page cache so they are neither kept nor charged twice.
            #[cfg(target_os = "linux")]
            // SAFETY: plain syscall on an open descriptor; advice only.
            unsafe {
                libc::posix_fadvise(std::os::unix::io::AsRawFd::as_raw_fd(&file), 0, 0, libc::POSIX_FADV_DONTNEED);
            }
            Storage::Loaded { segments, file }
        } else {
            // SAFETY: the mapping is read-only and all accesses are bounds-checked
            // against the length validated above. Another process truncating the
            // file while it is mapped can still fault; packs are written by
            // rename, never modified in place, and the runtime uses
            // `open_resident`, which maps nothing.
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            if mmap.len() as u64 != file_len {
                return Err(Error::Truncated {
                    path,
                    len: mmap.len() as u64,
                    expected: file_len,
                    manifest_offset: header.manifest_offset,
                });
            }
            Storage::Mmap(mmap)
        };
        Ok(Pack {
            path,
            storage,
            file_len,
            header,
            manifest,
            tensor_index,
            interleaved: vec![false; n_tensors],
            checked_before_reorder: vec![false; n_segments],
        })
    }

    /// Path the pack was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File length, bytes.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// The decoded header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The decoded manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// Bytes of segment `idx` (validated at open), or `None` for an FFN
    /// segment of a pack opened with [`Self::open_resident`].
    /// Panics on an index not in the table.
    pub fn segment(&self, idx: u32) -> Option<&[u8]> {
        let s = &self.manifest.segments[idx as usize];
        match &self.storage {
            Storage::Mmap(m) => Some(&m[s.offset as usize..(s.offset + s.bytes) as usize]),
            Storage::Loaded { segments, .. } => segments[idx as usize].as_ref().map(|(w, n)| {
                // SAFETY: `w` owns at least `n` initialized bytes and lives as long as `self`.
                unsafe { std::slice::from_raw_parts(w.as_ptr() as *const u8, *n) }
            }),
        }
    }

    /// Segment `idx`'s bytes, or an error naming it if it is not in memory.
    fn segment_in_memory(&self, idx: u32) -> Result<&[u8]> {
        self.segment(idx).ok_or_else(|| Error::Invalid {
            path: self.path.clone(),
            what: format!("segment {:?}", self.manifest.segments[idx as usize].name),
            why: "FFN segments of a pack opened for running are read by the neuron cache, not held in memory".into(),
        })
    }

    /// Looks a segment up by name.
    pub fn segment_by_name(&self, name: &str) -> Result<(u32, &Segment)> {
        self.manifest
            .segments
            .iter()
            .enumerate()
            .find(|(_, s)| s.name == name)
            .map(|(i, s)| (i as u32, s))
            .ok_or_else(|| Error::NotFound { path: self.path.clone(), kind: "segment", name: name.to_string() })
    }

    /// Reorders, in memory, every resident Q4_0 and Q8_0 matrix whose shape
    /// allows it ([`crate::interleave::can_interleave`]: rows a multiple of 8)
    /// into the ×8 layout (SPEC §5.1), so that matrix products stream one
    /// group of 8 rows at a time. Each affected segment's CRC32 is checked first, since the
    /// reordered bytes no longer match it; [`Self::verify_segment`] then
    /// reports that earlier check. Returns the bytes reordered. Does nothing
    /// on a mapped pack ([`Self::open`]): its bytes are read-only.
    ///
    /// Callers read [`Self::is_interleaved`] to know a tensor's layout.
    ///
    /// # Errors
    /// [`Error::Checksum`] if an affected segment is damaged.
    pub fn interleave(&mut self) -> Result<u64> {
        let Storage::Loaded { segments, .. } = &self.storage else {
            return Ok(0);
        };
        let selected: Vec<usize> = (0..self.manifest.tensors.len())
            .filter(|&i| {
                let t = &self.manifest.tensors[i];
                !self.interleaved[i]
                    && t.shape.len() == 2
                    && crate::interleave::can_interleave(t.dtype, t.shape[0], t.shape[1])
                    && segments[t.segment as usize].is_some()
            })
            .collect();
        for &i in &selected {
            let seg = self.manifest.tensors[i].segment;
            if !self.checked_before_reorder[seg as usize] {
                self.verify_segment(seg)?;
                self.checked_before_reorder[seg as usize] = true;
            }
        }
        let Storage::Loaded { segments, .. } = &mut self.storage else {
            unreachable!("checked above");
        };
        let (mut scratch, mut total) = (Vec::new(), 0u64);
        for i in selected {
            let t = &self.manifest.tensors[i];
            let Some((words, n)) = segments[t.segment as usize].as_mut() else {
                unreachable!("selected tensors are resident");
            };
            // SAFETY: `words` owns at least `n` initialized bytes; u8 has no alignment or validity requirements.
            let seg = unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, *n) };
            // In range: validated at open (SPEC §6).
            let bytes = &mut seg[t.offset as usize..(t.offset + t.bytes) as usize];
            crate::interleave::interleave(t.dtype, bytes, t.shape[1] as usize, &mut scratch);
            self.interleaved[i] = true;
            total += t.bytes;
        }
        Ok(total)
    }

    /// Whether tensor `name` was reordered to the ×8 layout by
    /// [`Self::interleave`] (false for unknown names).
    pub fn is_interleaved(&self, name: &str) -> bool {
        self.tensor_index.get(name).is_some_and(|&i| self.interleaved[i])
    }

    /// A resident tensor's entry and bytes (in the ×8 layout if
    /// [`Self::is_interleaved`]).
    ///
    /// # Errors
    /// [`Error::NotFound`] if the pack has no tensor `name`.
    pub fn tensor(&self, name: &str) -> Result<(&TensorEntry, &[u8])> {
        let i = *self.tensor_index.get(name).ok_or_else(|| Error::NotFound {
            path: self.path.clone(),
            kind: "tensor",
            name: name.to_string(),
        })?;
        let t = &self.manifest.tensors[i];
        let seg = self.segment_in_memory(t.segment)?;
        Ok((t, &seg[t.offset as usize..(t.offset + t.bytes) as usize]))
    }

    /// Whether the pack has tensor `name`.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    /// Layer `layer`'s FFN entry.
    pub fn ffn_layer(&self, layer: usize) -> Result<&FfnLayer> {
        self.manifest.ffn.get(layer).ok_or_else(|| Error::NotFound {
            path: self.path.clone(),
            kind: "FFN layer",
            name: layer.to_string(),
        })
    }

    /// Absolute file offset of byte `offset` of segment `idx` (for `pread`).
    pub fn segment_file_offset(&self, idx: u32) -> u64 {
        self.manifest.segments[idx as usize].offset
    }

    /// Checks segment `idx`'s CRC32.
    ///
    /// # Errors
    /// [`Error::Checksum`] naming the segment.
    pub fn verify_segment(&self, idx: u32) -> Result<()> {
        let s = &self.manifest.segments[idx as usize];
        if self.checked_before_reorder[idx as usize] {
            // Checked by `interleave` before its bytes were reordered.
            return Ok(());
        }
        let computed = match (self.segment(idx), &self.storage) {
            (Some(b), _) => crc32fast::hash(b),
            (None, Storage::Loaded { file, .. }) => {
                // Not in memory: stream it through a 1 MiB buffer.
                use std::os::unix::fs::FileExt;
                let mut h = crc32fast::Hasher::new();
                let mut buf = vec![0u8; 1 << 20];
                let mut done = 0u64;
                while done < s.bytes {
                    let n = (s.bytes - done).min(buf.len() as u64) as usize;
                    file.read_exact_at(&mut buf[..n], s.offset + done).map_err(|e| Error::io(&self.path, e))?;
                    h.update(&buf[..n]);
                    done += n as u64;
                }
                h.finalize()
            }
            (None, Storage::Mmap(_)) => unreachable!("a mapped pack has every segment"),
        };
        if computed != s.crc32 {
            return Err(Error::Checksum {
                path: self.path.clone(),
                what: format!("segment {:?} (offset {}, {} bytes)", s.name, s.offset, s.bytes),
                stored: s.crc32,
                computed,
            });
        }
        Ok(())
    }

    /// Checks every segment's CRC32 (reads the whole file).
    pub fn verify(&self) -> Result<()> {
        (0..self.manifest.segments.len() as u32).try_for_each(|i| self.verify_segment(i))?;
        // The metadata's JSON is checked as a reader of it would (SPEC §4.9).
        self.metadata().map(|_| ())
    }

    /// The neuron-cluster checksum table (SPEC §4.10), after checking its
    /// segment CRC; `None` for a pack without one (before 3.4).
    ///
    /// # Errors
    /// [`Error::Checksum`] if the table is damaged; [`Error::Invalid`] if it
    /// does not fit the manifest, or if a pack of format 3.4 or later has
    /// none.
    pub fn cluster_checksums(&self) -> Result<Option<ClusterChecksums>> {
        let Some(idx) = self.manifest.segments.iter().position(|s| s.kind == SegmentKind::ClusterChecksums) else {
            if (self.header.major, self.header.minor) >= (3, 4) {
                return Err(Error::Invalid {
                    path: self.path.clone(),
                    what: "manifest".into(),
                    why: format!(
                        "the pack is format {}.{}, which carries a neuron-cluster checksums segment (SPEC §4.10), and this one has none: the file was altered or damaged; copy or convert it again (nflash run --verify off skips the cluster checks)",
                        self.header.major, self.header.minor
                    ),
                });
            }
            return Ok(None);
        };
        let idx = idx as u32;
        self.verify_segment(idx)?;
        ClusterChecksums::decode(self.segment_in_memory(idx)?, &self.manifest).map(Some).map_err(|why| Error::Invalid {
            path: self.path.clone(),
            what: format!("segment {:?}", self.manifest.segments[idx as usize].name),
            why,
        })
    }

    /// Checks every neuron cluster's CRC-32C against the table (SPEC
    /// §4.10), reading the clusters in pieces of at most 8 MiB. Returns the
    /// clusters checked, or `None` when the pack has no table (before 3.4).
    ///
    /// # Errors
    /// [`Error::ClusterChecksum`] naming the first damaged cluster, its unit
    /// and file offset; [`Error::Io`] on a read error; as
    /// [`Self::cluster_checksums`].
    pub fn verify_clusters(&self) -> Result<Option<u64>> {
        let Some(table) = self.cluster_checksums()? else { return Ok(None) };
        let mut buf = Vec::new();
        let mut checked = 0u64;
        for (u, f) in self.manifest.ffn.iter().enumerate() {
            let seg_off = self.segment_file_offset(f.segment);
            let seg = self.segment(f.segment);
            let crcs = table.unit(u);
            let len_of = |c: &crate::NeuronCluster| c.n_neurons as u64 * f.bundle.bundle_bytes;
            let mut i = 0;
            while i < f.clusters.len() {
                // A run of clusters in ascending file order, at most 8 MiB (or one cluster).
                let start = f.clusters[i].offset;
                let mut end = start + len_of(&f.clusters[i]);
                let mut j = i + 1;
                while j < f.clusters.len() {
                    let c = &f.clusters[j];
                    if c.offset < end || c.offset + len_of(c) - start > 8 << 20 {
                        break;
                    }
                    end = c.offset + len_of(c);
                    j += 1;
                }
                let bytes: &[u8] = match (seg, &self.storage) {
                    (Some(b), _) => &b[start as usize..end as usize],
                    (None, Storage::Loaded { file, .. }) => {
                        use std::os::unix::fs::FileExt;
                        buf.resize((end - start) as usize, 0);
                        file.read_exact_at(&mut buf, seg_off + start).map_err(|e| Error::io(&self.path, e))?;
                        &buf
                    }
                    (None, Storage::Mmap(_)) => unreachable!("a mapped pack has every segment"),
                };
                for (k, c) in f.clusters[i..j].iter().enumerate() {
                    let at = (c.offset - start) as usize;
                    let computed = crate::checksums::cluster_crc32c(&bytes[at..at + len_of(c) as usize]);
                    if computed != crcs[i + k] {
                        return Err(Error::ClusterChecksum {
                            path: self.path.clone(),
                            unit: self.manifest.config.unit_label(u),
                            cluster: i + k,
                            offset: seg_off + c.offset,
                            len: len_of(c),
                            stored: crcs[i + k],
                            computed,
                        });
                    }
                }
                checked += (j - i) as u64;
                i = j;
            }
        }
        Ok(Some(checked))
    }

    /// The metadata object (SPEC §4.9): the default (nothing set) when the
    /// pack has no metadata segment (packs before 3.2). Its CRC is checked.
    ///
    /// # Errors
    /// [`Error::Checksum`]; [`Error::Invalid`] if it is not a JSON object or a
    /// defined key has the wrong type or range.
    pub fn metadata(&self) -> Result<crate::Metadata> {
        let Some(idx) = self.manifest.segments.iter().position(|s| s.kind == SegmentKind::Metadata) else {
            return Ok(crate::Metadata::default());
        };
        let idx = idx as u32;
        self.verify_segment(idx)?;
        let invalid = |why: String| Error::Invalid {
            path: self.path.clone(),
            what: format!("segment {:?}", self.manifest.segments[idx as usize].name),
            why,
        };
        // Held in memory like every segment but the FFN ones.
        let bytes = self.segment_in_memory(idx)?;
        // An object, not any JSON serde could read into the struct (it would take an array too).
        let v: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| invalid(format!("not the metadata JSON object: {e}")))?;
        if !v.is_object() {
            return Err(invalid("the metadata is not a JSON object".into()));
        }
        let m: crate::Metadata =
            serde_json::from_value(v).map_err(|e| invalid(format!("a defined key has the wrong type: {e}")))?;
        if let Some(g) = &m.generation {
            g.check().map_err(|why| invalid(format!("generation defaults: {why}")))?;
        }
        if let Some(e) = &m.experts {
            let Some(moe) = self.manifest.config.architecture.moe() else {
                return Err(invalid(
                    "expert statistics in a pack of a dense model; convert the checkpoint again".into(),
                ));
            };
            e.check(self.manifest.ffn.len(), moe)
                .map_err(|why| invalid(format!("experts: {why}; convert the checkpoint again")))?;
        }
        Ok(m)
    }

    /// The probability that decode runs each FFN unit for a token (`[units]`,
    /// SPEC §4.4): 1 for a dense model; for a mixture of experts the
    /// calibration's routed share of each expert (SPEC §4.9 `experts`), or
    /// without it `experts_per_token / num_experts` for every expert.
    ///
    /// # Errors
    /// As [`Self::metadata`].
    pub fn unit_share(&self) -> Result<Vec<f64>> {
        let cfg = &self.manifest.config;
        let meta = self.metadata()?;
        let Some(moe) = cfg.architecture.moe() else { return Ok(vec![1.0; self.manifest.ffn.len()]) };
        Ok(match meta.experts {
            Some(e) => e.routed_share.iter().map(|&s| s as f64).collect(),
            None => vec![moe.experts_per_token as f64 / moe.num_experts as f64; self.manifest.ffn.len()],
        })
    }

    /// Decompressed `tokenizer.json` bytes.
    ///
    /// # Errors
    /// [`Error::NotFound`] / [`Error::Invalid`] if the segment is missing or
    /// does not decompress to the recorded size.
    pub fn tokenizer_json(&self) -> Result<Vec<u8>> {
        let info = &self.manifest.tokenizer;
        let (idx, _) = self.segment_by_name(&info.segment)?;
        let invalid =
            |why: String| Error::Invalid { path: self.path.clone(), what: format!("segment {:?}", info.segment), why };
        if info.json_bytes > MAX_TOKENIZER_BYTES {
            return Err(invalid(format!("tokenizer.json size {} exceeds {MAX_TOKENIZER_BYTES}", info.json_bytes)));
        }
        let out = zstd::bulk::decompress(self.segment_in_memory(idx)?, info.json_bytes as usize)
            .map_err(|e| invalid(format!("zstd: {e}")))?;
        if out.len() as u64 != info.json_bytes {
            return Err(invalid(format!("decompressed to {} bytes, manifest says {}", out.len(), info.json_bytes)));
        }
        Ok(out)
    }
}

/// Says why bincode could not decode the manifest; its I/O errors (the
/// manifest ends inside a field) carry no message of their own.
fn decode_error(e: &bincode::Error) -> String {
    match &**e {
        bincode::ErrorKind::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            "it ends inside a field (a length or count in it is wrong, or bytes are missing): the pack is damaged or was written by another program; convert the checkpoint again".into()
        }
        bincode::ErrorKind::Io(io) => format!("read error: {io} ({:?})", io.kind()),
        bincode::ErrorKind::SizeLimit => {
            "a length or count in it asks for more bytes than the manifest holds: the pack is damaged; convert the checkpoint again".into()
        }
        other => format!("{other}: the pack is damaged or was written by another program; convert the checkpoint again"),
    }
}

/// Validates every range and index in `manifest` against a file of
/// `file_len` bytes (SPEC §6).
pub fn validate(path: &Path, file_len: u64, header: &Header, m: &Manifest) -> Result<()> {
    let invalid = |what: String, why: String| Error::Invalid { path: path.to_path_buf(), what, why };
    m.config.check().map_err(|why| invalid("model config".into(), why))?;
    let align = header.alignment as u64;
    let mut prev_end = HEADER_BYTES as u64;
    for s in &m.segments {
        range_check(
            path,
            || format!("segment {:?}", s.name),
            s.offset,
            s.bytes,
            "file",
            header.manifest_offset.min(file_len),
        )?;
        if s.offset % align != 0 || s.offset < prev_end {
            return Err(invalid(
                format!("segment {:?}", s.name),
                format!("offset {} is not aligned to {align} or overlaps the previous segment", s.offset),
            ));
        }
        prev_end = s.offset + s.bytes;
        if s.kind == SegmentKind::Metadata && s.bytes > crate::metadata::MAX_METADATA_BYTES {
            return Err(invalid(
                format!("segment {:?}", s.name),
                format!("metadata of {} bytes exceeds {}", s.bytes, crate::metadata::MAX_METADATA_BYTES),
            ));
        }
    }
    match m.segments.iter().filter(|s| s.kind == SegmentKind::Metadata).count() {
        0 => {}
        1 if header.minor >= 2 => {}
        1 => {
            return Err(invalid(
                "segments".into(),
                format!(
                    "a metadata segment in a pack of version {}.{} (metadata exists since 3.2)",
                    header.major, header.minor
                ),
            ))
        }
        _ => return Err(invalid("segments".into(), "more than one metadata segment".into())),
    }
    let tables: Vec<&Segment> = m.segments.iter().filter(|s| s.kind == SegmentKind::ClusterChecksums).collect();
    match tables[..] {
        [] => {}
        [t] if header.minor >= 4 => {
            let need = crate::checksums::total_clusters(m).and_then(|n| n.checked_mul(crate::checksums::ENTRY_BYTES));
            if need != Some(t.bytes) {
                return Err(invalid(
                    format!("segment {:?}", t.name),
                    format!(
                        "{} bytes of neuron-cluster checksums, but the manifest's clusters need {} (4 bytes each)",
                        t.bytes,
                        need.map_or_else(|| "more than 2^64".into(), |n| n.to_string())
                    ),
                ));
            }
        }
        [_] => {
            return Err(invalid(
                "segments".into(),
                format!(
                    "a neuron-cluster checksum table in a pack of version {}.{} (it exists since 3.4)",
                    header.major, header.minor
                ),
            ))
        }
        _ => return Err(invalid("segments".into(), "more than one neuron-cluster checksum table".into())),
    }
    let seg = |idx: u32, what: &dyn Fn() -> String| -> Result<&Segment> {
        m.segments.get(idx as usize).ok_or_else(|| invalid(what(), format!("segment index {idx} out of range")))
    };
    for t in &m.tensors {
        let what = || format!("tensor {:?}", t.name);
        let s = seg(t.segment, &what)?;
        if t.shape.is_empty() || t.shape.len() > 4 {
            return Err(invalid(what(), format!("rank {} not in 1..=4", t.shape.len())));
        }
        let need = t
            .dtype
            .tensor_bytes(&t.shape)
            .ok_or_else(|| invalid(what(), format!("shape {:?} does not fit {} blocks", t.shape, t.dtype)))?;
        if need != t.bytes {
            return Err(invalid(
                what(),
                format!("{} bytes recorded, shape {:?} of {} needs {need}", t.bytes, t.shape, t.dtype),
            ));
        }
        range_check(path, what, t.offset, t.bytes, "segment", s.bytes)?;
        if t.offset % 64 != 0 {
            return Err(invalid(what(), format!("offset {} not 64-byte aligned", t.offset)));
        }
    }
    if m.config.architecture.moe().is_some() && header.minor < 3 {
        return Err(invalid(
            "config".into(),
            format!(
                "a mixture of experts in a pack of version {}.{} (mixtures of experts exist since 3.3)",
                header.major, header.minor
            ),
        ));
    }
    let longrope = matches!(m.config.rope_scaling, Some(RopeScaling::LongRope { .. }));
    if (longrope
        || matches!(
            m.config.architecture,
            Architecture::Qwen3 | Architecture::SmolLm3(_) | Architecture::Phi3(_) | Architecture::Gemma3(_)
        ))
        && header.minor < 5
    {
        return Err(invalid(
            "config".into(),
            format!(
                "architecture {}{} in a pack of version {}.{} (it exists since 3.5)",
                m.config.architecture.hf_name(),
                if longrope { " with LongRoPE" } else { "" },
                header.major,
                header.minor
            ),
        ));
    }
    if m.ffn.len() as u64 != m.config.ffn_units() {
        return Err(invalid(
            "FFN index".into(),
            format!(
                "{} FFN entries, config has {} ({} layers × {} experts)",
                m.ffn.len(),
                m.config.ffn_units(),
                m.config.num_layers,
                m.config.experts()
            ),
        ));
    }
    for (u, f) in m.ffn.iter().enumerate() {
        let what = || format!("FFN {}", m.config.unit_name(u));
        let s = seg(f.segment, &what)?;
        if s.kind != SegmentKind::Ffn || f.layer as usize != m.config.unit_layer_expert(u).0 {
            return Err(invalid(what(), "wrong segment kind or layer number".into()));
        }
        if f.n_neurons as u64 != m.config.intermediate_size {
            return Err(invalid(what(), format!("{} neurons, config has {}", f.n_neurons, m.config.intermediate_size)));
        }
        let b = f.bundle;
        let expect = crate::manifest::BundleLayout::new(b.dtype, m.config.hidden_size);
        if expect != Some(b) {
            return Err(invalid(what(), format!("bundle layout {b:?} does not match hidden_size")));
        }
        if !f.cluster_align.is_power_of_two() || f.cluster_align > align {
            return Err(invalid(what(), format!("cluster alignment {}", f.cluster_align)));
        }
        let mut next = 0u32;
        for c in &f.clusters {
            if c.first != next || c.n_neurons == 0 || c.offset % f.cluster_align != 0 {
                return Err(invalid(
                    what(),
                    format!(
                        "cluster at offset {} (first {}, {} neurons) is out of order or misaligned",
                        c.offset, c.first, c.n_neurons
                    ),
                ));
            }
            let len = (c.n_neurons as u64).saturating_mul(b.bundle_bytes);
            range_check(
                path,
                || format!("neuron cluster of {} at neuron {}", what(), c.first),
                c.offset,
                len,
                "segment",
                s.bytes,
            )?;
            next = next.checked_add(c.n_neurons).ok_or_else(|| invalid(what(), "neuron count overflow".into()))?;
        }
        if next != f.n_neurons {
            return Err(invalid(what(), format!("clusters cover {next} of {} neurons", f.n_neurons)));
        }
        let mut seen = vec![false; f.n_neurons as usize];
        if f.order.len() != f.n_neurons as usize {
            return Err(invalid(what(), format!("neuron order has {} entries", f.order.len())));
        }
        for &o in &f.order {
            match seen.get_mut(o as usize) {
                Some(s) if !*s => *s = true,
                _ => return Err(invalid(what(), format!("neuron order is not a permutation (id {o})"))),
            }
        }
        if f.sparse.is_some() != m.sparse.is_some() {
            return Err(invalid(what(), "sparsity settings present in only some of the manifest".into()));
        }
        if let Some(sp) = &f.sparse {
            let q = &sp.quality;
            let fractions = sp.frequency_curve.iter().chain([&q.recall, &q.precision, &q.bundles_skipped, &q.sparsity]);
            if let Some(v) = fractions.into_iter().find(|v| !(0.0..=1.0).contains(*v)) {
                return Err(invalid(
                    what(),
                    format!("a frequency or predictor quality figure is {v}, not a fraction in [0, 1]"),
                ));
            }
            if !sp.threshold.is_finite() || !sp.predictor_threshold.is_finite() || sp.frequency_curve.len() > 33 {
                return Err(invalid(
                    what(),
                    format!(
                        "sparsity threshold {} / predictor threshold {} / {}-point frequency curve",
                        sp.threshold,
                        sp.predictor_threshold,
                        sp.frequency_curve.len()
                    ),
                ));
            }
        }
    }
    if let Some(p) = &m.plan {
        if p.hot_neurons.len() != m.ffn.len() {
            return Err(invalid(
                "plan".into(),
                format!("{} hot-set sizes for {} FFN units", p.hot_neurons.len(), m.ffn.len()),
            ));
        }
        for (u, (f, &h)) in m.ffn.iter().zip(&p.hot_neurons).enumerate() {
            if h != f.n_neurons && !f.clusters.iter().any(|c| c.first == h) {
                return Err(invalid(
                    "plan".into(),
                    format!(
                        "FFN {} hot set of {h} neurons does not end on a neuron-cluster boundary",
                        m.config.unit_name(u)
                    ),
                ));
            }
        }
        if p.ctx < 2 || u64::from(p.ctx) > crate::config::MAX_CONTEXT {
            return Err(invalid(
                "plan".into(),
                format!("context of {} tokens (supported: 2 to {})", p.ctx, crate::config::MAX_CONTEXT),
            ));
        }
        if p.io_threads == 0 || p.io_threads > 64 || p.threads == 0 {
            return Err(invalid("plan".into(), format!("{} I/O threads, {} compute threads", p.io_threads, p.threads)));
        }
    }
    Ok(())
}
