//! Compiles `proto/outbox/v1/*.proto` with protox (pure Rust): no `protoc`
//! is needed on a fresh machine.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("outbox/v1/envelope.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    prost_build::Config::new()
        .btree_map(["."])
        .compile_fds(fds)?;
    Ok(())
}
