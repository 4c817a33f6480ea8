//! The README's first commands as a newcomer runs them: `scripts/demo.sh`
//! as root without sudo, and as a user without sudo (a clear message), and
//! `--down` removing only what the script made. The script runs from a copy
//! of the checkout's layout whose `target/release/ambitctl` is this build's,
//! on a cluster name and link path of the test's own.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ambit_tests::workspace_root;

/// A scratch "checkout": `scripts/demo.sh` and `target/release/ambitctl`.
struct Checkout {
    dir: tempfile::TempDir,
}

impl Checkout {
    fn new() -> Option<Self> {
        let exe = std::env::current_exe().ok()?;
        let ambitctl = exe.parent()?.parent()?.join("ambitctl");
        if !ambitctl.exists() {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("scripts")).unwrap();
        std::fs::create_dir_all(dir.path().join("target/release")).unwrap();
        std::fs::copy(
            workspace_root().join("scripts/demo.sh"),
            dir.path().join("scripts/demo.sh"),
        )
        .unwrap();
        symlink(&ambitctl, dir.path().join("target/release/ambitctl")).unwrap();
        Some(Self { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn link(&self) -> PathBuf {
        self.path().join("bin/ambitctl")
    }

    /// Runs the script with a PATH of `path_dirs` only, under `wrap`
    /// (e.g. `setpriv` to drop root).
    fn run(&self, wrap: &[&str], args: &[&str], path_dirs: &str) -> Output {
        let script = self.path().join("scripts/demo.sh");
        let mut cmd = Command::new(wrap.first().copied().unwrap_or("bash"));
        if wrap.is_empty() {
            cmd.arg(&script);
        } else {
            cmd.args(&wrap[1..]).arg("bash").arg(&script);
        }
        cmd.args(args)
            .env_clear()
            .env("PATH", path_dirs)
            .env(
                "AMBIT_LOCAL_NAME",
                format!("fh{:05x}", rand::random::<u32>() & 0xf_ffff),
            )
            .env("AMBIT_BIN_LINK", self.link())
            .output()
            .unwrap()
    }
}

/// A PATH directory with the few tools the script's first lines use, and
/// no `sudo` (as in root containers and CI runners).
fn path_without_sudo(root: &Path) -> String {
    let bin = root.join("tools");
    std::fs::create_dir_all(&bin).unwrap();
    for tool in ["bash", "id", "dirname", "readlink", "rm", "env"] {
        let found = ["/usr/bin", "/bin"]
            .iter()
            .map(|d| Path::new(d).join(tool))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("{tool} not found in /usr/bin or /bin"));
        symlink(found, bin.join(tool)).unwrap();
    }
    bin.display().to_string()
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[test]
fn demo_script_runs_as_root_without_sudo_and_down_removes_only_its_link() {
    let test = "demo_script_runs_as_root_without_sudo_and_down_removes_only_its_link";
    if !is_root() {
        println!("SKIP {test}: needs root (the script's root path)");
        return;
    }
    let Some(checkout) = Checkout::new() else {
        println!("SKIP {test}: ambitctl not built (cargo build --workspace)");
        return;
    };
    let path = path_without_sudo(checkout.path());
    std::fs::create_dir_all(checkout.link().parent().unwrap()).unwrap();
    let ours = checkout.path().join("target/release/ambitctl");
    symlink(&ours, checkout.link()).unwrap();

    // Root, no sudo anywhere: the root check passes and `--down` runs
    // ambitctl (nothing to remove) and removes the link made for this build.
    let out = checkout.run(&[], &["--down"], &path);
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("Nothing to remove"), "{}", text(&out));
    assert!(!text(&out).contains("sudo"), "{}", text(&out));
    assert!(
        !checkout.link().exists(),
        "the script's own link stays: {}",
        text(&out)
    );

    // A link that points elsewhere is someone else's: kept.
    symlink("/usr/bin/true", checkout.link()).unwrap();
    let out = checkout.run(&[], &["--down"], &path);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        std::fs::read_link(checkout.link()).unwrap(),
        Path::new("/usr/bin/true")
    );
}

#[test]
fn demo_script_as_a_user_without_sudo_says_to_become_root() {
    let test = "demo_script_as_a_user_without_sudo_says_to_become_root";
    if !is_root() || !Path::new("/usr/bin/setpriv").exists() {
        println!("SKIP {test}: needs root and setpriv (to run the script as nobody)");
        return;
    }
    let Some(checkout) = Checkout::new() else {
        println!("SKIP {test}: ambitctl not built (cargo build --workspace)");
        return;
    };
    // nobody must read the scratch checkout.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(checkout.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = path_without_sudo(checkout.path());
    let setpriv = [
        "/usr/bin/setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
    ];
    let out = checkout.run(&setpriv, &[], &path);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let said = text(&out);
    assert!(
        said.contains("run as root") && said.contains("become root"),
        "{said}"
    );
    assert!(!said.contains("command not found"), "{said}");
}
