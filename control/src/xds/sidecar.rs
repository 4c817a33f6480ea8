//! The sidecar generator: upstream Envoy's CDS, EDS, LDS and RDS (in that
//! ADS order) for a sidecar pod — the outbound set its namespace's sidecars
//! share (`sidecar/<namespace>`, the namespace the proxy was authorized
//! for) merged with its own inbound set (`sidecar/<namespace>/<pod>/<sa>`,
//! served only for the service account the proxy was authorized as: a
//! proxy cannot read another service account's pod by naming it).

use super::{Generator, Served, TypeSpec};
use crate::model::sidecar::{namespace_scope, pod_scope};
use crate::model::snapshot::Snapshot;
use crate::xds::proxy::{ProxyKind, ProxyNode};

/// Serves sidecars their own Envoy configuration.
#[derive(Debug, Default)]
pub struct SidecarGenerator;

impl Generator for SidecarGenerator {
    fn kind(&self) -> ProxyKind {
        ProxyKind::Sidecar
    }

    fn types(&self) -> &'static [TypeSpec] {
        super::waypoint::ENVOY_TYPES
    }

    fn generate(&self, proxy: &ProxyNode, snap: &Snapshot, type_url: &str) -> Served {
        if proxy.namespace.is_empty()
            || proxy.pod_name.is_empty()
            || proxy.service_account.is_empty()
        {
            // A sidecar that names no pod, or no service account for its
            // credentials to prove, is served nothing (it waits, and
            // `/debug/connections` shows it).
            return Served::empty();
        }
        let shared = namespace_scope(&proxy.namespace);
        let own = pod_scope(&proxy.namespace, &proxy.pod_name, &proxy.service_account);
        Served::merge(vec![
            Served::from_snapshot(snap, &shared, type_url),
            Served::from_snapshot(snap, &own, type_url),
        ])
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::path::Path;
    use std::sync::Arc;

    use envoy_types::pb::envoy::config::core::v3::Node;

    use super::*;
    use crate::model::waypoint::{CLUSTER_TYPE, ENDPOINT_TYPE, LISTENER_TYPE};
    use crate::model::{ModelOptions, Store, build_snapshot};

    fn snapshot(extra: &str, prev: &Snapshot) -> Snapshot {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let read = |p: &str| std::fs::read_to_string(dir.join(p)).unwrap();
        let text = format!(
            "{}\n---\n{}\n---\n{extra}",
            read("waypoint/base.yaml"),
            read("sidecar/base.yaml")
        );
        let (objects, errors) = ambit_config::parse_documents(Path::new("t.yaml"), &text);
        assert!(errors.is_empty(), "{errors:#?}");
        build_snapshot(
            &Store::from_objects(objects),
            prev,
            &ModelOptions::default(),
        )
    }

    /// A sidecar node claiming service account `sa` (`""`: none).
    fn proxy(id: &str, sa: &str) -> ProxyNode {
        use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
        let metadata = (!sa.is_empty()).then(|| Struct {
            fields: [(
                "SERVICE_ACCOUNT".to_string(),
                Value {
                    kind: Some(Kind::StringValue(sa.to_string())),
                },
            )]
            .into_iter()
            .collect(),
        });
        ProxyNode::from_node(Some(&Node {
            id: id.into(),
            metadata,
            ..Default::default()
        }))
    }

    fn names(s: &Served) -> Vec<String> {
        let mut out: Vec<String> = s.set.by_name.keys().cloned().collect();
        out.sort();
        out
    }

    #[test]
    fn a_sidecar_gets_its_namespace_and_its_own_pod_merged() {
        let snap = snapshot("", &Snapshot::default());
        let p = proxy(
            "sidecar~10.10.2.10~client-0.legacy~legacy.svc.cluster.local",
            "client",
        );
        assert_eq!(p.kind, ProxyKind::Sidecar);
        let g = SidecarGenerator;
        let lds = g.generate(&p, &snap, LISTENER_TYPE);
        let got = names(&lds);
        for l in [
            "virtualOutbound",
            "virtualInbound",
            "connect_terminate",
            "main_internal",
        ] {
            assert!(got.contains(&l.to_string()), "{l}: {got:?}");
        }
        let cds = names(&g.generate(&p, &snap, CLUSTER_TYPE));
        assert!(
            cds.contains(&"InboundPassthroughCluster".to_string()),
            "{cds:?}"
        );
        assert!(cds.contains(&"PassthroughCluster".to_string()), "{cds:?}");
        // Only the namespace has endpoints: its set comes back as is.
        let eds = g.generate(&p, &snap, ENDPOINT_TYPE);
        let shared = Served::from_snapshot(&snap, &namespace_scope("legacy"), ENDPOINT_TYPE);
        assert!(Arc::ptr_eq(&eds.set, &shared.set));
        // Another pod of the namespace shares the outbound set, not the inbound one.
        let other = proxy(
            "sidecar~10.10.2.99~ghost-0.legacy~legacy.svc.cluster.local",
            "client",
        );
        let got = names(&g.generate(&other, &snap, LISTENER_TYPE));
        assert!(got.contains(&"virtualOutbound".to_string()));
        assert!(!got.contains(&"virtualInbound".to_string()), "{got:?}");
        // Naming a pod of another service account does not read its
        // inbound side; claiming no service account reads nothing.
        let impostor = proxy(
            "sidecar~10.10.2.98~client-0.legacy~legacy.svc.cluster.local",
            "db",
        );
        let got = names(&g.generate(&impostor, &snap, LISTENER_TYPE));
        assert!(!got.contains(&"virtualInbound".to_string()), "{got:?}");
        let anonymous = proxy(
            "sidecar~10.10.2.10~client-0.legacy~legacy.svc.cluster.local",
            "",
        );
        assert!(names(&g.generate(&anonymous, &snap, LISTENER_TYPE)).is_empty());
    }

    fn part(names: &[&str], changed: &[&str], removed: Option<&[&str]>) -> Served {
        use crate::model::snapshot::{ResourceDelta, ResourceSet, XdsResource};
        let mut set = ResourceSet::default();
        for n in names {
            let l = envoy_types::pb::envoy::config::listener::v3::Listener {
                name: n.to_string(),
                ..Default::default()
            };
            let r = XdsResource::new(LISTENER_TYPE, n.to_string(), Vec::new(), &l);
            set.by_name.insert(n.to_string(), Arc::new(r));
        }
        let own = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        Served {
            set: Arc::new(set),
            delta: removed.map(|r| {
                Arc::new(ResourceDelta {
                    changed: own(changed),
                    removed: own(r),
                })
            }),
        }
    }

    #[test]
    fn merging_keeps_removals_moves_and_unknown_deltas_apart() {
        // An empty part that removed nothing adds nothing: the other part
        // comes back pointer-equal.
        let a = part(&["a"], &[], Some(&[]));
        let merged = Served::merge(vec![a.clone(), part(&[], &[], Some(&[]))]);
        assert!(Arc::ptr_eq(&merged.set, &a.set));
        // A part emptied by removals still reports them.
        let merged = Served::merge(vec![
            part(&["a"], &["a"], Some(&[])),
            part(&[], &[], Some(&["b"])),
        ]);
        let d = merged.delta.clone().unwrap();
        assert_eq!(d.removed.iter().collect::<Vec<_>>(), vec!["b"]);
        assert_eq!(names(&merged), vec!["a"]);
        // A name that moved between parts is changed, not removed.
        let merged = Served::merge(vec![
            part(&["x"], &["x"], Some(&[])),
            part(&["y"], &[], Some(&["x"])),
        ]);
        assert!(merged.delta.unwrap().removed.is_empty());
        // A part whose changes are unknown (a scope that vanished): no
        // delta, the stream diffs the sets.
        let merged = Served::merge(vec![part(&["a"], &[], Some(&[])), part(&[], &[], None)]);
        assert!(merged.delta.is_none());
        assert_eq!(names(&merged), vec!["a"]);
    }

    #[test]
    fn the_merged_delta_is_the_union_of_the_scopes_changes() {
        let first = snapshot("", &Snapshot::default());
        let second = snapshot(
            "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: legacy}
spec:
  mtls: {mode: STRICT}
",
            &first,
        );
        let p = proxy(
            "sidecar~10.10.2.10~client-0.legacy~legacy.svc.cluster.local",
            "client",
        );
        let lds = SidecarGenerator.generate(&p, &second, LISTENER_TYPE);
        let delta = lds.delta.expect("both scopes have deltas");
        assert_eq!(
            delta.changed.iter().cloned().collect::<Vec<_>>(),
            vec!["virtualInbound".to_string()]
        );
        assert!(delta.removed.is_empty());
        // Nothing changed: an empty delta (no push).
        let third = snapshot(
            "
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: legacy}
spec:
  mtls: {mode: STRICT}
",
            &second,
        );
        let lds = SidecarGenerator.generate(&p, &third, LISTENER_TYPE);
        assert!(lds.delta.unwrap().is_empty());
    }
}
