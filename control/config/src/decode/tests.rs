//! Decoding tests: accepted API versions, ignored and unknown kinds, error
//! messages (what, where, what to do) and decoded defaults.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::objects::TargetPort;

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
        ("networking.istio.io/v1", "VirtualService", true),
        ("networking.istio.io/v1beta1", "DestinationRule", true),
        ("networking.istio.io/v1alpha3", "Sidecar", true),
        ("security.istio.io/v1", "VirtualService", false),
        ("gateway.networking.k8s.io/v1", "Gateway", true),
        ("gateway.networking.k8s.io/v1beta1", "HTTPRoute", true),
        ("gateway.networking.k8s.io/v1alpha2", "HTTPRoute", false),
        ("gateway.networking.k8s.io/v1", "GRPCRoute", true),
        ("gateway.networking.k8s.io/v1alpha2", "TCPRoute", true),
        ("gateway.networking.k8s.io/v1", "TCPRoute", true),
        ("v1", "Gateway", false),
        ("v1", "Node", true),
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
        "apiVersion: networking.istio.io/v1\nkind: EnvoyFilter\nmetadata: {name: v}\n",
        "apiVersion: networking.istio.io/v1beta1\nkind: Gateway\nmetadata: {name: ingress}\n",
        "apiVersion: security.istio.io/v1\nkind: RequestAuthentication\nmetadata: {name: j}\n",
        // Only the ConfigMap `istio` of a root namespace is modelled.
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: istio, namespace: shop}\n",
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: other, namespace: istio-system}\n",
        "apiVersion: gateway.networking.k8s.io/v1\nkind: GatewayClass\nmetadata: {name: c}\n",
        "apiVersion: gateway.networking.k8s.io/v1beta1\nkind: ReferenceGrant\nmetadata: {name: g}\n",
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
            "spec.hostNetwork: invalid boolean (strict mode expects true/false) at line 4 column 21",
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
    // Empty sections are null: read as defaults, in YAML and in JSON.
    let pa = decode("apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: p, namespace: a}\nspec:\n")
        .unwrap()
        .unwrap();
    assert!(matches!(pa, Object::PeerAuthentication(p) if p.spec.mtls.is_none()));
    let j = br#"{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": null, "status": null}"#;
    assert!(matches!(decode_json(j), Ok(Some(Object::Pod(_)))));
    assert_eq!(o.key().to_string(), "Namespace//n");
    // The Kubernetes source hands over JSON directly: a value or bytes.
    let v = serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "e", "namespace": "a", "labels": {"kubernetes.io/service-name": "s"}},
        "addressType": "IPv4", "endpoints": null, "ports": null
    });
    let Some(Object::EndpointSlice(e)) = decode_json_value(&v).unwrap() else {
        panic!("not a slice")
    };
    assert_eq!(e.service_name(), Some("s"));
    assert!(e.endpoints.is_empty());
    let Some(Object::EndpointSlice(e2)) = decode_json(v.to_string().as_bytes()).unwrap() else {
        panic!("not a slice")
    };
    assert_eq!(e, e2);
}

#[test]
fn json_errors_name_the_object_and_the_field() {
    let bad_port = br#"{"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "s", "namespace": "a"},
        "spec": {"ports": [{"port": "http"}]}}"#;
    let f = decode_json(bad_port).unwrap_err();
    assert_eq!(f.key, Some(ObjectKey::new(Kind::Service, "a", "s")));
    let msg = f.error.to_string();
    assert!(msg.contains("spec.ports[0].port: invalid type"), "{msg}");
    assert!(msg.contains("line 3"), "JSON errors carry the line: {msg}");
    let v: serde_json::Value = serde_json::from_slice(bad_port).unwrap();
    let f = decode_json_value(&v).unwrap_err();
    assert!(
        f.error.to_string().contains("spec.ports[0].port"),
        "{}",
        f.error
    );

    let f =
        decode_json(br#"{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "#).unwrap_err();
    assert!(
        matches!(f.error, DecodeError::JsonSyntax(_)),
        "{:?}",
        f.error
    );
    assert!(
        f.error.to_string().contains("JSON syntax error"),
        "{}",
        f.error
    );
    let f = decode_json(b"[1, 2]").unwrap_err();
    assert!(
        matches!(f.error, DecodeError::NotAnObject("a list")),
        "{:?}",
        f.error
    );
    assert_eq!(decode_json(b"null").unwrap(), None);
}

/// Decodes `yaml`, expects a rejection naming a limit, quickly.
fn rejected_by_limit(yaml: &str, limit: &str) {
    let started = std::time::Instant::now();
    let f = decode(yaml).expect_err("must be rejected");
    let took = started.elapsed();
    let msg = f.error.to_string();
    // The hostile files this guards against took ~60 s; a debug build on
    // a loaded 2-core machine needs ~1 s for these, so 5 s is the bound.
    assert!(
        took < std::time::Duration::from_secs(5),
        "took {took:?} to reject ({msg})"
    );
    assert!(matches!(f.error, DecodeError::Limit(_)), "{msg}");
    assert!(msg.contains(limit), "{msg:?} does not name {limit:?}");
    assert!(!msg.contains("indentation"), "not a syntax hint: {msg}");
}

#[test]
fn deep_nesting_is_rejected_quickly_naming_the_limit() {
    let n = 100_000;
    // 500 KB of flow mappings nested 100,000 deep (took ~60 s to reject).
    let flow = format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\nspec: {}x{}\n",
        "{a: ".repeat(n),
        "}".repeat(n)
    );
    rejected_by_limit(&flow, "deeper than 64 levels (the nesting-depth limit)");
    rejected_by_limit(&format!("{}x\n", "[".repeat(n)), "nesting-depth limit");
    rejected_by_limit(&format!("{}x\n", "- ".repeat(n)), "nesting-depth limit");
    let block: String = (0..150)
        .map(|i| format!("{}k{i}:\n", "  ".repeat(i)))
        .collect();
    rejected_by_limit(&block, "nesting-depth limit");
    // 64 levels are fine, and fit the default stack of a Rust or tokio
    // blocking thread (2 MiB, where readers run) even in a debug build, in
    // YAML and in JSON (serde_json stops at 128 levels by itself).
    let ok: String = (0..63)
        .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
        .collect();
    let flow_ok = format!("{}x{}", "{a: ".repeat(61), "}".repeat(61));
    let json_ok = format!("{}1{}", "{\"a\": ".repeat(127), "}".repeat(127));
    let deep_ok = std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(move || {
            let yaml = |body: &str| {
                decode(&format!("apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: c}}\ndata:\n{body}"))
                    .map_err(|f| f.error.to_string())
            };
            let pod = format!("apiVersion: v1\nkind: Pod\nmetadata: {{name: p}}\nspec: {{x: {flow_ok}}}\n");
            (
                yaml(&ok),
                decode(&pod).map(|o| o.is_some()).map_err(|f| f.error.to_string()),
                decode_json(format!("{{\"apiVersion\": \"v1\", \"kind\": \"Pod\", \"metadata\": {{\"name\": \"p\"}}, \"spec\": {json_ok}}}").as_bytes())
                    .map(|o| o.is_some())
                    .map_err(|f| f.error.to_string()),
            )
        })
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(deep_ok, (Ok(None), Ok(true), Ok(true)));
}

#[test]
fn alias_bombs_are_rejected_quickly_naming_the_limit() {
    let mut bomb = String::from(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nx0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n",
    );
    for i in 1..10 {
        let p = i - 1;
        bomb += &format!(
            "x{i}: &x{i} [*x{p}, *x{p}, *x{p}, *x{p}, *x{p}, *x{p}, *x{p}, *x{p}, *x{p}]\n"
        );
    }
    rejected_by_limit(&bomb, "(the alias-expansion limit; a YAML alias bomb?)");
    let many: String = std::iter::once(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nv: &v 1\nl:\n".to_string(),
    )
    .chain((0..1_500).map(|_| "- *v\n".to_string()))
    .collect();
    rejected_by_limit(&many, "more than 1000 aliases (the alias limit)");
    // Ordinary anchors still work.
    let ok = "apiVersion: v1\nkind: Pod\nmetadata: {name: p, namespace: a, labels: &l {app: web}, annotations: *l}\n";
    let Some(Object::Pod(p)) = decode(ok).unwrap() else {
        panic!("not a pod")
    };
    assert_eq!(p.metadata.annotations["app"], "web");
}

#[test]
fn oversized_documents_are_rejected_before_parsing() {
    let big = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n{}",
        "# padding padding padding padding padding padding padding\n".repeat(40_000)
    );
    rejected_by_limit(
        &big,
        "more than the limit of 2097152 bytes (the document-size limit)",
    );
    let f = decode(&big).unwrap_err();
    assert_eq!(
        (f.kind.as_str(), f.name.as_str()),
        ("Pod", "p"),
        "still named"
    );
    let json = format!("{{\"pad\": \"{}\"}}", "x".repeat(3 << 20));
    let f = decode_json(json.as_bytes()).unwrap_err();
    assert!(
        f.error.to_string().contains("document-size limit"),
        "{}",
        f.error
    );
}

#[test]
fn the_mesh_config_and_telemetry_decode() {
    let yaml = "apiVersion: v1
kind: ConfigMap
metadata: {name: istio, namespace: istio-system}
data:
  mesh: |-
    enableTracing: true
    defaultConfig:
      discoveryAddress: istiod.istio-system.svc:15012
      tracing: {sampling: 2.5}
    extensionProviders:
    - name: otel
      opentelemetry: {service: otel.observability.svc.cluster.local, port: 4317, maxTagLength: 99}
    - name: prom
      prometheus: {}
    defaultProviders: {tracing: [otel], metrics: [prom]}
";
    let Some(Object::MeshConfig(m)) = decode(yaml).unwrap() else {
        panic!("not the mesh config")
    };
    assert_eq!(m.mesh.enable_tracing, Some(true));
    assert_eq!(m.mesh.default_providers.tracing, ["otel"]);
    let otel = m.mesh.extension_providers[0]
        .opentelemetry
        .as_ref()
        .unwrap();
    assert_eq!((otel.port, otel.max_tag_length), (4317, Some(99)));
    assert!(m.mesh.extension_providers[1].opentelemetry.is_none());
    assert_eq!(m.mesh.default_config.tracing.unwrap().sampling, Some(2.5));

    let t = "apiVersion: telemetry.istio.io/v1
kind: Telemetry
metadata: {name: mesh-default, namespace: istio-system}
spec:
  tracing: [{providers: [{name: otel}], randomSamplingPercentage: 100}]
  metrics: [{providers: [{name: prometheus}]}]
";
    let Some(Object::Telemetry(t)) = decode(t).unwrap() else {
        panic!("not a Telemetry")
    };
    assert!(t.spec.is_namespace_wide());
    assert_eq!(t.spec.tracing[0].random_sampling_percentage, Some(100.0));
}

#[test]
fn a_bad_mesh_config_or_sampling_is_rejected_with_its_place() {
    let bad_yaml = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: istio, namespace: ambit-system}\ndata:\n  mesh: \"extensionProviders: [{name: otel\"\n";
    let f = decode(bad_yaml).unwrap_err();
    assert_eq!(f.key.as_ref().map(|k| k.kind), Some(Kind::MeshConfig));
    assert!(f.error.to_string().contains("data.mesh"), "{}", f.error);
    let no_port = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: istio, namespace: istio-system}\ndata:\n  mesh: \"extensionProviders: [{name: otel, opentelemetry: {service: otel}}]\"\n";
    let f = decode(no_port).unwrap_err();
    assert!(
        f.error.to_string().contains("service and port"),
        "{}",
        f.error
    );
    let pct = "apiVersion: telemetry.istio.io/v1\nkind: Telemetry\nmetadata: {name: t, namespace: shop}\nspec:\n  tracing: [{randomSamplingPercentage: 150}]\n";
    let f = decode(pct).unwrap_err();
    assert!(
        f.error.to_string().contains("randomSamplingPercentage"),
        "{}",
        f.error
    );
}
