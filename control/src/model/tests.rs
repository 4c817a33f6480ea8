//! Model tests: the store, and the writer task's debounce and publication
//! rules (decoding is tested in `ambit-config`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::timeout;

use ambit_config::decode::{DecodeFailure, decode_yaml_document};
use ambit_config::objects::{Kind, Object, ObjectKey};

use super::workloads_tests::store_from;
use super::*;

fn decode(yaml: &str) -> Result<Option<Object>, Box<DecodeFailure>> {
    decode_yaml_document(yaml, 0)
}

#[test]
fn store_apply_reports_changes() {
    let mut store = store_from(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: a}\nstatus: {podIP: 10.0.0.1}\n",
    );
    let key = ObjectKey::new(Kind::Pod, "a", "p");
    let obj = store.get(&key).unwrap();
    assert!(
        !store.apply(Change::Upsert(obj.clone())),
        "identical upsert is no change"
    );
    let mut changed = obj.clone();
    if let Object::Pod(p) = &mut changed {
        p.metadata.labels.insert("x".into(), "y".into());
    }
    assert!(store.apply(Change::Upsert(changed)));
    assert!(store.apply(Change::Delete(key.clone())));
    assert!(
        !store.apply(Change::Delete(key)),
        "deleting twice is no change"
    );
    assert!(store.is_empty());
    assert!(!store.set_errors("f".into(), vec![]));
}

/// One object of each traffic kind, a Node, and Istio's own Gateway (which
/// decoding ignores).
const TRAFFIC_KINDS: &str = "\
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: llm, namespace: a}
spec:
  hosts: [llm]
  http:
  - route:
    - {destination: {host: llm, subset: v1}, weight: 80}
    - {destination: {host: llm, subset: v2}, weight: 20}
    retries: {attempts: 3, perTryTimeout: 2s, retryOn: '5xx,reset'}
---
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata: {name: llm, namespace: a}
spec:
  host: llm
  subsets: [{name: v1, labels: {version: v1}}, {name: v2, labels: {version: v2}}]
---
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: a}
spec: {egress: [{hosts: [./*]}]}
---
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: ingress, namespace: a}
spec: {selector: {istio: ingressgateway}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: waypoint, namespace: a, labels: {istio.io/waypoint-for: service}}
spec:
  gatewayClassName: istio-waypoint
  listeners: [{name: mesh, port: 15008, protocol: HBONE}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: llm, namespace: a}
spec:
  parentRefs: [{group: '', kind: Service, name: llm}]
  rules: [{backendRefs: [{name: llm-v1, port: 80, weight: 80}, {name: llm-v2, port: 80, weight: 20}]}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: {name: embed, namespace: a}
spec: {rules: [{backendRefs: [{name: embed, port: 9000}]}]}
---
apiVersion: gateway.networking.k8s.io/v1alpha2
kind: TCPRoute
metadata: {name: db, namespace: a}
spec: {rules: [{backendRefs: [{name: db, port: 5432}]}]}
---
apiVersion: v1
kind: Node
metadata: {name: node-a}
status: {addresses: [{type: InternalIP, address: 192.168.1.10}]}
";

#[test]
fn store_holds_the_traffic_kinds_and_translation_ignores_them() {
    let pod = "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: a}\nspec: {nodeName: node-a}\nstatus: {podIP: 10.0.0.1}\n";
    let mut store = store_from(&format!("{pod}---\n{TRAFFIC_KINDS}"));
    let keys = [
        ObjectKey::new(Kind::VirtualService, "a", "llm"),
        ObjectKey::new(Kind::DestinationRule, "a", "llm"),
        ObjectKey::new(Kind::Sidecar, "a", "default"),
        ObjectKey::new(Kind::Gateway, "a", "waypoint"),
        ObjectKey::new(Kind::HttpRoute, "a", "llm"),
        ObjectKey::new(Kind::GrpcRoute, "a", "embed"),
        ObjectKey::new(Kind::TcpRoute, "a", "db"),
        ObjectKey::new(Kind::Node, "", "node-a"),
    ];
    assert_eq!(store.len(), keys.len() + 1, "Istio's Gateway is not stored");
    assert!(
        store
            .get(&ObjectKey::new(Kind::Gateway, "a", "ingress"))
            .is_none()
    );
    for key in &keys {
        let obj = store.get(key).unwrap_or_else(|| panic!("{key} is stored"));
        assert_eq!(obj.key(), *key);
        assert!(
            !store.upsert(obj),
            "{key}: an identical upsert is no change"
        );
    }
    assert_eq!(store.nodes().count(), 1);
    // Only the waypoint Gateway reaches the workload API, as the headless
    // `waypoint.a.svc` Service it synthesizes; routes, rules and the rest
    // are for Envoy and leave the pod's address and the policies untouched.
    let options = ModelOptions::default();
    let with = build_snapshot(&store, &Snapshot::default(), &options);
    let without = build_snapshot(&store_from(pod), &Snapshot::default(), &options);
    assert!(with.errors.is_empty(), "{:#?}", with.errors);
    let versions = |s: &Snapshot, type_url: &str| {
        let set = &s.mesh(type_url).by_name;
        let mut v: Vec<(String, String)> = set
            .iter()
            .map(|(n, r)| (n.clone(), r.version.clone()))
            .collect();
        v.sort();
        v
    };
    let authz = ambit_proto::AUTHORIZATION_TYPE_URL;
    assert_eq!(versions(&with, authz), versions(&without, authz));
    let addresses = ambit_proto::ADDRESS_TYPE_URL;
    let mut expected = versions(&without, addresses);
    assert_eq!(expected.len(), 1, "the pod");
    let waypoint = "a/waypoint.a.svc.cluster.local";
    let synthesized = versions(&with, addresses)
        .into_iter()
        .find(|(name, _)| name == waypoint)
        .unwrap_or_else(|| panic!("{waypoint} is synthesized"));
    expected.push(synthesized);
    expected.sort();
    assert_eq!(versions(&with, addresses), expected);
    // Changes flow: an edit replaces, a delete removes, `len` follows.
    let Some(Object::VirtualService(mut vs)) = store.get(&keys[0]) else {
        panic!("not a VirtualService")
    };
    vs.spec.http[0].route[0].weight = 50;
    assert!(store.apply(Change::Upsert(Object::VirtualService(vs))));
    for (removed, key) in keys.iter().enumerate() {
        assert!(store.apply(Change::Delete(key.clone())), "{key}");
        assert!(!store.apply(Change::Delete(key.clone())), "{key} twice");
        assert_eq!(store.len(), keys.len() - removed, "{key}");
    }
    assert!(store.apply(Change::Delete(ObjectKey::new(Kind::Pod, "a", "p"))));
    assert!(store.is_empty());
    assert!(
        store.spaces().next().is_none(),
        "an emptied namespace is dropped"
    );
}

fn pod_obj(name: &str, ip: &str) -> Object {
    decode(&format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: a}}\nstatus: {{podIP: {ip}}}\n"))
        .unwrap()
        .unwrap()
}

fn upsert(objs: Vec<Object>) -> SourceUpdate {
    SourceUpdate {
        source: "test".into(),
        changes: objs.into_iter().map(Change::Upsert).collect(),
        ..Default::default()
    }
}

async fn next(rx: &mut watch::Receiver<Arc<Snapshot>>) -> Arc<Snapshot> {
    timeout(Duration::from_secs(5), rx.changed())
        .await
        .expect("a publication within 5s")
        .unwrap();
    rx.borrow_and_update().clone()
}

#[tokio::test]
async fn debounce_coalesces_a_burst() {
    let opts = ModelOptions {
        debounce_quiet: Duration::from_millis(100),
        debounce_max: Duration::from_secs(2),
        ..Default::default()
    };
    let (handle, mut rx) = spawn_model(opts);
    assert_eq!(rx.borrow().seq, 0);
    handle
        .send(upsert(vec![pod_obj("p1", "10.0.0.1")]))
        .await
        .unwrap();
    handle
        .send(upsert(vec![pod_obj("p2", "10.0.0.2")]))
        .await
        .unwrap();
    handle
        .send(SourceUpdate {
            source: "test".into(),
            changes: vec![
                Change::Delete(ObjectKey::new(Kind::Pod, "a", "p1")),
                Change::Upsert(pod_obj("p3", "10.0.0.3")),
            ],
            initial_sync_done: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let s = next(&mut rx).await;
    assert_eq!(s.seq, 1, "one publication for the burst");
    assert!(s.synced);
    let changed: Vec<&str> = s
        .mesh_delta(ambit_proto::ADDRESS_TYPE_URL)
        .changed
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(
        changed,
        vec!["Kubernetes//Pod/a/p2", "Kubernetes//Pod/a/p3"]
    );
    assert!(
        s.mesh_delta(ambit_proto::ADDRESS_TYPE_URL)
            .removed
            .is_empty(),
        "p1 never reached a publication"
    );
    assert!(
        timeout(Duration::from_millis(300), rx.changed())
            .await
            .is_err(),
        "nothing else is published"
    );

    // The next burst is published against the previous snapshot.
    handle
        .send(SourceUpdate {
            source: "test".into(),
            changes: vec![Change::Delete(ObjectKey::new(Kind::Pod, "a", "p2"))],
            ..Default::default()
        })
        .await
        .unwrap();
    let s2 = next(&mut rx).await;
    assert_eq!(s2.seq, 2);
    assert!(
        s2.mesh_delta(ambit_proto::ADDRESS_TYPE_URL)
            .changed
            .is_empty()
    );
    assert_eq!(
        s2.mesh_delta(ambit_proto::ADDRESS_TYPE_URL)
            .removed
            .iter()
            .collect::<Vec<_>>(),
        vec!["Kubernetes//Pod/a/p2"]
    );
    assert!(Arc::ptr_eq(
        &s2.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name["Kubernetes//Pod/a/p3"],
        &s.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name["Kubernetes//Pod/a/p3"]
    ));
}

#[tokio::test]
async fn debounce_max_bounds_latency_under_constant_updates() {
    let opts = ModelOptions {
        debounce_quiet: Duration::from_millis(200),
        debounce_max: Duration::from_millis(100),
        ..Default::default()
    };
    let (handle, mut rx) = spawn_model(opts);
    let sender = tokio::spawn(async move {
        for i in 0..60 {
            handle
                .send(upsert(vec![pod_obj(
                    &format!("p{i}"),
                    &format!("10.0.1.{i}"),
                )]))
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        handle
    });
    // Updates never pause for 200ms, so only debounce_max can publish.
    let first = next(&mut rx).await;
    assert!(
        first.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name.len() < 60,
        "published before the stream ended"
    );
    let _handle = sender.await.unwrap();
    let mut last = first;
    while last.mesh(ambit_proto::ADDRESS_TYPE_URL).by_name.len() < 60 {
        last = next(&mut rx).await;
    }
    assert!(last.seq >= 2);
}

#[tokio::test]
async fn errors_and_sync_are_published_and_noops_are_not() {
    let (handle, mut rx) = spawn_model(ModelOptions::default());
    let err = ConfigError {
        file: "a.yaml".into(),
        document: 0,
        line: 1,
        kind: "Pod".into(),
        namespace: "a".into(),
        name: "p".into(),
        reason: "bad".into(),
    };
    handle
        .send(SourceUpdate {
            source: "file".into(),
            errors: vec![("a.yaml".into(), vec![err.clone()])],
            ..Default::default()
        })
        .await
        .unwrap();
    let s = next(&mut rx).await;
    assert_eq!(*s.errors, vec![err]);
    assert!(!s.synced);
    // An object that translates to nothing (a pod without IP) changes no
    // resource: no publication.
    let no_ip = decode("apiVersion: v1\nkind: Pod\nmetadata: {name: q, namespace: a}\n")
        .unwrap()
        .unwrap();
    handle.send(upsert(vec![no_ip])).await.unwrap();
    assert!(
        timeout(Duration::from_millis(200), rx.changed())
            .await
            .is_err()
    );
    handle
        .send(SourceUpdate {
            source: "file".into(),
            errors: vec![("a.yaml".into(), vec![])],
            initial_sync_done: true,
            ..Default::default()
        })
        .await
        .unwrap();
    let s = next(&mut rx).await;
    assert_eq!(s.seq, 2);
    assert!(s.errors.is_empty());
    assert!(s.synced);
}

#[tokio::test]
async fn send_fails_once_the_model_is_gone() {
    let (handle, rx) = ModelHandle::channel(1);
    drop(rx);
    let err = handle.send(SourceUpdate::default()).await.unwrap_err();
    assert!(err.to_string().contains("model task has stopped"));
}
