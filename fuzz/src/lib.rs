//! What the fuzz targets share: the framing of multi-message inputs, the
//! seed writer, and the real mesh configuration the seeds and the xDS
//! targets are built from.
//!
//! Seeds: every target writes its own seeds when run with
//! `AMBIT_FUZZ_SEEDS=<dir>` (see [`seeds_requested`]); `run.sh seed`
//! does it for all of them. They come from real inputs: the YAML fixtures
//! of `tests/fixtures` and `deploy/local/demo`, the control plane's own
//! translation of them into xDS resources, the CNI configurations of
//! `cni/tests`, CSRs made by the CA client.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ambit_config::Object;
use ambit_control::model::snapshot::{ResourceFamily, Snapshot, XdsResource};
use ambit_control::model::{ModelOptions, Store, build_snapshot};

/// Splits `data` into messages, each `u16` little-endian length + bytes;
/// the last one may be short (it takes what is left).
pub fn frames(mut data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    while data.len() >= 2 {
        let len = u16::from_le_bytes([data[0], data[1]]) as usize;
        let rest = &data[2..];
        let take = len.min(rest.len());
        out.push(&rest[..take]);
        data = &rest[take..];
    }
    out
}

/// The inverse of [`frames`] (for seeds). Messages longer than 64 KiB are
/// cut.
pub fn frame<B: AsRef<[u8]>>(messages: &[B]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in messages {
        let m = m.as_ref();
        let m = &m[..m.len().min(u16::MAX as usize)];
        out.extend_from_slice(&(m.len() as u16).to_le_bytes());
        out.extend_from_slice(m);
    }
    out
}

/// The directory `AMBIT_FUZZ_SEEDS` names, if set: the target then writes
/// its seeds there (see [`write_seeds`]) and exits.
pub fn seeds_requested() -> Option<PathBuf> {
    std::env::var_os("AMBIT_FUZZ_SEEDS").map(PathBuf::from)
}

/// Writes `seeds` (name, bytes) into `dir` and exits the process; called
/// from a target's `init` when [`seeds_requested`].
pub fn write_seeds(dir: &Path, seeds: Vec<(String, Vec<u8>)>) -> ! {
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!("cannot create {}: {e}", dir.display());
        std::process::exit(1);
    }
    let count = seeds.len();
    for (name, bytes) in seeds {
        let path = dir.join(name);
        if let Err(e) = std::fs::write(&path, bytes) {
            eprintln!("cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
    }
    eprintln!("wrote {count} seeds to {}", dir.display());
    std::process::exit(0);
}

/// Real configuration files: (name, text).
pub const CONFIG_FILES: &[(&str, &str)] = &[
    (
        "mesh-namespaces",
        include_str!("../../tests/fixtures/mesh/namespaces.yaml"),
    ),
    (
        "mesh-legacy",
        include_str!("../../tests/fixtures/mesh/legacy.yaml"),
    ),
    (
        "mesh-inference",
        include_str!("../../tests/fixtures/mesh/inference.yaml"),
    ),
    (
        "mesh-vector",
        include_str!("../../tests/fixtures/mesh/vector.yaml"),
    ),
    (
        "waypoint-base",
        include_str!("../../tests/fixtures/waypoint/base.yaml"),
    ),
    (
        "waypoint-canary",
        include_str!("../../tests/fixtures/waypoint/corpus/01-canary-80-20.yaml"),
    ),
    (
        "waypoint-header-match",
        include_str!("../../tests/fixtures/waypoint/corpus/04-header-match-premium.yaml"),
    ),
    (
        "waypoint-httproute",
        include_str!("../../tests/fixtures/waypoint/corpus/41-httproute-matches.yaml"),
    ),
    (
        "demo-legacy",
        include_str!("../../deploy/local/demo/legacy.yaml"),
    ),
];

/// The objects of the named config files (rejected documents are skipped).
pub fn objects_of(names: &[&str]) -> Vec<Object> {
    let mut out = Vec::new();
    for (name, text) in CONFIG_FILES {
        if names.contains(name) {
            let (objects, _errors) = ambit_config::parse_documents(Path::new(name), text);
            out.extend(objects);
        }
    }
    out
}

/// The control plane's snapshot of `objects`, synced, as it would serve it.
pub fn snapshot_of(objects: Vec<Object>) -> Snapshot {
    let store = Store::from_objects(objects);
    let mut snap = build_snapshot(&store, &Snapshot::default(), &ModelOptions::default());
    snap.synced = true;
    snap
}

/// A small mesh (namespaces + legacy + vector fixtures), the whole
/// fixture mesh with a waypoint, and an empty mesh: the states the xDS
/// targets move between.
pub fn mesh_snapshots() -> Vec<Arc<Snapshot>> {
    let small = objects_of(&["mesh-namespaces", "mesh-legacy", "mesh-vector"]);
    let full = objects_of(&[
        "mesh-namespaces",
        "mesh-legacy",
        "mesh-inference",
        "mesh-vector",
        "waypoint-base",
        "waypoint-canary",
    ]);
    vec![
        Arc::new(snapshot_of(small)),
        Arc::new(snapshot_of(full)),
        Arc::new(snapshot_of(Vec::new())),
    ]
}

/// The families of `snap`, to rebuild it after another snapshot (so that
/// deltas and `seq` stay consistent whatever order they are published in).
pub fn families_of(snap: &Snapshot) -> Vec<ResourceFamily> {
    let mut out = Vec::new();
    for (scope, types) in &snap.sets {
        for (type_url, set) in types {
            out.push(ResourceFamily {
                scope: scope.clone(),
                type_url,
                resources: set
                    .resources
                    .by_name
                    .values()
                    .map(|r| XdsResource::clone(r))
                    .collect(),
            });
        }
    }
    out
}
