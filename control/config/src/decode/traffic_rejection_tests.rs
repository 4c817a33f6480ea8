//! Unusable values of the traffic kinds (VirtualService, DestinationRule,
//! Sidecar, Gateway, HTTPRoute) are rejected with the field's path and the
//! file line, and the object keeps its key (so its last good version keeps
//! serving).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;

/// A VirtualService whose first HTTP rule is `rule` (indented 4 spaces,
/// starting at line 8 of the document).
fn vs_with_rule(rule: &str) -> String {
    format!(
        "apiVersion: networking.istio.io/v1\nkind: VirtualService\nmetadata: {{name: bad, namespace: a}}\nspec:\n  hosts: [llm]\n  http:\n  - name: r\n{rule}"
    )
}

/// A DestinationRule whose traffic policy is `policy` (indented 4 spaces,
/// starting at line 7).
fn dr_with_policy(policy: &str) -> String {
    format!(
        "apiVersion: networking.istio.io/v1\nkind: DestinationRule\nmetadata: {{name: bad, namespace: a}}\nspec:\n  host: llm\n  trafficPolicy:\n{policy}"
    )
}

/// Checks that `doc` is rejected as the object `kind/a/bad` with a message
/// naming `path`, `at line <line>` and containing `reason`; says what is
/// wrong otherwise. Its JSON form must be rejected the same way.
fn check_rejection(doc: &str, path: &str, line: usize, reason: &str) -> Result<(), String> {
    let f = match decode_yaml_document(doc, 0) {
        Ok(o) => return Err(format!("{path}: accepted as {o:?}")),
        Err(f) => f,
    };
    let msg = f.error.to_string();
    let checks = [
        (
            f.namespace == "a" && f.name == "bad",
            "the object's name".to_string(),
        ),
        (
            f.key.is_some(),
            "a key (the object keeps its last good version)".to_string(),
        ),
        (
            msg.contains(&format!("{path}: ")),
            format!("the path {path:?}"),
        ),
        (
            msg.contains(&format!("at line {line} ")),
            format!("line {line}"),
        ),
        (msg.contains(reason), format!("{reason:?}")),
    ];
    if let Some((_, what)) = checks.into_iter().find(|(ok, _)| !ok) {
        return Err(format!("{msg:?} lacks {what}"));
    }
    // The same document as the API server's JSON: the same path and
    // reason, with the JSON text's line.
    let value: serde_json::Value = serde_saphyr::from_str(doc).map_err(|e| e.to_string())?;
    let json = serde_json::to_vec_pretty(&value).map_err(|e| e.to_string())?;
    let msg = match decode_json(&json) {
        Ok(o) => return Err(format!("{path}: JSON accepted as {o:?}")),
        Err(f) => f.error.to_string(),
    };
    if msg.contains(&format!("{path}: ")) && msg.contains(reason) && msg.contains(" line ") {
        Ok(())
    } else {
        Err(format!(
            "JSON: {msg:?} lacks the path, the reason or a line"
        ))
    }
}

/// Runs [`check_rejection`] on every case and reports all failures.
fn all_rejected(cases: &[(String, &str, usize, &str)]) {
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|(doc, path, line, reason)| check_rejection(doc, path, *line, reason).err())
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn unusable_istio_values_are_rejected_with_path_and_line() {
    let route = "    route: [{destination: {host: llm}}]\n";
    let cases: Vec<(String, &str, usize, &str)> = vec![
        (
            vs_with_rule(
                "    route:\n    - destination: {host: llm, subset: v1}\n      weight: 80\n    - destination: {host: llm, subset: v2}\n      weight: 30\n",
            ),
            "spec.http[0]",
            7,
            "weights sum to 110, not 100",
        ),
        (
            vs_with_rule(&format!("{route}    timeout: 10 seconds\n")),
            "spec.http[0].timeout",
            9,
            "\"10 seconds\" is not a duration",
        ),
        (
            vs_with_rule(&format!("{route}    timeout: 5\n")),
            "spec.http[0].timeout",
            9,
            "a unit is missing",
        ),
        (
            vs_with_rule(&format!("{route}    retries: {{attempts: 2, perTryTimeout: -1s}}\n")),
            "spec.http[0].retries.perTryTimeout",
            9,
            "is negative",
        ),
        (
            vs_with_rule("    route:\n    - destination: {host: llm}\n      weight: -5\n"),
            "spec.http[0].route[0].weight",
            10,
            "weight -5 is negative; use 0 or more",
        ),
        (
            vs_with_rule(&format!(
                "{route}    fault:\n      delay:\n        fixedDelay: 1s\n        percentage: {{value: 150}}\n"
            )),
            "spec.http[0].fault.delay.percentage.value",
            12,
            "percentage 150 is out of range; use a value from 0 to 100",
        ),
        (
            vs_with_rule(&format!("{route}    mirrorPercentage: {{value: 100.5}}\n")),
            "spec.http[0].mirrorPercentage.value",
            9,
            "percentage 100.5 is out of range",
        ),
        (
            vs_with_rule(&format!(
                "{route}    fault:\n      abort: {{httpStatus: 503, grpcStatus: UNAVAILABLE}}\n"
            )),
            "spec.http[0].fault.abort",
            10,
            "set exactly one of httpStatus, grpcStatus, http2Error",
        ),
        (
            vs_with_rule(&format!("{route}    fault:\n      abort: {{httpStatus: 700}}\n")),
            "spec.http[0].fault.abort.httpStatus",
            10,
            "HTTP status 700 is out of range",
        ),
        (
            vs_with_rule(&format!(
                "    match:\n    - uri: {{exact: /a, prefix: /b}}\n{route}"
            )),
            "spec.http[0].match[0].uri",
            9,
            "exact and prefix are both set; a string match takes exactly one of exact, prefix, regex",
        ),
        (
            vs_with_rule(&format!(
                "    match:\n    - headers:\n        x-a: {{prefix: b, regex: c}}\n{route}"
            )),
            "spec.http[0].match[0].headers.x-a",
            10,
            "prefix and regex are both set",
        ),
        (
            vs_with_rule(&format!("    match:\n    - uri: {{regex: '/api/(v1'}}\n{route}")),
            "spec.http[0].match[0].uri",
            9,
            "\"/api/(v1\" is not a valid regular expression",
        ),
        (
            vs_with_rule(&format!(
                "{route}    rewrite:\n      uriRegexRewrite: {{match: '[a-', rewrite: x}}\n"
            )),
            "spec.http[0].rewrite.uriRegexRewrite.match",
            10,
            "is not a valid regular expression",
        ),
        (
            vs_with_rule(&format!("{route}    redirect: {{uri: /x}}\n")),
            "spec.http[0]",
            7,
            "route and redirect are both set",
        ),
        (
            vs_with_rule("    timeout: 1s\n"),
            "spec.http[0]",
            7,
            "the HTTP route has no action",
        ),
        (
            vs_with_rule("    route:\n    - destination: {subset: v1}\n"),
            "spec.http[0].route[0].destination",
            9,
            "missing field `host`",
        ),
        (
            dr_with_policy("    outlierDetection:\n      interval: 1 minute\n"),
            "spec.trafficPolicy.outlierDetection.interval",
            8,
            "is not a duration",
        ),
        (
            dr_with_policy("    outlierDetection:\n      maxEjectionPercent: 150\n"),
            "spec.trafficPolicy.outlierDetection.maxEjectionPercent",
            8,
            "percentage 150 is out of range",
        ),
        (
            dr_with_policy("    connectionPool:\n      tcp: {maxConnections: -1}\n"),
            "spec.trafficPolicy.connectionPool.tcp.maxConnections",
            8,
            "is negative",
        ),
        (
            dr_with_policy(
                "    loadBalancer:\n      consistentHash: {httpHeaderName: x, useSourceIp: true}\n",
            ),
            "spec.trafficPolicy.loadBalancer.consistentHash",
            8,
            "httpHeaderName and useSourceIp are both set",
        ),
        (
            dr_with_policy(
                "    loadBalancer:\n      simple: RANDOM\n      consistentHash: {useSourceIp: true}\n",
            ),
            "spec.trafficPolicy.loadBalancer",
            8,
            "simple and consistentHash are both set",
        ),
        (
            dr_with_policy("    loadBalancer: {simple: FASTEST}\n"),
            "spec.trafficPolicy.loadBalancer.simple",
            7,
            "unknown variant `FASTEST`",
        ),
        (
            dr_with_policy("    tls: {mode: STRICT}\n"),
            "spec.trafficPolicy.tls.mode",
            7,
            "unknown variant `STRICT`",
        ),
        (
            "apiVersion: networking.istio.io/v1\nkind: Sidecar\nmetadata: {name: bad, namespace: a}\nspec:\n  egress:\n  - hosts: [mysql.legacy]\n".to_string(),
            "spec.egress[0].hosts[0]",
            6,
            "host \"mysql.legacy\" is not of the form namespace/host",
        ),
    ];
    all_rejected(&cases);
}

#[test]
fn json_errors_carry_the_path_and_line_too() {
    let json = br#"{"apiVersion": "networking.istio.io/v1", "kind": "VirtualService",
        "metadata": {"name": "bad", "namespace": "a"},
        "spec": {"http": [{"route": [{"destination": {"host": "llm"},
            "weight": -5}]}]}}"#;
    let f = decode_json(json).unwrap_err();
    assert_eq!(
        f.key,
        Some(ObjectKey::new(Kind::VirtualService, "a", "bad"))
    );
    let msg = f.error.to_string();
    assert!(
        msg.contains("spec.http[0].route[0].weight: weight -5 is negative"),
        "{msg}"
    );
    assert!(msg.contains("line 4"), "{msg}");
}

/// An HTTPRoute whose first rule is `rule` (indented 4 spaces, starting at
/// line 6 of the document).
fn route_with_rule(rule: &str) -> String {
    format!(
        "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {{name: bad, namespace: a}}\nspec:\n  rules:\n  - backendRefs: [{{name: llm}}]\n{rule}"
    )
}

#[test]
fn unusable_gateway_api_values_are_rejected_with_path_and_line() {
    let cases: Vec<(String, &str, usize, &str)> = vec![
        (
            route_with_rule("    matches: [{path: {type: Prefix, value: /api}}]\n"),
            "spec.rules[0].matches[0].path.type",
            7,
            "unknown variant `Prefix`, expected one of",
        ),
        (
            route_with_rule("    matches: [{path: {type: PathPrefix, value: api}}]\n"),
            "spec.rules[0].matches[0].path",
            7,
            "path \"api\" does not start with '/'",
        ),
        (
            route_with_rule("    matches: [{path: {type: RegularExpression, value: '(a'}}]\n"),
            "spec.rules[0].matches[0].path",
            7,
            "\"(a\" is not a valid regular expression",
        ),
        (
            route_with_rule(
                "    matches: [{headers: [{type: RegularExpression, name: x, value: '*a'}]}]\n",
            ),
            "spec.rules[0].matches[0].headers[0]",
            7,
            "is not a valid regular expression",
        ),
        (
            route_with_rule("    matches: [{method: FETCH}]\n"),
            "spec.rules[0].matches[0].method",
            7,
            "unknown variant `FETCH`",
        ),
        (
            route_with_rule("    timeouts: {request: 1.5s}\n"),
            "spec.rules[0].timeouts.request",
            7,
            "\"1.5s\" is not a Gateway API duration",
        ),
        (
            route_with_rule("    timeouts: {request: 1s, backendRequest: 2s}\n"),
            "spec.rules[0].timeouts",
            7,
            "is longer than request",
        ),
        (
            route_with_rule("    filters: [{type: RequestRedirect}]\n"),
            "spec.rules[0].filters[0]",
            7,
            "a RequestRedirect filter needs its requestRedirect field",
        ),
        (
            route_with_rule(
                "    filters:\n    - type: URLRewrite\n      requestRedirect: {scheme: https}\n",
            ),
            "spec.rules[0].filters[0]",
            8,
            "a URLRewrite filter must not set requestRedirect",
        ),
        (
            route_with_rule("    filters: [{type: Rewrite}]\n"),
            "spec.rules[0].filters[0].type",
            7,
            "unknown variant `Rewrite`",
        ),
        (
            "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: bad, namespace: a}\nspec:\n  rules:\n  - backendRefs:\n    - {name: llm, weight: -1}\n".to_string(),
            "spec.rules[0].backendRefs[0].weight",
            7,
            "weight -1 is negative",
        ),
        (
            "apiVersion: gateway.networking.k8s.io/v1\nkind: HTTPRoute\nmetadata: {name: bad, namespace: a}\nspec:\n  rules:\n  - backendRefs:\n    - {name: llm, weight: 2000000}\n".to_string(),
            "spec.rules[0].backendRefs[0].weight",
            7,
            "use at most 1000000",
        ),
        (
            "apiVersion: gateway.networking.k8s.io/v1\nkind: Gateway\nmetadata: {name: bad, namespace: a}\nspec:\n  gatewayClassName: istio-waypoint\n  listeners:\n  - {name: mesh, port: 0, protocol: HBONE}\n".to_string(),
            "spec.listeners[0].port",
            7,
            "port 0 is out of range",
        ),
    ];
    all_rejected(&cases);
}
