//! Installing the plugin binary into the CNI bin dir.

use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use tracing::{debug, info};

use super::atomic;
use super::{InstallConfig, InstallError};

/// Mode of the installed plugin.
const BINARY_MODE: u32 = 0o755;

/// Installs `cfg.plugin_source` as `cfg.cni_bin_dir/ambit-cni` (mode 0755)
/// and returns that path. The copy is atomic (temp file in the bin dir,
/// fsync, chmod, rename), so a runtime exec'ing the plugin meanwhile gets the
/// old or the new binary, never a partial one, and a running old binary is
/// not disturbed ("text file busy" cannot happen). When the installed file
/// already has the same contents only its mode is fixed if needed.
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
