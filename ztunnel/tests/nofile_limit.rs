//! ztunnel raises its soft RLIMIT_NOFILE to the hard limit at start and
//! logs it (benches/README.md, "File limits"): started here with a soft
//! limit of 256, it runs with the hard one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../tests/shared/nofile_limit.rs"]
mod nofile_limit;

#[test]
fn raises_its_open_file_limit_to_the_hard_limit() {
    let dir = tempfile::tempdir().unwrap();
    let args = [
        "--node-name=node-1".to_string(),
        // Nothing listens there: the ztunnel keeps retrying, which is enough.
        "--xds-address=http://127.0.0.1:1".into(),
        "--admin-addr=127.0.0.1:0".into(),
        "--stats-addr=127.0.0.1:0".into(),
        "--readiness-addr=127.0.0.1:0".into(),
        format!("--zds-path={}", dir.path().join("zds.sock").display()),
    ];
    nofile_limit::check_raised(env!("CARGO_BIN_EXE_ztunnel"), &args);
}
