//! Compiles the `.proto` files under `proto/` with protox (pure Rust, no
//! `protoc` needed) and generates prost messages plus tonic services.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/workload.proto",
        "proto/authorization.proto",
        "proto/ca.proto",
        "proto/zds.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
