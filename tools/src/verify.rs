//! `prep verify`: check every checksum of a pack.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use nflash_format::Pack;

/// Arguments of `prep verify`.
#[derive(Args)]
pub struct VerifyArgs {
    /// The .nflash pack.
    file: PathBuf,
}

pub fn run(a: VerifyArgs) -> Result<()> {
    let pack = Pack::open(&a.file)?;
    let segs = &pack.manifest().segments;
    for (i, s) in segs.iter().enumerate() {
        pack.verify_segment(i as u32)?;
        eprintln!("ok  {:<12} {:>12} bytes  crc32 {:08x}", s.name, s.bytes, s.crc32);
    }
    println!("{}: header, manifest and {} segments verified", a.file.display(), segs.len());
    Ok(())
}
