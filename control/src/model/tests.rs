//! Model tests: decoding, the store, and the writer task's debounce and
//! publication rules.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::timeout;

use super::objects::{Kind, Object, ObjectKey, TargetPort};
use super::translate_tests::store_from;
use super::*;

fn decode(yaml: &str) -> Result<Option<Object>, Box<DecodeFailure>> {
    decode_yaml_document(yaml, 0)
}

#[test]
fn api_versions_table() {
    // (apiVersion, kind, accepted?)
    let cases = [
        ("v1", "Pod", true),
        ("apps/v1", "Pod", false),
        ("networking.istio.io/v1", "ServiceEntry", true),
        ("networking.istio.io/v1beta1", "ServiceEntry", true),
        ("networking.istio.io/v1alpha3", "WorkloadEntry", true),
        ("networking.istio.io/v2", "ServiceEntry", false),
        ("security.istio.io/v1", "AuthorizationPolicy", true),
        ("security.istio.io/v1beta1", "PeerAuthentication", true),
        ("security.istio.io/v1alpha1", "PeerAuthentication", false),
        ("discovery.k8s.io/v1", "EndpointSlice", true),
    ];
    for (av, kind, ok) in cases {
        let yaml = format!(
            "apiVersion: {av}\nkind: {kind}\nmetadata: {{name: x, namespace: n}}\nspec: {{hosts: [a.b]}}\n"
        );
        match decode(&yaml) {
            Ok(Some(o)) => assert!(ok, "{av} {kind} should be rejected, got {o:?}"),
            Ok(None) => panic!("{av} {kind} ignored"),
            Err(f) => {
                assert!(!ok, "{av} {kind} rejected: {}", f.error);
                assert!(matches!(f.error, DecodeError::UnsupportedApiVersion { .. }));
                assert_eq!(
                    f.key,
                    Some(ObjectKey::new(Kind::from_kind_str(kind).unwrap(), "n", "x"))
                );
            }
        }
    }
}

#[test]
fn ignored_and_unknown_kinds() {
    for yaml in [
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n",
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {name: v}\n",
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: r}\n",
        "",
        "# only a comment\n",
    ] {
        assert_eq!(decode(yaml).unwrap(), None, "{yaml}");
    }
    let f =
        decode("apiVersion: networking.istio.io/v1\nkind: ServiceEntri\nmetadata: {name: typo}\n")
            .unwrap_err();
    assert!(
        matches!(f.error, DecodeError::UnknownKind { .. }),
        "{:?}",
        f.error
    );
    assert_eq!((f.kind.as_str(), f.name.as_str()), ("ServiceEntri", "typo"));
}

#[test]
fn decode_errors_table() {
    // (document, expected kind/ns/name, key readable, reason fragment)
    let cases = [
        (
            "kind: Pod\nmetadata: {name: p}\n",
            "Pod//p",
            false,
            "missing apiVersion",
        ),
        (
            "apiVersion: v1\nmetadata: {name: p}\n",
            "//p",
            false,
            "missing kind",
        ),
        (
            "apiVersion: v1\nkind: Pod\nmetadata: {namespace: a}\n",
            "Pod/a/",
            false,
            "missing metadata.name",
        ),
        ("- a\n- b\n", "//", false, "not a mapping"),
        (
            "apiVersion: v1\nkind: Pod\nmetadata: {name: [x]}\n",
            "Pod/default/",
            false,
            "metadata.name must be a string",
        ),
        (
            "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: a}\nspec:\n  ports:\n  - port: http\n",
            "Service/a/s",
            true,
            "spec.ports[0].port: invalid type: string \"http\", expected a port number (1-65535) at line 6",
        ),
        (
            "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec:\n  ports:\n  - port: 80\n    targetPort: 'not a name'\n",
            "Service/default/s",
            true,
            "spec.ports[0].targetPort: \"not a name\" is neither a port number",
        ),
        (
            "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec:\n  ports:\n  - port: 80\n    targetPort: 70000\n",
            "Service/default/s",
            true,
            "port 70000 is out of range",
        ),
        (
            "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec:\n  clusterIP: 10.0.0.300\n",
            "Service/default/s",
            true,
            "spec.clusterIP: \"10.0.0.300\" is not a valid IP address",
        ),
        (
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: a}\nstatus: {podIP: 10.1}\n",
            "Pod/a/p",
            true,
            "status.podIP: \"10.1\" is not a valid IP address",
        ),
        (
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: a}\nspec: {hostNetwork: maybe}\n",
            "Pod/a/p",
            true,
            "spec.hostNetwork: invalid type",
        ),
        (
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: e, namespace: a}\naddressType: IPv4\nendpoints: [{addresses: [nope]}]\n",
            "EndpointSlice/a/e",
            true,
            "endpoints[0].addresses: \"nope\" is not a valid IP address",
        ),
        (
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: se, namespace: a}\nspec: {hosts: [x], addresses: [1.2.3]}\n",
            "ServiceEntry/a/se",
            true,
            "spec.addresses: \"1.2.3\" is not an IP address or CIDR",
        ),
        (
            "apiVersion: networking.istio.io/v1\nkind: ServiceEntry\nmetadata: {name: se, namespace: a}\nspec: {hosts: [x], resolution: MAGIC}\n",
            "ServiceEntry/a/se",
            true,
            "spec.resolution: unknown variant `MAGIC`",
        ),
        (
            "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: ap, namespace: a}\nspec:\n  rules: [{to: [{operation: {ports: [http]}}]}]\n",
            "AuthorizationPolicy/a/ap",
            true,
            "\"http\" is not a port number",
        ),
        (
            "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: ap, namespace: a}\nspec:\n  rules: [{from: [{source: {ipBlocks: [10.0.0.0/40]}}]}]\n",
            "AuthorizationPolicy/a/ap",
            true,
            "not an IP address or CIDR",
        ),
        (
            "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: pa, namespace: a}\nspec: {mtls: {mode: SOMETIMES}}\n",
            "PeerAuthentication/a/pa",
            true,
            "spec.mtls.mode: unknown variant `SOMETIMES`",
        ),
        (
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  namespace: a\n labels: {x: y}\n",
            "Pod/a/p",
            false,
            "YAML syntax error",
        ),
    ];
    for (i, (yaml, ident, keyed, reason)) in cases.into_iter().enumerate() {
        let f = decode(yaml).expect_err(&format!("case {i} must be rejected"));
        assert_eq!(
            format!("{}/{}/{}", f.kind, f.namespace, f.name),
            ident,
            "case {i}"
        );
        assert_eq!(f.key.is_some(), keyed, "case {i}");
        let msg = f.error.to_string();
        assert!(msg.contains(reason), "case {i}: {msg:?} lacks {reason:?}");
        assert!(msg.contains("; "), "case {i}: {msg:?} has no hint");
    }
}

#[test]
fn line_offset_shifts_messages() {
    let yaml =
        "apiVersion: v1\nkind: Service\nmetadata: {name: s}\nspec:\n  ports:\n  - port: http\n";
    let f = decode_yaml_document(yaml, 100).unwrap_err();
    assert!(
        f.error.to_string().contains("at line 106 column"),
        "{}",
        f.error
    );
}

#[test]
fn decoded_fields_and_defaults() {
    let o = decode(
        "apiVersion: v1\nkind: Service\nmetadata: {name: s, labels: ~}\nspec:\n  clusterIP: 10.0.0.1\n  clusterIPs: [10.0.0.1, 'fd00::1']\n  selector: {app: a}\n  ports:\n  - {name: a, port: 80, targetPort: http}\n  - {name: b, port: 81, targetPort: '8081'}\n  - {name: c, port: 82}\n",
    )
    .unwrap()
    .unwrap();
    let Object::Service(s) = o else {
        panic!("not a service")
    };
    assert_eq!(s.metadata.namespace, "default");
    assert_eq!(
        s.spec.vips,
        vec![
            "10.0.0.1".parse::<std::net::IpAddr>().unwrap(),
            "fd00::1".parse().unwrap()
        ]
    );
    let targets: Vec<Option<TargetPort>> =
        s.spec.ports.iter().map(|p| p.target_port.clone()).collect();
    assert_eq!(
        targets,
        vec![
            Some(TargetPort::Name("http".into())),
            Some(TargetPort::Number(8081)),
            None
        ]
    );
    let o = decode("apiVersion: v1\nkind: Namespace\nmetadata: {name: n, namespace: ignored}\n")
        .unwrap()
        .unwrap();
    assert_eq!(o.key(), ObjectKey::new(Kind::Namespace, "", "n"));
    assert_eq!(o.key().to_string(), "Namespace//n");
    // JSON-shaped input (future Kubernetes source) goes through decode_value.
    let v: serde_yaml::Value = serde_yaml::to_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "e", "namespace": "a", "labels": {"kubernetes.io/service-name": "s"}},
        "addressType": "IPv4", "endpoints": null, "ports": null
    }))
    .unwrap();
    let Some(Object::EndpointSlice(e)) = decode_value(v).unwrap() else {
        panic!("not a slice")
    };
    assert_eq!(e.service_name(), Some("s"));
    assert!(e.endpoints.is_empty());
}

#[test]
fn config_error_display() {
    let e = ConfigError {
        file: "dir/a.yaml".into(),
        document: 2,
        line: 17,
        kind: "Pod".into(),
        namespace: "ns".into(),
        name: "p".into(),
        reason: "bad".into(),
    };
    assert_eq!(e.to_string(), "dir/a.yaml:17 (document 2) Pod/ns/p: bad");
    assert_eq!(serde_json::to_value(&e).unwrap()["line"], 17);
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
