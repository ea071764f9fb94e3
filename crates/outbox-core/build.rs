//! Compiles this crate's `proto/outbox/v1/*.proto` with protox (pure Rust): no `protoc`
//! is needed on a fresh machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time, not baked in with env!(): a build script compiled in
    // one checkout must not point at that checkout from another one that
    // shares the target directory.
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR")?;
    let root = std::path::Path::new(&manifest_dir).join("proto");
    let file = root.join("outbox/v1/envelope.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    prost_build::Config::new()
        .btree_map(["."])
        .compile_fds(fds)?;
    Ok(())
}
