//! Which files of a config directory are config: `*.yaml` / `*.yml`,
//! recursively, skipping names that start with `.`, following symlinks.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use tracing::{debug, warn};

/// Deepest directory nesting followed (guards against symlink loops).
pub const MAX_DIR_DEPTH: usize = 16;

/// True for `*.yaml` / `*.yml` (any case).
pub fn is_yaml(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("yaml") || e.eq_ignore_ascii_case("yml"))
}

/// Every config file under `dir`, sorted. Unlistable directories are
/// logged and skipped.
pub fn config_files(dir: &Path) -> BTreeSet<PathBuf> {
    let mut out = BTreeSet::new();
    walk(dir, 0, &mut out);
    out
}

/// Adds the config files under `dir` to `out`; `depth` is how deep `dir`
/// already is below the root.
pub(crate) fn walk(dir: &Path, depth: usize, out: &mut BTreeSet<PathBuf>) {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) => {
            warn!(dir = %dir.display(), error = %e, "cannot list config directory; its files are not (re)loaded — fix its permissions");
            return;
        }
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => {
                if depth < MAX_DIR_DEPTH {
                    walk(&path, depth + 1, out);
                } else {
                    warn!(dir = %path.display(), "config directory nested too deeply (symlink loop?); not descending");
                }
            }
            Ok(_) if is_yaml(&path) => {
                out.insert(path);
            }
            Ok(_) => {}
            Err(e) => debug!(path = %path.display(), error = %e, "skipping unreadable entry"),
        }
    }
}
