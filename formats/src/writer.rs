//! Streaming pack writer: segments are appended in order, the manifest goes
//! last, the header is written at offset 0 at the end, and the file appears
//! at its final path only after a rename (SPEC §7).

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::header::{Header, HEADER_BYTES, MAGIC, VERSION_MAJOR, VERSION_MINOR};
use crate::manifest::{bincode_options, Manifest, Segment, SegmentKind};

/// Largest manifest written or read, bytes.
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;

struct OpenSegment {
    name: String,
    kind: SegmentKind,
    start: u64,
    hasher: crc32fast::Hasher,
}

/// Writes a pack to `<path>.tmp-<pid>` and renames it to `path` in
/// [`PackWriter::finish`]. Dropping an unfinished writer deletes the temporary file.
pub struct PackWriter {
    final_path: PathBuf,
    tmp_path: PathBuf,
    out: Option<BufWriter<File>>,
    pos: u64,
    alignment: u64,
    segments: Vec<Segment>,
    current: Option<OpenSegment>,
    stale: Vec<PathBuf>,
}

/// Removes the temporary files `<file_name>.tmp-<pid>` beside `path` left
/// by a writer of `path` that was killed (SIGKILL, power loss): those whose
/// process no longer runs (`/proc/<pid>` is gone). Returns the paths removed.
fn remove_stale_temps(path: &Path, file_name: &std::ffi::OsStr) -> Vec<PathBuf> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let Some(prefix) = file_name.to_str().map(|n| format!("{n}.tmp-")) else { return Vec::new() };
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else { continue };
        if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let alive = Path::new("/proc").join(pid).exists() || !Path::new("/proc/self").exists();
        if !alive && e.file_type().is_ok_and(|t| t.is_file()) && std::fs::remove_file(e.path()).is_ok() {
            removed.push(e.path());
        }
    }
    removed
}

impl PackWriter {
    /// Creates the temporary file next to `path`. `alignment` (bytes) must be a
    /// power of two ≥ 4096.
    ///
    /// # Errors
    /// [`Error::Write`] for a bad alignment, [`Error::Io`] if the file cannot be created.
    pub fn create(path: &Path, alignment: u32) -> Result<Self> {
        if !alignment.is_power_of_two() || alignment < 4096 {
            return Err(Error::Write(format!("alignment {alignment} must be a power of two ≥ 4096")));
        }
        let file_name =
            path.file_name().ok_or_else(|| Error::Write(format!("{} is not a file path", path.display())))?;
        let stale = remove_stale_temps(path, file_name);
        let mut tmp_name = file_name.to_os_string();
        tmp_name.push(format!(".tmp-{}", std::process::id()));
        let tmp_path = path.with_file_name(tmp_name);
        let file = File::create(&tmp_path).map_err(|e| Error::io(&tmp_path, e))?;
        let mut w = PackWriter {
            final_path: path.to_path_buf(),
            tmp_path,
            out: Some(BufWriter::with_capacity(1 << 20, file)),
            pos: 0,
            alignment: alignment as u64,
            segments: Vec::new(),
            current: None,
            stale,
        };
        w.raw_write(&[0u8; HEADER_BYTES])?;
        Ok(w)
    }

    fn raw_write(&mut self, bytes: &[u8]) -> Result<()> {
        let out = self.out.as_mut().expect("writer used after finish");
        out.write_all(bytes).map_err(|e| Error::io(&self.tmp_path, e))?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn raw_pad_to(&mut self, align: u64) -> Result<()> {
        let pad = self.pos.next_multiple_of(align) - self.pos;
        const ZEROS: [u8; 4096] = [0; 4096];
        let mut left = pad;
        while left > 0 {
            let n = left.min(ZEROS.len() as u64) as usize;
            self.raw_write(&ZEROS[..n])?;
            left -= n as u64;
        }
        Ok(())
    }

    /// Starts a new segment at the next aligned offset.
    ///
    /// # Errors
    /// [`Error::Write`] if a segment is already open or the name is taken.
    pub fn begin_segment(&mut self, name: &str, kind: SegmentKind) -> Result<()> {
        if let Some(cur) = &self.current {
            return Err(Error::Write(format!("segment {:?} still open when starting {name:?}", cur.name)));
        }
        if self.segments.iter().any(|s| s.name == name) {
            return Err(Error::Write(format!("duplicate segment name {name:?}")));
        }
        self.raw_pad_to(self.alignment)?;
        self.current =
            Some(OpenSegment { name: name.to_string(), kind, start: self.pos, hasher: crc32fast::Hasher::new() });
        Ok(())
    }

    /// Appends bytes to the open segment.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let cur = self.current.as_mut().ok_or_else(|| Error::Write("write outside a segment".into()))?;
        cur.hasher.update(bytes);
        self.raw_write(bytes)
    }

    /// Offset inside the open segment, bytes.
    pub fn segment_pos(&self) -> u64 {
        self.current.as_ref().map_or(0, |c| self.pos - c.start)
    }

    /// Pads the open segment with zeros until [`Self::segment_pos`] is a multiple of `align`.
    pub fn pad_segment_to(&mut self, align: u64) -> Result<u64> {
        let pos = self.segment_pos();
        let pad = pos.next_multiple_of(align) - pos;
        if pad > 0 {
            self.write(&vec![0u8; pad as usize])?;
        }
        Ok(self.segment_pos())
    }

    /// Closes the open segment and returns its index in the segment table.
    pub fn end_segment(&mut self) -> Result<u32> {
        let cur = self.current.take().ok_or_else(|| Error::Write("end_segment without begin_segment".into()))?;
        self.segments.push(Segment {
            name: cur.name,
            kind: cur.kind,
            offset: cur.start,
            bytes: self.pos - cur.start,
            crc32: cur.hasher.finalize(),
        });
        Ok((self.segments.len() - 1) as u32)
    }

    /// The temporary files of killed writers of the same path that
    /// [`Self::create`] removed (`<name>.tmp-<pid>` of a process that no
    /// longer runs).
    pub fn stale_removed(&self) -> &[PathBuf] {
        &self.stale
    }

    /// The temporary file being written (renamed to the final path by [`Self::finish`]).
    pub fn temp_path(&self) -> &Path {
        &self.tmp_path
    }

    /// Segments written so far.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Writes the manifest (its `segments` replaced by the ones written) and the
    /// header, syncs, and renames the temporary file to the final path.
    pub fn finish(mut self, mut manifest: Manifest) -> Result<PathBuf> {
        if self.current.is_some() {
            return Err(Error::Write("finish with a segment still open".into()));
        }
        manifest.segments = std::mem::take(&mut self.segments);
        let opts = bincode_options(MAX_MANIFEST_BYTES);
        let bytes = bincode::Options::serialize(opts, &manifest)
            .map_err(|e| Error::Write(format!("manifest encoding: {e}")))?;
        self.raw_pad_to(64)?;
        let manifest_offset = self.pos;
        self.raw_write(&bytes)?;
        let header = Header {
            magic: MAGIC,
            major: VERSION_MAJOR,
            minor: VERSION_MINOR,
            alignment: self.alignment as u32,
            manifest_offset,
            manifest_bytes: bytes.len() as u64,
            manifest_crc32: crc32fast::hash(&bytes),
            flags: 0,
            reserved: [0; 20],
            header_crc32: 0,
        };
        let mut out = self.out.take().expect("writer used after finish");
        let tmp = self.tmp_path.clone();
        let result = (|| -> std::io::Result<()> {
            out.flush()?;
            let mut file = out.into_inner().map_err(|e| e.into_error())?;
            file.seek(SeekFrom::Start(0))?;
            file.write_all(&header.to_bytes())?;
            file.sync_all()
        })()
        .map_err(|e| Error::io(&tmp, e))
        .and_then(|()| std::fs::rename(&tmp, &self.final_path).map_err(|e| Error::io(&self.final_path, e)));
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result.map(|()| self.final_path.clone())
    }
}

impl Drop for PackWriter {
    fn drop(&mut self) {
        if self.out.is_some() {
            // Unfinished: never leave a half-written pack behind.
            self.out = None;
            let _ = std::fs::remove_file(&self.tmp_path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_removes_the_temporary_files_of_killed_writers_only() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("m.nflash");
        // pid 4294967295 is above every pid_max: that writer is gone. pid 1 runs.
        let dead = dir.path().join("m.nflash.tmp-4294967295");
        let alive = dir.path().join("m.nflash.tmp-1");
        let other = dir.path().join("n.nflash.tmp-4294967295");
        let not_pid = dir.path().join("m.nflash.tmp-x1");
        for p in [&dead, &alive, &other, &not_pid] {
            std::fs::write(p, b"partial").unwrap();
        }
        let w = PackWriter::create(&out, 4096).unwrap();
        assert_eq!(w.stale_removed(), std::slice::from_ref(&dead));
        assert!(!dead.exists() && alive.exists() && other.exists() && not_pid.exists());
    }
}
