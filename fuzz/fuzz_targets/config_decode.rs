//! Config decoding: one input through every decoder of `ambit-config` —
//! a YAML document (`decode_yaml_document`), API-server JSON
//! (`decode_json`, and `decode_json_value` when it is JSON at all), and a
//! whole file (`parse_documents`: the `---` splitter, then each document).
//!
//! Checks: no panic; the splitter's documents are in order and say which
//! file lines they come from; a rejected document always has a reason.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;

/// Objects as the API server sends them (JSON), for the JSON decoders.
const JSON_SEEDS: &[(&str, &str)] = &[
    (
        "json-namespace",
        r#"{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"demo","labels":{"istio.io/dataplane-mode":"ambient"}}}"#,
    ),
    (
        "json-pod",
        r#"{"apiVersion":"v1","kind":"Pod","metadata":{"name":"web-1","namespace":"demo","uid":"u-1","labels":{"app":"web"}},"spec":{"nodeName":"node-1","serviceAccountName":"web","containers":[{"name":"web","ports":[{"containerPort":8080,"name":"http"}]}]},"status":{"podIP":"10.244.1.5","podIPs":[{"ip":"10.244.1.5"},{"ip":"fd00::5"}],"phase":"Running"}}"#,
    ),
    (
        "json-service",
        r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web","namespace":"demo"},"spec":{"clusterIP":"10.96.0.10","clusterIPs":["10.96.0.10"],"selector":{"app":"web"},"ports":[{"name":"http","port":80,"targetPort":8080,"appProtocol":"http"}]}}"#,
    ),
    (
        "json-authorizationpolicy",
        r#"{"apiVersion":"security.istio.io/v1","kind":"AuthorizationPolicy","metadata":{"name":"allow-web","namespace":"demo"},"spec":{"selector":{"matchLabels":{"app":"web"}},"action":"ALLOW","rules":[{"from":[{"source":{"principals":["cluster.local/ns/demo/sa/client"],"ipBlocks":["10.0.0.0/8"]}}],"to":[{"operation":{"ports":["8080"],"methods":["GET"]}}]}]}}"#,
    ),
    (
        "json-peerauthentication",
        r#"{"apiVersion":"security.istio.io/v1","kind":"PeerAuthentication","metadata":{"name":"default","namespace":"istio-system"},"spec":{"mtls":{"mode":"STRICT"},"portLevelMtls":{"8080":{"mode":"PERMISSIVE"}}}}"#,
    ),
    (
        "json-virtualservice",
        r#"{"apiVersion":"networking.istio.io/v1","kind":"VirtualService","metadata":{"name":"web","namespace":"demo"},"spec":{"hosts":["web"],"http":[{"match":[{"uri":{"regex":"^/v[0-9]+/.*"},"headers":{"x-user":{"exact":"premium"}}}],"route":[{"destination":{"host":"web","subset":"v2"},"weight":80},{"destination":{"host":"web","subset":"v1"},"weight":20}],"timeout":"1.5s","retries":{"attempts":3,"perTryTimeout":"500ms"}}]}}"#,
    ),
    (
        "json-httproute",
        r#"{"apiVersion":"gateway.networking.k8s.io/v1","kind":"HTTPRoute","metadata":{"name":"web","namespace":"demo"},"spec":{"parentRefs":[{"group":"","kind":"Service","name":"web","port":80}],"rules":[{"matches":[{"path":{"type":"PathPrefix","value":"/api"}}],"backendRefs":[{"name":"web-v2","port":80,"weight":90},{"name":"web-v1","port":80,"weight":10}],"timeouts":{"request":"2s"}}]}}"#,
    ),
];

fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = ambit_fuzz::CONFIG_FILES
        .iter()
        .map(|(name, text)| (format!("{name}.yaml"), text.as_bytes().to_vec()))
        .collect();
    // Each document of each file alone, too (small seeds mutate fastest).
    for (name, text) in ambit_fuzz::CONFIG_FILES {
        for doc in ambit_config::dir::split_documents(text) {
            out.push((
                format!("{name}-doc{}.yaml", doc.index),
                doc.text.as_bytes().to_vec(),
            ));
        }
    }
    out.extend(
        JSON_SEEDS
            .iter()
            .map(|(n, j)| (format!("{n}.json"), j.as_bytes().to_vec())),
    );
    out
}

fuzz_target!(
    init: {
        if let Some(dir) = ambit_fuzz::seeds_requested() {
            ambit_fuzz::write_seeds(&dir, seeds());
        }
    },
    |data: &[u8]| {
        let _ = ambit_config::decode_json(data);
        if let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) {
            let _ = ambit_config::decode_json_value(&value);
        }
        let Ok(text) = std::str::from_utf8(data) else {
            return;
        };
        if let Err(f) = ambit_config::decode_yaml_document(text, 0) {
            assert!(!f.error.to_string().is_empty());
        }
        let docs = ambit_config::dir::split_documents(text);
        let lines = text.lines().count();
        let mut prev_line = 0;
        for (i, d) in docs.iter().enumerate() {
            assert_eq!(d.index, i);
            assert!(d.line > prev_line && d.line <= lines.max(1), "{d:?}");
            prev_line = d.line;
        }
        let (_objects, errors) = ambit_config::parse_documents(Path::new("fuzz.yaml"), text);
        for e in &errors {
            assert!(!e.reason.is_empty());
        }
    }
);
