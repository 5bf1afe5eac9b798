//! Writes capi/include/nflash.h from src/lib.rs with cbindgen (config in
//! cbindgen.toml), only when its text changes, so the header in the
//! repository always matches the library.

fn main() {
    println!("cargo:rerun-if-changed=src/lib.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let config = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("capi/cbindgen.toml is valid");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&dir)
        .with_config(config)
        .generate()
        .expect("cbindgen can read capi/src/lib.rs")
        .write(&mut out);
    let path = format!("{dir}/include/nflash.h");
    if std::fs::read(&path).ok().as_deref() != Some(&out[..]) {
        std::fs::write(&path, out).expect("capi/include/ is writable");
    }
}
