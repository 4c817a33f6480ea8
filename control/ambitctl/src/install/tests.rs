use super::*;

fn images(docs: &[Value]) -> Vec<String> {
    docs.iter()
        .filter_map(|d| d.pointer("/spec/template/spec/containers"))
        .filter_map(Value::as_array)
        .flatten()
        .filter_map(|c| c["image"].as_str().map(str::to_string))
        .collect()
}

fn proxy_image(docs: &[Value]) -> Option<String> {
    docs.iter()
        .filter_map(|d| d.pointer("/spec/template/spec/containers/0/env"))
        .filter_map(Value::as_array)
        .flatten()
        .find(|e| e["name"] == "PROXY_IMAGE")
        .and_then(|e| e["value"].as_str().map(str::to_string))
}

#[test]
fn set_values_change_images_tags_and_replicas() {
    let v = Values::parse(&[
        "image=registry.local:5000/me/".into(),
        "tag=dev".into(),
        "replicas=3".into(),
    ])
    .unwrap_or_default();
    assert_eq!(v.replicas, Some(3));
    let docs = render(&v).unwrap_or_default();
    assert_eq!(
        images(&docs),
        [
            "registry.local:5000/me/ambit-control:dev",
            "registry.local:5000/me/ztunnel:dev",
            "registry.local:5000/me/ambit-node-agent:dev"
        ]
    );
    assert_eq!(
        proxy_image(&docs).as_deref(),
        Some("registry.local:5000/me/proxy:dev"),
        "the injected proxy follows --set image/tag"
    );
    let d = docs.iter().find(|d| d["kind"] == "Deployment");
    assert_eq!(d.map(|d| d["spec"]["replicas"].clone()), Some(json!(3)));
    assert!(Values::parse(&["replicas=0".into()]).is_err());
    assert!(Values::parse(&["colour=blue".into()]).is_err());
    assert!(to_yaml(&docs).is_ok_and(|y| y.matches("\n---\n").count() + 1 == docs.len()));
}

#[test]
fn only_the_workloads_change_every_other_document_renders_as_written() {
    let plain = render(&Values::default()).unwrap_or_default();
    let set = render(&Values {
        image: Some("example.test/x".into()),
        tag: Some("t".into()),
        replicas: Some(5),
        cni_conf_dir: Some("/var/lib/cni/conf".into()),
        cni_bin_dir: Some("/var/lib/cni/bin".into()),
    })
    .unwrap_or_default();
    assert_eq!(plain.len(), set.len());
    assert!(plain.len() > 20, "{}", plain.len());
    for (a, b) in plain.iter().zip(&set) {
        let kind = a["kind"].as_str().unwrap_or_default();
        if matches!(kind, "Deployment" | "DaemonSet") {
            continue;
        }
        assert_eq!(a, b, "{kind} {} is unchanged", a["metadata"]["name"]);
        assert!(
            a.get("spec").is_none_or(|s| s.get("template").is_none()),
            "{kind} {} gained no pod template",
            a["metadata"]["name"]
        );
    }
    // The default renders what the files say, tags included.
    assert!(
        images(&plain)
            .iter()
            .all(|i| i.starts_with("ghcr.io/ambit-mesh/") && i.ends_with(":0.1.0"))
    );
}

#[test]
fn retag_keeps_a_registry_port_and_a_missing_tag_becomes_the_set_one() {
    let v = Values {
        tag: Some("dev".into()),
        ..Values::default()
    };
    assert_eq!(
        v.retag("reg.local:5000/ztunnel"),
        "reg.local:5000/ztunnel:dev"
    );
    assert_eq!(
        v.retag("reg.local:5000/ztunnel:1"),
        "reg.local:5000/ztunnel:dev"
    );
    assert_eq!(
        Values::default().retag("reg.local:5000/ztunnel"),
        "reg.local:5000/ztunnel:latest"
    );
}

#[test]
fn dry_run_yaml_reads_back_as_the_same_documents() {
    let docs = render(&Values::default()).unwrap_or_default();
    let yaml = to_yaml(&docs).unwrap_or_default();
    let back: Vec<Value> = serde_saphyr::from_multiple(&yaml).unwrap_or_default();
    let back: Vec<Value> = back.into_iter().filter(Value::is_object).collect();
    assert_eq!(back, docs, "strings such as \"true\" stay strings");
}

#[test]
fn cni_directories_move_the_node_agents_host_paths() {
    let v = Values::parse(&[
        "cniConfDir=/var/lib/rancher/k3s/agent/etc/cni/net.d/".into(),
        "cniBinDir=/home/kubernetes/bin".into(),
    ])
    .unwrap_or_default();
    let docs = render(&v).unwrap_or_default();
    let agent = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == "ambit-node-agent");
    let paths: Vec<(String, String)> = agent
        .and_then(|a| a.pointer("/spec/template/spec/volumes"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|v| {
            Some((
                v["name"].as_str()?.into(),
                v["hostPath"]["path"].as_str()?.into(),
            ))
        })
        .filter(|(n, _): &(String, String)| n.starts_with("cni-"))
        .collect();
    assert_eq!(
        paths,
        [
            ("cni-bin".to_string(), "/home/kubernetes/bin".to_string()),
            (
                "cni-conf".to_string(),
                "/var/lib/rancher/k3s/agent/etc/cni/net.d".to_string()
            ),
        ]
    );
    assert!(Values::parse(&["cniConfDir=relative/dir".into()]).is_err());
}
