//! Atomic file replacement: temp file in the target's directory, fsync,
//! mode/owner, rename, fsync of the directory.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// Marks our temp files. `.<name>.ambit-tmp-<pid>-<n>`: hidden, and its
/// extension (`ambit-tmp-…`) is none libcni loads.
pub(super) const TEMP_MARKER: &str = ".ambit-tmp-";

/// Temp files of ours older than this are leftovers of a crash.
const STALE_TEMP: Duration = Duration::from_secs(60);

static NEXT_TEMP: AtomicU64 = AtomicU64::new(0);

/// Whether a file name is one of our temp files.
pub(super) fn is_temp_name(name: &std::ffi::OsStr) -> bool {
    name.to_string_lossy().contains(TEMP_MARKER)
}

fn temp_path(target: &Path) -> PathBuf {
    let dir = target.parent().unwrap_or_else(|| Path::new("."));
    let mut name = OsString::from(".");
    name.push(target.file_name().unwrap_or_default());
    name.push(format!(
        "{TEMP_MARKER}{}-{}",
        std::process::id(),
        NEXT_TEMP.fetch_add(1, Ordering::Relaxed)
    ));
    dir.join(name)
}

/// Owner to give the new file: the one it replaces, when we may.
#[derive(Debug, Clone, Copy)]
pub(super) struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// Replaces `target` atomically with what `fill` writes, with permission
/// bits `mode`. Readers see the old file or the new one, never a mix; a
/// crash leaves at most a temp file (swept by [`sweep_stale_temps`]).
pub(super) fn replace_with(
    target: &Path,
    mode: u32,
    owner: Option<Owner>,
    fill: impl FnOnce(&mut File) -> io::Result<()>,
) -> io::Result<()> {
    let tmp = temp_path(target);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        fill(&mut f)?;
        f.flush()?;
        if let Some(o) = owner {
            // Only root may give files away; as another user keep our own.
            let _ = std::os::unix::fs::fchown(&f, Some(o.uid), Some(o.gid));
        }
        // After chown, which may clear set-id bits; and past the umask.
        f.set_permissions(Permissions::from_mode(mode))?;
        f.sync_all()?;
        drop(f);
        fs::rename(&tmp, target)?;
        sync_dir(target)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Replaces `target` atomically with `contents`.
pub(super) fn replace(
    target: &Path,
    contents: &[u8],
    mode: u32,
    owner: Option<Owner>,
) -> io::Result<()> {
    replace_with(target, mode, owner, |f| f.write_all(contents))
}

/// Makes a rename or unlink in `path`'s directory durable.
pub(super) fn sync_dir(path: &Path) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// Removes temp files of ours in `dir` left by a crash (older than a minute,
/// so a concurrent writer's are left alone). Best effort.
pub(super) fn sweep_stale_temps(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let now = SystemTime::now();
    for e in entries.flatten() {
        if !is_temp_name(&e.file_name()) {
            continue;
        }
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| now.duration_since(t).unwrap_or_default() > STALE_TEMP);
        if old && fs::remove_file(e.path()).is_ok() {
            tracing::debug!(path = %e.path().display(), "removed a stale temp file");
        }
    }
}
