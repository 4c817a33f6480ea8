//! Installing the plugin binary into the CNI bin dir.

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tracing::{debug, info};

use super::atomic;
use super::{InstallConfig, InstallError};

/// Mode of the installed plugin.
const BINARY_MODE: u32 = 0o755;

/// Mode of a bin dir we create (what CNI installers and packages use).
const BIN_DIR_MODE: u32 = 0o755;

/// Makes sure the bin dir exists. A missing one is created (mode 0755,
/// whatever the umask) when its parent exists — `/opt/cni` without `bin`
/// is a node whose CNI is not installed yet, and the plugin belongs there
/// all the same; when the parent is missing too the path is more likely
/// wrong (a typo, a host directory not mounted into the agent's container)
/// and it is an error naming the flag. `Ok(true)` when it was created.
pub(super) fn ensure_bin_dir(dir: &Path) -> Result<bool, InstallError> {
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => return Ok(false),
        Ok(_) => {
            return Err(InstallError::Write {
                path: dir.to_path_buf(),
                source: io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
            });
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(InstallError::Read {
                path: dir.to_path_buf(),
                source,
            });
        }
    }
    let parent = match dir.parent() {
        Some(p) if p.as_os_str().is_empty() => Path::new("."),
        Some(p) => p,
        None => Path::new("/"),
    };
    if !parent.is_dir() {
        return Err(InstallError::BinDirMissing {
            dir: dir.to_path_buf(),
            parent: parent.to_path_buf(),
        });
    }
    let write_err = |source| InstallError::Write {
        path: dir.to_path_buf(),
        source,
    };
    match fs::DirBuilder::new().mode(BIN_DIR_MODE).create(dir) {
        Ok(()) => {}
        // Created by someone else meanwhile (the primary CNI's installer).
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => return Ok(false),
        Err(e) => return Err(write_err(e)),
    }
    // The umask may have narrowed the mode; the runtime must read it.
    fs::set_permissions(dir, fs::Permissions::from_mode(BIN_DIR_MODE)).map_err(write_err)?;
    let _ = atomic::sync_dir(dir);
    info!(dir = %dir.display(), "created the CNI bin dir (it did not exist)");
    Ok(true)
}

/// Installs `cfg.plugin_source` as `cfg.cni_bin_dir/ambit-cni` (mode 0755)
/// and returns that path. The copy is atomic (temp file in the bin dir,
/// fsync, chmod, rename), so a runtime exec'ing the plugin meanwhile gets the
/// old or the new binary, never a partial one, and a running old binary is
/// not disturbed ("text file busy" cannot happen). When the installed file
/// already has the same contents only its mode is fixed if needed. A
/// missing bin dir is created when its parent exists
/// ([`InstallError::BinDirMissing`] otherwise).
pub fn install_binary(cfg: &InstallConfig) -> Result<PathBuf, InstallError> {
    let src = &cfg.plugin_source;
    let dst = cfg.installed_binary();
    let src_meta = fs::metadata(src).map_err(|source| InstallError::Source {
        path: src.clone(),
        source,
    })?;
    if !src_meta.is_file() {
        return Err(InstallError::Source {
            path: src.clone(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"),
        });
    }
    ensure_bin_dir(&cfg.cni_bin_dir)?;
    atomic::sweep_stale_temps(&cfg.cni_bin_dir);

    match fs::metadata(&dst) {
        Ok(m) if m.is_file() && m.len() == src_meta.len() && same_contents(src, &dst)? => {
            if m.permissions().mode() & 0o7777 != BINARY_MODE {
                fs::set_permissions(&dst, fs::Permissions::from_mode(BINARY_MODE)).map_err(
                    |source| InstallError::Write {
                        path: dst.clone(),
                        source,
                    },
                )?;
                info!(path = %dst.display(), "plugin binary up to date; fixed its mode to 0755");
            } else {
                debug!(path = %dst.display(), "plugin binary up to date");
            }
            return Ok(dst);
        }
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(InstallError::Read { path: dst, source }),
    }

    let mut input = File::open(src).map_err(|source| InstallError::Source {
        path: src.clone(),
        source,
    })?;
    // Tell a read error of the source from a write error of the target.
    let mut read_err = None;
    atomic::replace_with(&dst, BINARY_MODE, None, |out| {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match input.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let kind = e.kind();
                    read_err = Some(e);
                    return Err(io::Error::new(kind, "reading the source failed"));
                }
            };
            io::Write::write_all(out, &buf[..n])?;
        }
    })
    .map_err(|source| match read_err.take() {
        Some(source) => InstallError::Source {
            path: src.clone(),
            source,
        },
        None => InstallError::Write {
            path: dst.clone(),
            source,
        },
    })?;
    info!(from = %src.display(), to = %dst.display(), "installed the ambit-cni plugin binary");
    Ok(dst)
}

/// Removes the installed binary; `Ok(true)` if it was there.
pub(super) fn remove_binary(cfg: &InstallConfig) -> Result<bool, InstallError> {
    let dst = cfg.installed_binary();
    match fs::remove_file(&dst) {
        Ok(()) => {
            let _ = atomic::sync_dir(&dst);
            info!(path = %dst.display(), "removed the ambit-cni plugin binary");
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(InstallError::Write { path: dst, source }),
    }
}

/// Byte-for-byte comparison of two files of equal length.
fn same_contents(a: &Path, b: &Path) -> Result<bool, InstallError> {
    let open = |p: &Path| {
        File::open(p).map_err(|source| InstallError::Read {
            path: p.to_path_buf(),
            source,
        })
    };
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (mut ba, mut bb) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
    loop {
        let na = read_full(&mut fa, &mut ba).map_err(|source| InstallError::Read {
            path: a.to_path_buf(),
            source,
        })?;
        let nb = read_full(&mut fb, &mut bb).map_err(|source| InstallError::Read {
            path: b.to_path_buf(),
            source,
        })?;
        if na != nb || ba[..na] != bb[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

/// Reads until `buf` is full or EOF; returns the bytes read.
fn read_full(f: &mut File, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}
