//! The control plane's own findings (AMB0008): `analyze` translates the
//! objects with the control plane's model, exactly as `ambit-control`
//! would, and reports what the translation lists in `Snapshot.errors` —
//! except what a check here already reports in its own words.

use ambit_control::model::{ModelOptions, Snapshot, build_snapshot};

use super::super::message::{Message, Resource, TRANSLATION_FINDING};
use super::super::{Mesh, Origin};
use ambit_config::objects::{Kind, ObjectKey};

/// Findings the analyzer's own checks cover across the whole mesh (the
/// model finds them only for services bound to a waypoint): undefined
/// subsets and hosts (IST0101), competing VirtualServices (IST0109).
const COVERED: &[&str] = &[
    "which no DestinationRule defines",
    "VirtualServices claim host",
    "which is no Service of the mesh",
];

pub(super) fn findings(mesh: &Mesh, out: &mut Vec<Message>) {
    let snap = build_snapshot(&mesh.store, &Snapshot::default(), &ModelOptions::default());
    for e in snap.errors.iter().filter(|e| e.file.is_empty()) {
        if COVERED.iter().any(|c| e.reason.contains(c)) {
            continue;
        }
        let origin: Option<Origin> = Kind::from_kind_str(&e.kind)
            .map(|k| ObjectKey::new(k, e.namespace.clone(), e.name.clone()))
            .and_then(|k| mesh.docs.get(&k))
            .and_then(|d| d.origin.clone());
        out.push(Message::new(
            TRANSLATION_FINDING,
            Resource {
                kind: e.kind.clone(),
                namespace: e.namespace.clone(),
                name: e.name.clone(),
            },
            origin,
            e.reason.clone(),
        ));
    }
}
