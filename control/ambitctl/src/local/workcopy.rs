//! The working copy of a local cluster's config: `local up` copies the
//! config files of the directory it was given into `<state-dir>/config` and
//! serves that copy, so a user plays with the mesh by editing files that
//! belong to the cluster, never the tracked files of a checkout
//! (`deploy/local/demo`). `local down --keep-config DIR` saves the copy
//! before the state directory goes.

use std::path::{Path, PathBuf};

use super::LocalError;
use crate::config::config_files;

/// The working copy's directory inside the state directory.
pub const WORKING_COPY_DIR: &str = "config";

/// Copies every config file under `source` (what the control plane reads:
/// `*.yaml`/`*.yml`, recursively, names starting with `.` skipped) to the
/// same relative path under `dest`, which must not exist yet. Returns how
/// many files were copied.
pub fn copy_config(source: &Path, dest: &Path) -> Result<usize, LocalError> {
    let meta = std::fs::metadata(source)
        .map_err(LocalError::io("reading the config directory", source))?;
    if !meta.is_dir() {
        return Err(LocalError::io("reading the config directory", source)(
            std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
        ));
    }
    std::fs::create_dir(dest)
        .map_err(LocalError::io("creating the config's working copy", dest))?;
    let files = config_files(source);
    for file in &files {
        let Ok(relative) = file.strip_prefix(source) else {
            continue;
        };
        let target = dest.join(relative);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .map_err(LocalError::io("creating the config's working copy", parent))?;
        }
        std::fs::copy(file, &target).map_err(LocalError::io(
            format!("copying {} into the working copy", file.display()),
            &target,
        ))?;
    }
    Ok(files.len())
}

/// Saves the working copy `copy` as `to` (which must not exist, or be an
/// empty directory) before `local down` removes the state directory.
pub fn keep(copy: &Path, to: &Path) -> Result<PathBuf, LocalError> {
    let to = std::path::absolute(to).map_err(LocalError::io("resolving --keep-config", to))?;
    if let Ok(mut entries) = std::fs::read_dir(&to) {
        if entries.next().is_some() {
            return Err(LocalError::io("saving the config's working copy", &to)(
                std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "the directory exists and is not empty; pass a new directory to --keep-config",
                ),
            ));
        }
        std::fs::remove_dir(&to)
            .map_err(LocalError::io("saving the config's working copy", &to))?;
    }
    copy_config(copy, &to)?;
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_config_files_only_and_keep_refuses_a_full_directory() {
        let src = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("a.yaml"), "kind: Namespace\n").unwrap();
        std::fs::create_dir(src.path().join("sub")).unwrap();
        std::fs::write(src.path().join("sub/b.yml"), "kind: Pod\n").unwrap();
        std::fs::write(src.path().join("notes.txt"), "not config").unwrap();
        std::fs::write(src.path().join(".hidden.yaml"), "kind: Pod\n").unwrap();
        let state = tempfile::tempdir().unwrap();
        let copy = state.path().join(WORKING_COPY_DIR);
        assert_eq!(copy_config(src.path(), &copy).unwrap(), 2);
        assert_eq!(
            std::fs::read_to_string(copy.join("sub/b.yml")).unwrap(),
            "kind: Pod\n"
        );
        assert!(!copy.join("notes.txt").exists());
        assert!(!copy.join(".hidden.yaml").exists());
        // A second copy over the first is refused: nothing is overwritten.
        assert!(copy_config(src.path(), &copy).is_err());

        let kept = state.path().join("kept");
        std::fs::create_dir(&kept).unwrap();
        assert_eq!(keep(&copy, &kept).unwrap(), kept);
        assert!(kept.join("a.yaml").exists());
        let err = keep(&copy, &kept).unwrap_err().to_string();
        assert!(err.contains("not empty"), "{err}");
    }
}
