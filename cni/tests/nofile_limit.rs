//! ambit-node-agent raises its soft RLIMIT_NOFILE to the hard limit at start and
//! logs it (benches/README.md, "File limits"): started here with a soft
//! limit of 256, it runs with the hard one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../tests/shared/nofile_limit.rs"]
mod nofile_limit;

#[test]
fn raises_its_open_file_limit_to_the_hard_limit() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for sub in ["config", "bin", "net.d", "state"] {
        std::fs::create_dir(d.join(sub)).unwrap();
    }
    let path = |p: &str| d.join(p).display().to_string();
    let args = [
        "--node-name=node-1".to_string(),
        format!("--config-dir={}", path("config")),
        format!("--state-dir={}", path("state")),
        format!("--cni-socket={}", path("cni.sock")),
        format!("--zds-socket={}", path("zds.sock")),
        format!("--cni-bin-dir={}", path("bin")),
        format!("--cni-conf-dir={}", path("net.d")),
        format!("--plugin-binary={}", env!("CARGO_BIN_EXE_ambit-cni")),
    ];
    nofile_limit::check_raised(env!("CARGO_BIN_EXE_ambit-node-agent"), &args);
}
