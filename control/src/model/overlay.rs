//! Overlay sources: an object an overlay source serves (the control
//! plane's `--extra-config-dir`s, source name [`OVERLAY_SOURCE`]) is served
//! instead of the object of the same `kind/namespace/name` any other source
//! serves, whichever arrived first; when the overlay drops it, the other
//! source's version (if it still has one) serves again.
//!
//! Local mode relies on it: `ambitctl local` writes there the injected
//! version of a config pod that asks for a sidecar (what the admission
//! webhook does in Kubernetes), and the pod of the user's directory stays
//! as they wrote it.

use std::collections::BTreeMap;

use super::store::Store;
use super::{Change, Object, ObjectKey};

/// The `source` name of overlay updates.
pub const OVERLAY_SOURCE: &str = "file-overlay";

/// Which keys an overlay serves, with what the other sources serve under
/// each (`None`: nothing). Owned by the model's writer beside the store.
#[derive(Debug, Default)]
pub(super) struct Overlay {
    shadowed: BTreeMap<ObjectKey, Option<Object>>,
}

impl Overlay {
    /// What `change` from `source` does to the store (`None`: nothing now,
    /// it was remembered under an overlay's object).
    pub(super) fn filter(&mut self, store: &Store, source: &str, change: Change) -> Option<Change> {
        let overlay = source == OVERLAY_SOURCE;
        match change {
            Change::Upsert(o) => {
                let k = o.key();
                if overlay {
                    // The store holds the base's version until the overlay's
                    // first one for this key.
                    if let std::collections::btree_map::Entry::Vacant(slot) = self.shadowed.entry(k)
                    {
                        let base = store.get(slot.key());
                        slot.insert(base);
                    }
                    Some(Change::Upsert(o))
                } else if let Some(slot) = self.shadowed.get_mut(&k) {
                    *slot = Some(o);
                    None
                } else {
                    Some(Change::Upsert(o))
                }
            }
            Change::Delete(k) => {
                if overlay {
                    match self.shadowed.remove(&k) {
                        Some(Some(base)) => Some(Change::Upsert(base)),
                        _ => Some(Change::Delete(k)),
                    }
                } else if let Some(slot) = self.shadowed.get_mut(&k) {
                    *slot = None;
                    None
                } else {
                    Some(Change::Delete(k))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ambit_config::objects::Kind;

    fn pod(name: &str, label: &str) -> Object {
        let yaml = format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: ns, labels: {{v: {label}}}}}\nspec: {{}}\n"
        );
        let (objects, errors) =
            ambit_config::dir::parse_documents(std::path::Path::new("t.yaml"), &yaml);
        assert!(errors.is_empty(), "{errors:?}");
        objects.into_iter().next().unwrap()
    }

    fn label(store: &Store, name: &str) -> Option<String> {
        match store.get(&ObjectKey::new(Kind::Pod, "ns", name))? {
            Object::Pod(p) => p.metadata.labels.get("v").cloned(),
            _ => None,
        }
    }

    fn apply(store: &mut Store, overlay: &mut Overlay, source: &str, c: Change) {
        if let Some(c) = overlay.filter(store, source, c) {
            store.apply(c);
        }
    }

    #[test]
    fn the_overlay_wins_in_either_order_and_the_base_returns_when_it_leaves() {
        let key = ObjectKey::new(Kind::Pod, "ns", "a");
        for overlay_first in [true, false] {
            let mut store = Store::default();
            let mut ov = Overlay::default();
            let base = Change::Upsert(pod("a", "base"));
            let over = Change::Upsert(pod("a", "injected"));
            if overlay_first {
                apply(&mut store, &mut ov, OVERLAY_SOURCE, over);
                apply(&mut store, &mut ov, "file", base);
            } else {
                apply(&mut store, &mut ov, "file", base);
                apply(&mut store, &mut ov, OVERLAY_SOURCE, over);
            }
            assert_eq!(label(&store, "a").as_deref(), Some("injected"));
            // The base's edits are kept under the overlay.
            apply(
                &mut store,
                &mut ov,
                "file",
                Change::Upsert(pod("a", "edited")),
            );
            assert_eq!(label(&store, "a").as_deref(), Some("injected"));
            apply(
                &mut store,
                &mut ov,
                OVERLAY_SOURCE,
                Change::Delete(key.clone()),
            );
            assert_eq!(label(&store, "a").as_deref(), Some("edited"));
        }
        // Deleted from the base while overlaid: gone once the overlay goes.
        let mut store = Store::default();
        let mut ov = Overlay::default();
        apply(
            &mut store,
            &mut ov,
            "file",
            Change::Upsert(pod("a", "base")),
        );
        apply(
            &mut store,
            &mut ov,
            OVERLAY_SOURCE,
            Change::Upsert(pod("a", "x")),
        );
        apply(&mut store, &mut ov, "file", Change::Delete(key.clone()));
        assert_eq!(label(&store, "a").as_deref(), Some("x"));
        apply(&mut store, &mut ov, OVERLAY_SOURCE, Change::Delete(key));
        assert_eq!(label(&store, "a"), None);
        // Other keys pass through.
        apply(
            &mut store,
            &mut ov,
            "file",
            Change::Upsert(pod("b", "plain")),
        );
        assert_eq!(label(&store, "b").as_deref(), Some("plain"));
    }
}
