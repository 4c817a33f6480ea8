//! Decoding of the Gateway API kinds (Gateway, HTTPRoute, GRPCRoute,
//! TCPRoute) and of Node: realistic documents into the expected structs,
//! JSON and YAML alike, Istio's Gateway told apart from the Gateway API's,
//! and unusable values rejected with their field path and line.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use super::istio_traffic_tests::{decode_all_forms, labels};
use super::*;
use crate::gateway_api::*;

#[test]
fn waypoint_gateway() {
    let yaml = "\
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: waypoint
  namespace: ai-inference
  labels: {istio.io/waypoint-for: service}
  annotations: {example.com/owner: platform}
spec:
  gatewayClassName: istio-waypoint
  listeners:
  - name: mesh
    port: 15008
    protocol: HBONE
  - name: https
    hostname: '*.example.com'
    port: 443
    protocol: HTTPS
    tls:
      mode: Terminate
      certificateRefs: [{name: example-cert}]
    allowedRoutes:
      namespaces: {from: Selector, selector: {matchLabels: {team: a}}}
      kinds: [{kind: HTTPRoute}]
  addresses: [{type: IPAddress, value: 10.96.0.50}]
  infrastructure:
    labels: {team: a}
    annotations: {note: x}
";
    let Object::Gateway(gw) = decode_all_forms(yaml) else {
        panic!("not a Gateway")
    };
    assert_eq!(gw.metadata.labels["istio.io/waypoint-for"], "service");
    assert_eq!(gw.metadata.annotations["example.com/owner"], "platform");
    assert!(gw.is_waypoint());
    assert_eq!(gw.waypoint_for(), Some(WaypointFor::Service));
    assert_eq!(
        gw.spec.listeners[0],
        Listener {
            name: "mesh".into(),
            hostname: None,
            port: 15008,
            protocol: "HBONE".into(),
            tls: None,
            allowed_routes: None,
        }
    );
    let https = gw.listener("https").unwrap();
    assert_eq!(https.hostname.as_deref(), Some("*.example.com"));
    let tls = https.tls.as_ref().unwrap();
    assert_eq!(tls.mode.as_deref(), Some("Terminate"));
    assert_eq!(tls.certificate_refs[0].name, "example-cert");
    let allowed = https.allowed_routes.as_ref().unwrap();
    let namespaces = allowed.namespaces.as_ref().unwrap();
    assert_eq!(namespaces.from, Some(FromNamespaces::Selector));
    assert_eq!(allowed.kinds[0].kind, "HTTPRoute");
    assert_eq!(
        gw.spec.addresses,
        [GatewayAddress {
            type_: Some("IPAddress".into()),
            value: "10.96.0.50".into()
        }]
    );
    let infra = gw.spec.infrastructure.as_ref().unwrap();
    assert_eq!(infra.labels, labels(&[("team", "a")]));
    assert_eq!(
        Object::Gateway(gw).key(),
        ObjectKey::new(Kind::Gateway, "ai-inference", "waypoint")
    );
}

#[test]
fn istio_gateway_is_ignored_and_gateway_api_gateway_decoded() {
    let istio = "\
apiVersion: networking.istio.io/v1
kind: Gateway
metadata: {name: ingress, namespace: istio-system}
spec:
  selector: {istio: ingressgateway}
  servers:
  - port: {number: 80, name: http, protocol: HTTP}
    hosts: ['*']
";
    assert_eq!(decode_yaml_document(istio, 0).unwrap(), None);
    let v: serde_json::Value = serde_saphyr::from_str(istio).unwrap();
    assert_eq!(decode_json_value(&v).unwrap(), None);
    let api = "apiVersion: gateway.networking.k8s.io/v1beta1\nkind: Gateway\nmetadata: {name: ingress, namespace: istio-system}\nspec: {gatewayClassName: istio}\n";
    let Some(Object::Gateway(gw)) = decode_yaml_document(api, 0).unwrap() else {
        panic!("the Gateway API Gateway is decoded")
    };
    assert_eq!(gw.spec.gateway_class_name, "istio");
    assert!(!gw.is_waypoint());
    assert_eq!(Kind::Gateway.group(), "gateway.networking.k8s.io");
    assert_eq!(
        Kind::from_group_kind("gateway.networking.k8s.io", "Gateway"),
        Some(Kind::Gateway)
    );
    assert_eq!(
        Kind::from_group_kind("networking.istio.io", "Gateway"),
        None
    );
    assert_eq!(
        Kind::from_group_kind("networking.istio.io", "VirtualService"),
        Some(Kind::VirtualService)
    );
    assert_eq!(Kind::from_group_kind("", "Node"), Some(Kind::Node));
    for kind in Kind::ALL {
        let json = serde_json::to_value(kind).unwrap();
        assert_eq!(
            json,
            kind.as_str(),
            "{kind:?} serializes as its kind string"
        );
        assert_eq!(
            Kind::from_group_kind(kind.group(), kind.as_str()),
            Some(kind)
        );
    }
}

pub(super) const GAMMA_CANARY_ROUTE: &str = "\
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: llm-canary, namespace: ai-inference}
spec:
  parentRefs:
  - {group: '', kind: Service, name: llm, port: 8080}
  rules:
  - name: premium
    matches:
    - headers: [{name: x-user-tier, value: premium}]
    backendRefs:
    - {name: llm-v2, port: 8080}
  - matches:
    - path: {type: PathPrefix, value: /v1/completions}
      method: POST
      queryParams: [{type: RegularExpression, name: model, value: '^llama-.*'}]
    filters:
    - type: RequestHeaderModifier
      requestHeaderModifier:
        set: [{name: x-route, value: canary}]
        remove: [x-debug]
    - type: RequestMirror
      requestMirror:
        backendRef: {name: llm-shadow, port: 8080}
        percent: 5
    backendRefs:
    - {name: llm-v1, port: 8080, weight: 80}
    - name: llm-v2
      port: 8080
      weight: 20
      filters:
      - type: ResponseHeaderModifier
        responseHeaderModifier:
          add: [{name: x-canary, value: 'true'}]
    timeouts: {request: 10s, backendRequest: 2s}
";

#[test]
fn gamma_canary_http_route() {
    let Object::HttpRoute(route) = decode_all_forms(GAMMA_CANARY_ROUTE) else {
        panic!("not an HTTPRoute")
    };
    let header = |name: &str, value: &str| HttpHeader {
        name: name.into(),
        value: value.into(),
    };
    let backend = |name: &str, weight: Option<u32>, filters: Vec<HttpRouteFilter>| HttpBackendRef {
        group: None,
        kind: None,
        name: name.into(),
        namespace: None,
        port: Some(8080),
        weight,
        filters,
    };
    let expected = HttpRouteSpec {
        parent_refs: vec![ParentReference {
            group: Some(String::new()),
            kind: Some("Service".into()),
            namespace: None,
            name: "llm".into(),
            section_name: None,
            port: Some(8080),
        }],
        hostnames: vec![],
        rules: vec![
            HttpRouteRule {
                name: Some("premium".into()),
                matches: vec![HttpRouteMatch {
                    headers: vec![HttpHeaderMatch {
                        type_: ValueMatchType::Exact,
                        name: "x-user-tier".into(),
                        value: "premium".into(),
                    }],
                    ..HttpRouteMatch::default()
                }],
                backend_refs: vec![backend("llm-v2", None, vec![])],
                ..HttpRouteRule::default()
            },
            HttpRouteRule {
                name: None,
                matches: vec![HttpRouteMatch {
                    path: Some(HttpPathMatch {
                        type_: PathMatchType::PathPrefix,
                        value: "/v1/completions".into(),
                    }),
                    headers: vec![],
                    query_params: vec![HttpQueryParamMatch {
                        type_: ValueMatchType::RegularExpression,
                        name: "model".into(),
                        value: "^llama-.*".into(),
                    }],
                    method: Some(HttpMethod::Post),
                }],
                filters: vec![
                    HttpRouteFilter::RequestHeaderModifier(HttpHeaderFilter {
                        set: vec![header("x-route", "canary")],
                        add: vec![],
                        remove: vec!["x-debug".into()],
                    }),
                    HttpRouteFilter::RequestMirror(HttpRequestMirrorFilter {
                        backend_ref: BackendObjectReference {
                            group: None,
                            kind: None,
                            name: "llm-shadow".into(),
                            namespace: None,
                            port: Some(8080),
                        },
                        percent: Some(5),
                        fraction: None,
                    }),
                ],
                backend_refs: vec![
                    backend("llm-v1", Some(80), vec![]),
                    backend(
                        "llm-v2",
                        Some(20),
                        vec![HttpRouteFilter::ResponseHeaderModifier(HttpHeaderFilter {
                            add: vec![header("x-canary", "true")],
                            ..HttpHeaderFilter::default()
                        })],
                    ),
                ],
                timeouts: Some(HttpRouteTimeouts {
                    request: Some(Duration::from_secs(10)),
                    backend_request: Some(Duration::from_secs(2)),
                }),
            },
        ],
    };
    assert_eq!(route.spec, expected);
    // Defaults and helpers.
    let parents: Vec<&str> = route.service_parents().map(|p| p.name.as_str()).collect();
    assert_eq!(parents, ["llm"]);
    assert!(!route.spec.parent_refs[0].is_gateway());
    let weights: Vec<(&str, u32, bool)> = route
        .backend_refs()
        .map(|b| (b.name.as_str(), b.effective_weight(), b.is_service()))
        .collect();
    assert_eq!(
        weights,
        [
            ("llm-v2", 1, true),
            ("llm-v1", 80, true),
            ("llm-v2", 20, true)
        ]
    );
    assert_eq!(
        route.spec.rules[0].matches[0].effective_path(),
        HttpPathMatch::default()
    );
    assert_eq!(
        route.spec.rules[0].backend_refs[0].effective_namespace("ai-inference"),
        "ai-inference"
    );
}

#[test]
fn http_route_redirects_rewrites_and_gateway_parents() {
    let yaml = "\
apiVersion: gateway.networking.k8s.io/v1beta1
kind: HTTPRoute
metadata: {name: edge, namespace: web}
spec:
  parentRefs: [{name: ingress, namespace: istio-system, sectionName: https}]
  hostnames: [web.example.com]
  rules:
  - matches: [{path: {type: Exact, value: /old}}]
    filters:
    - type: RequestRedirect
      requestRedirect: {scheme: https, statusCode: 301, path: {type: ReplaceFullPath, replaceFullPath: /new}}
  - matches: [{path: {type: RegularExpression, value: '^/api/v[0-9]+/'}}]
    filters:
    - type: URLRewrite
      urlRewrite: {hostname: api.internal, path: {type: ReplacePrefixMatch, replacePrefixMatch: /}}
    - type: ExtensionRef
      extensionRef: {group: example.com, kind: RateLimit, name: slow}
    backendRefs: [{name: api, namespace: backend, port: 80}]
";
    let Object::HttpRoute(route) = decode_all_forms(yaml) else {
        panic!("not an HTTPRoute")
    };
    let parent = &route.spec.parent_refs[0];
    assert!(parent.is_gateway() && !parent.is_service());
    assert_eq!(parent.effective_namespace("web"), "istio-system");
    assert_eq!(parent.section_name.as_deref(), Some("https"));
    assert_eq!(
        route.spec.rules[0].filters,
        [HttpRouteFilter::RequestRedirect(
            HttpRequestRedirectFilter {
                scheme: Some("https".into()),
                hostname: None,
                path: Some(HttpPathModifier::ReplaceFullPath("/new".into())),
                port: None,
                status_code: Some(301),
            }
        )]
    );
    let rule = &route.spec.rules[1];
    assert_eq!(
        rule.matches[0].path.as_ref().unwrap().type_,
        PathMatchType::RegularExpression
    );
    assert_eq!(
        rule.filters,
        [
            HttpRouteFilter::UrlRewrite(HttpUrlRewriteFilter {
                hostname: Some("api.internal".into()),
                path: Some(HttpPathModifier::ReplacePrefixMatch("/".into())),
            }),
            HttpRouteFilter::ExtensionRef(LocalObjectReference {
                group: "example.com".into(),
                kind: "RateLimit".into(),
                name: "slow".into(),
            }),
        ]
    );
    assert_eq!(rule.backend_refs[0].effective_namespace("web"), "backend");
}

#[test]
fn grpc_and_tcp_routes_and_nodes() {
    let grpc = "\
apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: {name: embed, namespace: ai-inference}
spec:
  parentRefs: [{kind: Service, group: '', name: embedding}]
  rules:
  - matches: [{method: {service: embed.v1.Embedder, method: Embed}, headers: [{name: x-tier, value: gold}]}]
    backendRefs: [{name: embedding-v2, port: 9000, weight: 10}]
";
    let Object::GrpcRoute(g) = decode_all_forms(grpc) else {
        panic!("not a GRPCRoute")
    };
    let m = g.spec.rules[0].matches[0].method.as_ref().unwrap();
    assert_eq!(
        (m.service.as_deref(), m.method.as_deref()),
        (Some("embed.v1.Embedder"), Some("Embed"))
    );
    assert_eq!(g.spec.rules[0].backend_refs[0].effective_weight(), 10);
    let tcp = "\
apiVersion: gateway.networking.k8s.io/v1alpha2
kind: TCPRoute
metadata: {name: db, namespace: ai-inference}
spec:
  parentRefs: [{name: waypoint, sectionName: tcp}]
  rules:
  - backendRefs: [{name: vector-db, port: 6333}]
";
    let Object::TcpRoute(t) = decode_all_forms(tcp) else {
        panic!("not a TCPRoute")
    };
    let b = &t.spec.rules[0].backend_refs[0];
    assert_eq!(
        (b.name.as_str(), b.port, b.effective_weight()),
        ("vector-db", Some(6333), 1)
    );
    let node = "\
apiVersion: v1
kind: Node
metadata: {name: node-a, namespace: ignored, labels: {topology.kubernetes.io/zone: z1}}
spec: {podCIDR: 10.244.1.0/24}
status:
  addresses:
  - {type: InternalIP, address: 192.168.1.10}
  - {type: InternalIP, address: 'fd00::10'}
  - {type: Hostname, address: node-a}
";
    let Object::Node(n) = decode_all_forms(node) else {
        panic!("not a Node")
    };
    assert_eq!(n.metadata.labels["topology.kubernetes.io/zone"], "z1");
    assert_eq!(
        n.internal_ips()
            .map(|ip| ip.to_string())
            .collect::<Vec<_>>(),
        ["192.168.1.10", "fd00::10"]
    );
    assert_eq!(
        Object::Node(n).key(),
        ObjectKey::new(Kind::Node, "", "node-a")
    );
}
