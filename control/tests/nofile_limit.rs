//! ambit-control raises its soft RLIMIT_NOFILE to the hard limit at start and
//! logs it (benches/README.md, "File limits"): started here with a soft
//! limit of 256, it runs with the hard one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../tests/shared/nofile_limit.rs"]
mod nofile_limit;

#[test]
fn raises_its_open_file_limit_to_the_hard_limit() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config");
    std::fs::create_dir(&config).unwrap();
    let args = [
        format!("--config-dir={}", config.display()),
        format!("--data-dir={}", dir.path().join("data").display()),
        "--xds-plaintext-addr=127.0.0.1:0".to_string(),
        "--xds-tls-addr=127.0.0.1:0".into(),
        "--monitoring-addr=127.0.0.1:0".into(),
        "--tls-names=localhost".into(),
    ];
    nofile_limit::check_raised(env!("CARGO_BIN_EXE_ambit-control"), &args);
}
