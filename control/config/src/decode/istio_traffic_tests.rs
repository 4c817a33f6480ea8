//! Decoding of Istio's traffic kinds (VirtualService, DestinationRule,
//! Sidecar): realistic documents into the expected structs, JSON and YAML
//! alike, and every unusable value rejected with its field path and line.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use crate::networking::*;
use crate::objects::{LabelSelector, Labels, ObjectMeta, WorkloadSelector};

/// Decodes `yaml`, and its JSON form both as bytes and as a value; all
/// three must agree.
pub(super) fn decode_all_forms(yaml: &str) -> Object {
    let from_yaml = decode_yaml_document(yaml, 0)
        .unwrap_or_else(|f| panic!("YAML rejected: {}", f.error))
        .expect("a modelled kind");
    let value: serde_json::Value = serde_saphyr::from_str(yaml).unwrap();
    let from_bytes = decode_json(value.to_string().as_bytes())
        .unwrap_or_else(|f| panic!("JSON rejected: {}", f.error))
        .expect("a modelled kind");
    let from_value = decode_json_value(&value).unwrap().unwrap();
    assert_eq!(from_yaml, from_bytes, "YAML and JSON bytes differ");
    assert_eq!(from_yaml, from_value, "YAML and JSON value differ");
    from_yaml
}

pub(super) fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub(super) fn meta(namespace: &str, name: &str) -> ObjectMeta {
    ObjectMeta {
        name: name.into(),
        namespace: namespace.into(),
        ..ObjectMeta::default()
    }
}

fn dest(host: &str, subset: &str, port: Option<u16>) -> Destination {
    Destination {
        host: host.into(),
        subset: subset.into(),
        port: port.map(|number| PortSelector { number }),
    }
}

const MS: fn(u64) -> Duration = Duration::from_millis;

pub(super) const CANARY_DESTINATION_RULE: &str = "\
apiVersion: networking.istio.io/v1
kind: DestinationRule
metadata:
  name: llm
  namespace: ai-inference
spec:
  host: llm.ai-inference.svc.cluster.local
  exportTo: [\".\"]
  workloadSelector:
    matchLabels: {app: orchestrator}
  trafficPolicy:
    loadBalancer:
      simple: LEAST_REQUEST
      warmupDurationSecs: 60s
    connectionPool:
      tcp:
        maxConnections: 100
        connectTimeout: 30ms
        tcpKeepalive: {probes: 9, time: 7200s, interval: 75s}
        idleTimeout: 1h
      http:
        http1MaxPendingRequests: 64
        http2MaxRequests: 1000
        maxRequestsPerConnection: 10
        maxRetries: 3
        idleTimeout: 90s
        h2UpgradePolicy: UPGRADE
        maxConcurrentStreams: 128
    outlierDetection:
      consecutive5xxErrors: 5
      consecutiveGatewayErrors: 3
      interval: 10s
      baseEjectionTime: 3m
      maxEjectionPercent: 50
      minHealthPercent: 20
    tls:
      mode: ISTIO_MUTUAL
    portLevelSettings:
    - port: {number: 8080}
      loadBalancer:
        consistentHash:
          httpCookie: {name: session, path: /, ttl: 0.5s}
          ringHash: {minimumRingSize: 1024}
  subsets:
  - name: v1
    labels: {version: v1}
  - name: v2
    labels: {version: v2}
    trafficPolicy:
      loadBalancer:
        consistentHash: {httpHeaderName: x-user-id}
";

#[test]
fn canary_destination_rule() {
    let Object::DestinationRule(dr) = decode_all_forms(CANARY_DESTINATION_RULE) else {
        panic!("not a DestinationRule")
    };
    let expected = DestinationRule {
        metadata: meta("ai-inference", "llm"),
        spec: DestinationRuleSpec {
            host: "llm.ai-inference.svc.cluster.local".into(),
            export_to: vec![".".into()],
            workload_selector: Some(LabelSelector {
                match_labels: labels(&[("app", "orchestrator")]),
            }),
            traffic_policy: Some(TrafficPolicy {
                load_balancer: Some(LoadBalancerSettings {
                    simple: Some(SimpleLb::LeastRequest),
                    warmup_duration_secs: Some(MS(60_000)),
                    ..LoadBalancerSettings::default()
                }),
                connection_pool: Some(ConnectionPoolSettings {
                    tcp: Some(TcpSettings {
                        max_connections: Some(100),
                        connect_timeout: Some(MS(30)),
                        tcp_keepalive: Some(TcpKeepalive {
                            probes: Some(9),
                            time: Some(MS(7_200_000)),
                            interval: Some(MS(75_000)),
                        }),
                        max_connection_duration: None,
                        idle_timeout: Some(MS(3_600_000)),
                    }),
                    http: Some(HttpSettings {
                        http1_max_pending_requests: Some(64),
                        http2_max_requests: Some(1000),
                        max_requests_per_connection: Some(10),
                        max_retries: Some(3),
                        idle_timeout: Some(MS(90_000)),
                        h2_upgrade_policy: Some(H2UpgradePolicy::Upgrade),
                        use_client_protocol: None,
                        max_concurrent_streams: Some(128),
                    }),
                }),
                outlier_detection: Some(OutlierDetection {
                    consecutive_5xx_errors: Some(5),
                    consecutive_gateway_errors: Some(3),
                    interval: Some(MS(10_000)),
                    base_ejection_time: Some(MS(180_000)),
                    max_ejection_percent: Some(50),
                    min_health_percent: Some(20),
                    ..OutlierDetection::default()
                }),
                tls: Some(ClientTlsSettings {
                    mode: ClientTlsMode::IstioMutual,
                    ..ClientTlsSettings::default()
                }),
                port_level_settings: vec![PortTrafficPolicy {
                    port: Some(PortSelector { number: 8080 }),
                    load_balancer: Some(LoadBalancerSettings {
                        consistent_hash: Some(ConsistentHashLb {
                            hash_key: HashKey::HttpCookie(HttpCookie {
                                name: "session".into(),
                                path: "/".into(),
                                ttl: Some(MS(500)),
                            }),
                            minimum_ring_size: None,
                            ring_hash: Some(RingHash {
                                minimum_ring_size: Some(1024),
                            }),
                            maglev: None,
                        }),
                        ..LoadBalancerSettings::default()
                    }),
                    ..PortTrafficPolicy::default()
                }],
            }),
            subsets: vec![
                Subset {
                    name: "v1".into(),
                    labels: labels(&[("version", "v1")]),
                    traffic_policy: None,
                },
                Subset {
                    name: "v2".into(),
                    labels: labels(&[("version", "v2")]),
                    traffic_policy: Some(TrafficPolicy {
                        load_balancer: Some(LoadBalancerSettings {
                            consistent_hash: Some(ConsistentHashLb {
                                hash_key: HashKey::HttpHeaderName("x-user-id".into()),
                                minimum_ring_size: None,
                                ring_hash: None,
                                maglev: None,
                            }),
                            ..LoadBalancerSettings::default()
                        }),
                        ..TrafficPolicy::default()
                    }),
                },
            ],
        },
    };
    assert_eq!(*dr, expected);
    // Helpers for the control plane and `ambitctl analyze`.
    assert_eq!(dr.subset_names().collect::<Vec<_>>(), ["v1", "v2"]);
    let v2 = dr.subset("v2").unwrap();
    assert!(v2.selects(&labels(&[("app", "llm"), ("version", "v2")])));
    assert!(!v2.selects(&labels(&[("version", "v1")])));
    assert!(dr.subset("v3").is_none());
    let policy = dr.spec.traffic_policy.as_ref().unwrap();
    assert!(policy.port_settings(8080).is_some());
    assert!(policy.port_settings(80).is_none());
}

pub(super) const CANARY_VIRTUAL_SERVICE: &str = "\
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata:
  name: llm
  namespace: ai-inference
spec:
  hosts: [llm]
  http:
  - name: premium
    match:
    - headers:
        x-user-tier: {exact: premium}
    route:
    - destination: {host: llm, subset: v2}
  - name: canary
    match:
    - uri: {prefix: /v1/completions}
      method: {regex: \"^(GET|POST)$\"}
      ignoreUriCase: true
      withoutHeaders:
        x-debug: {}
      queryParams:
        stream: {exact: \"true\"}
      port: 8080
      sourceLabels: {app: orchestrator}
    route:
    - destination: {host: llm, subset: v1, port: {number: 8080}}
      weight: 80
    - destination: {host: llm, subset: v2, port: {number: 8080}}
      weight: 20
      headers:
        response:
          set: {x-canary: \"true\"}
          remove: [x-internal]
    timeout: 10s
    retries: {attempts: 3, perTryTimeout: 2s, retryOn: \"5xx,reset\"}
    fault:
      delay: {percentage: {value: 0.5}, fixedDelay: 100ms}
      abort: {percentage: {value: 0.1}, httpStatus: 503}
    mirror: {host: llm-shadow}
    mirrorPercentage: {value: 5}
    headers:
      request:
        add: {x-route: canary}
  tcp:
  - match: [{port: 9000, destinationSubnets: [10.0.0.0/8]}]
    route:
    - destination: {host: llm-raw, port: {number: 9000}}
";

#[test]
fn canary_virtual_service() {
    let Object::VirtualService(vs) = decode_all_forms(CANARY_VIRTUAL_SERVICE) else {
        panic!("not a VirtualService")
    };
    let premium = HttpRoute {
        name: "premium".into(),
        matches: vec![HttpMatchRequest {
            headers: BTreeMap::from([(
                "x-user-tier".to_string(),
                StringMatch::Exact("premium".into()),
            )]),
            ..HttpMatchRequest::default()
        }],
        route: vec![HttpRouteDestination {
            destination: dest("llm", "v2", None),
            weight: 0,
            headers: None,
        }],
        ..HttpRoute::default()
    };
    let canary = HttpRoute {
        name: "canary".into(),
        matches: vec![HttpMatchRequest {
            uri: Some(StringMatch::Prefix("/v1/completions".into())),
            method: Some(StringMatch::Regex("^(GET|POST)$".into())),
            ignore_uri_case: true,
            without_headers: BTreeMap::from([("x-debug".to_string(), StringMatch::Any)]),
            query_params: BTreeMap::from([(
                "stream".to_string(),
                StringMatch::Exact("true".into()),
            )]),
            port: Some(8080),
            source_labels: labels(&[("app", "orchestrator")]),
            ..HttpMatchRequest::default()
        }],
        route: vec![
            HttpRouteDestination {
                destination: dest("llm", "v1", Some(8080)),
                weight: 80,
                headers: None,
            },
            HttpRouteDestination {
                destination: dest("llm", "v2", Some(8080)),
                weight: 20,
                headers: Some(Headers {
                    request: None,
                    response: Some(HeaderOperations {
                        set: BTreeMap::from([("x-canary".to_string(), "true".to_string())]),
                        add: BTreeMap::new(),
                        remove: vec!["x-internal".into()],
                    }),
                }),
            },
        ],
        timeout: Some(MS(10_000)),
        retries: Some(HttpRetry {
            attempts: 3,
            per_try_timeout: Some(MS(2_000)),
            retry_on: "5xx,reset".into(),
            retry_remote_localities: None,
        }),
        fault: Some(HttpFaultInjection {
            delay: Some(FaultDelay {
                fixed_delay: MS(100),
                percentage: Some(Percent { value: 0.5 }),
                percent: None,
            }),
            abort: Some(FaultAbort {
                http_status: Some(503),
                percentage: Some(Percent { value: 0.1 }),
                ..FaultAbort::default()
            }),
        }),
        mirror: Some(dest("llm-shadow", "", None)),
        mirror_percentage: Some(Percent { value: 5.0 }),
        headers: Some(Headers {
            request: Some(HeaderOperations {
                add: BTreeMap::from([("x-route".to_string(), "canary".to_string())]),
                ..HeaderOperations::default()
            }),
            response: None,
        }),
        ..HttpRoute::default()
    };
    let expected = VirtualService {
        metadata: meta("ai-inference", "llm"),
        spec: VirtualServiceSpec {
            hosts: vec!["llm".into()],
            http: vec![premium, canary],
            tcp: vec![TcpRoute {
                matches: vec![L4MatchAttributes {
                    port: Some(9000),
                    destination_subnets: vec!["10.0.0.0/8".parse().unwrap()],
                    ..L4MatchAttributes::default()
                }],
                route: vec![RouteDestination {
                    destination: dest("llm-raw", "", Some(9000)),
                    weight: 0,
                }],
            }],
            ..VirtualServiceSpec::default()
        },
    };
    assert_eq!(*vs, expected);
    // Helpers for the control plane and `ambitctl analyze`.
    let destinations: Vec<(&str, &str)> = vs
        .destinations()
        .map(|d| (d.host.as_str(), d.subset.as_str()))
        .collect();
    assert_eq!(
        destinations,
        [
            ("llm", "v2"),
            ("llm", "v1"),
            ("llm", "v2"),
            ("llm-shadow", ""),
            ("llm-raw", "")
        ]
    );
    assert!(vs.spec.applies_to_mesh());
    let retries = vs.spec.http[1].retries.as_ref().unwrap();
    assert_eq!(
        retries.retry_conditions().collect::<Vec<_>>(),
        ["5xx", "reset"]
    );
}

#[test]
fn virtual_service_actions_mirrors_and_rewrites() {
    let yaml = "\
apiVersion: networking.istio.io/v1beta1
kind: VirtualService
metadata: {name: edge, namespace: web}
spec:
  hosts: [web.example.com]
  gateways: [istio-system/ingress]
  exportTo: ['*']
  http:
  - match: [{uri: {exact: /old}}]
    redirect: {uri: /new, authority: example.com, port: 8443, scheme: https, redirectCode: 308}
  - match: [{uri: {prefix: /health}}]
    directResponse: {status: 200, body: {string: ok}}
  - match: [{uri: {prefix: /team}}]
    delegate: {name: team-routes, namespace: team}
  - rewrite:
      authority: api.internal
      uriRegexRewrite: {match: '^/api/v1/(.*)', rewrite: '/\\1'}
    route: [{destination: {host: api}}]
    mirrors:
    - destination: {host: api-shadow, subset: next}
      percentage: {value: 12.5}
    fault:
      delay: {fixedDelay: 1.5s, percent: 10}
    corsPolicy:
      allowOrigins: [{exact: 'https://example.com'}]
      allowMethods: [GET]
      maxAge: 24h
  tls:
  - match: [{sniHosts: [web.example.com], port: 443}]
    route: [{destination: {host: web}}]
";
    let Object::VirtualService(vs) = decode_all_forms(yaml) else {
        panic!("not a VirtualService")
    };
    let http = &vs.spec.http;
    assert!(!vs.spec.applies_to_mesh());
    assert_eq!(
        http[0].redirect,
        Some(HttpRedirect {
            uri: "/new".into(),
            authority: "example.com".into(),
            port: Some(8443),
            scheme: "https".into(),
            redirect_code: Some(308),
        })
    );
    assert_eq!(
        http[1].direct_response,
        Some(HttpDirectResponse {
            status: 200,
            body: Some(HttpBody {
                string: Some("ok".into()),
                bytes: None
            }),
        })
    );
    assert_eq!(
        http[2].delegate,
        Some(Delegate {
            name: "team-routes".into(),
            namespace: "team".into()
        })
    );
    let rewrite = http[3].rewrite.as_ref().unwrap();
    assert_eq!(rewrite.authority, "api.internal");
    assert_eq!(
        rewrite.uri_regex_rewrite,
        Some(RegexRewrite {
            pattern: "^/api/v1/(.*)".into(),
            rewrite: "/\\1".into()
        })
    );
    assert_eq!(http[3].mirrors[0].percentage, Some(Percent { value: 12.5 }));
    let delay = http[3].fault.as_ref().unwrap().delay.as_ref().unwrap();
    assert_eq!((delay.fixed_delay, delay.percent), (MS(1_500), Some(10)));
    let cors = http[3].cors_policy.as_ref().unwrap();
    assert_eq!(cors.max_age, Some(MS(86_400_000)));
    assert_eq!(vs.spec.tls[0].matches[0].sni_hosts, ["web.example.com"]);
    let hosts: Vec<&str> = vs.destinations().map(|d| d.host.as_str()).collect();
    assert_eq!(hosts, ["api", "api-shadow", "web"]);
}

#[test]
fn sidecar() {
    let yaml = "\
apiVersion: networking.istio.io/v1
kind: Sidecar
metadata: {name: default, namespace: legacy}
spec:
  workloadSelector:
    labels: {app: legacy-web}
  ingress:
  - port: {number: 9080, protocol: HTTP, name: http}
    defaultEndpoint: 127.0.0.1:8080
  egress:
  - port: {number: 3306, protocol: MYSQL, name: db}
    bind: 127.0.0.1
    hosts: [./mysql.legacy.svc.cluster.local]
  - captureMode: IPTABLES
    hosts: [./*, istio-system/*, '*/api.example.com', ~/*]
  outboundTrafficPolicy: {mode: REGISTRY_ONLY}
";
    let Object::Sidecar(sc) = decode_all_forms(yaml) else {
        panic!("not a Sidecar")
    };
    let host = |ns: &str, h: &str| NamespacedHost {
        namespace: ns.into(),
        host: h.into(),
    };
    let expected = Sidecar {
        metadata: meta("legacy", "default"),
        spec: SidecarSpec {
            workload_selector: Some(WorkloadSelector {
                labels: labels(&[("app", "legacy-web")]),
            }),
            ingress: vec![IstioIngressListener {
                port: SidecarPort {
                    number: 9080,
                    protocol: "HTTP".into(),
                    name: "http".into(),
                    target_port: None,
                },
                bind: String::new(),
                capture_mode: CaptureMode::Default,
                default_endpoint: "127.0.0.1:8080".into(),
            }],
            egress: vec![
                IstioEgressListener {
                    port: Some(SidecarPort {
                        number: 3306,
                        protocol: "MYSQL".into(),
                        name: "db".into(),
                        target_port: None,
                    }),
                    bind: "127.0.0.1".into(),
                    capture_mode: CaptureMode::Default,
                    hosts: vec![host(".", "mysql.legacy.svc.cluster.local")],
                },
                IstioEgressListener {
                    port: None,
                    bind: String::new(),
                    capture_mode: CaptureMode::Iptables,
                    hosts: vec![
                        host(".", "*"),
                        host("istio-system", "*"),
                        host("*", "api.example.com"),
                        host("~", "*"),
                    ],
                },
            ],
            outbound_traffic_policy: Some(OutboundTrafficPolicy {
                mode: OutboundTrafficMode::RegistryOnly,
            }),
        },
    };
    assert_eq!(*sc, expected);
    assert_eq!(sc.spec.egress[1].hosts[2].to_string(), "*/api.example.com");
}
