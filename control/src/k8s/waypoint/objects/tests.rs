use ambit_config::{Object, decode_json_value};
use serde_json::json;

use super::*;

fn gateway(annotations: Value, listeners: Value) -> Gateway {
    let doc = json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "waypoint", "namespace": "ai", "uid": "uid-1",
                     "annotations": annotations},
        "spec": {"gatewayClassName": "istio-waypoint", "listeners": listeners,
                 "infrastructure": {"labels": {"team": "ml"}, "annotations": {"owner": "ml-team"}}},
    });
    match decode_json_value(&doc) {
        Ok(Some(Object::Gateway(g))) => *g,
        other => panic!("{other:?}"),
    }
}

fn hbone() -> Value {
    json!([{"name": "mesh", "port": 15008, "protocol": "HBONE"},
           {"name": "http", "port": 80, "protocol": "HTTP"}])
}

#[test]
fn a_waypoint_runs_as_istio_runs_it() {
    let gw = gateway(json!({}), hbone());
    let settings = InjectSettings::default();
    let objs = waypoint_objects(
        &GatewayRef {
            api_version: "gateway.networking.k8s.io/v1",
            gateway: &gw,
        },
        &settings,
    );
    for doc in [&objs.service_account, &objs.deployment, &objs.service] {
        assert_eq!(doc["metadata"]["name"], "waypoint");
        assert_eq!(doc["metadata"]["namespace"], "ai");
        let owner = &doc["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "Gateway");
        assert_eq!(owner["uid"], "uid-1");
        assert_eq!(owner["controller"], true);
        assert_eq!(doc["metadata"]["labels"][LABEL_GATEWAY_NAME], "waypoint");
        assert_eq!(doc["metadata"]["labels"][LABEL_MANAGED], MANAGED_VALUE);
        assert_eq!(
            doc["metadata"]["labels"]["team"], "ml",
            "infrastructure labels"
        );
        assert_eq!(doc["metadata"]["annotations"]["owner"], "ml-team");
        assert!(spec_hash(doc).is_some());
    }
    let d = &objs.deployment;
    assert!(
        d["spec"].get("replicas").is_none(),
        "left to the default or an HPA"
    );
    let pod = &d["spec"]["template"];
    assert_eq!(pod["metadata"]["labels"]["istio.io/dataplane-mode"], "none");
    assert_eq!(pod["spec"]["serviceAccountName"], "waypoint");
    let c = &pod["spec"]["containers"][0];
    assert_eq!(c["name"], "istio-proxy");
    assert_eq!(c["args"], json!(["--kind", "waypoint"]));
    assert_eq!(c["image"], settings.proxy_image);
    assert_eq!(c["readinessProbe"]["httpGet"]["port"], 15021);
    let none = Vec::new();
    let env: Vec<&str> = c["env"]
        .as_array()
        .unwrap_or(&none)
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(
        env.contains(&"XDS_ADDRESS") && env.contains(&"TOKEN_FILE"),
        "{env:?}"
    );
    let ports: Vec<(String, i64)> = objs.service["spec"]["ports"]
        .as_array()
        .unwrap_or(&Vec::new())
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap_or("").to_string(),
                p["port"].as_i64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(
        ports,
        [
            ("mesh".to_string(), 15008),
            ("status-port".to_string(), 15021),
            ("http-monitoring".to_string(), 15020),
            ("http".to_string(), 80)
        ]
    );
    assert_eq!(objs.service["spec"]["type"], "ClusterIP");
}

#[test]
fn the_hash_follows_what_is_applied_and_replicas_follow_the_annotation() {
    let settings = InjectSettings::default();
    let objects = |gw: &Gateway| {
        waypoint_objects(
            &GatewayRef {
                api_version: "gateway.networking.k8s.io/v1",
                gateway: gw,
            },
            &settings,
        )
    };
    let a = objects(&gateway(json!({}), hbone()));
    let b = objects(&gateway(json!({}), hbone()));
    assert_eq!(spec_hash(&a.deployment), spec_hash(&b.deployment), "stable");
    let three = objects(&gateway(json!({REPLICAS_ANNOTATION: "3"}), hbone()));
    assert_eq!(three.deployment["spec"]["replicas"], 3);
    assert_ne!(spec_hash(&a.deployment), spec_hash(&three.deployment));
    let other = InjectSettings {
        proxy_image: "example.test/proxy:2".into(),
        ..InjectSettings::default()
    };
    let c = waypoint_objects(
        &GatewayRef {
            api_version: "gateway.networking.k8s.io/v1",
            gateway: &gateway(json!({}), hbone()),
        },
        &other,
    );
    assert_ne!(
        spec_hash(&a.deployment),
        spec_hash(&c.deployment),
        "a new image rolls"
    );
    assert_eq!(spec_hash(&a.service), spec_hash(&c.service));
}

#[test]
fn a_waypoint_without_an_hbone_listener_is_refused() {
    let http_only = gateway(
        json!({}),
        json!([{"name": "http", "port": 80, "protocol": "HTTP"}]),
    );
    let why = refusal(&http_only).unwrap_or_default();
    assert!(why.contains("15008") && why.contains("HBONE"), "{why}");
    assert!(refusal(&gateway(json!({}), hbone())).is_none());
}
