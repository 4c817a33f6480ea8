//! deploy/kubernetes: every document parses as its typed k8s-openapi object
//! (and serializes back to the same JSON, so no field is misspelled or
//! misplaced); selectors match the pod template labels; Service ports match
//! container ports; RBAC grants every call the control plane and the node
//! agent make against the fake API server, and nothing they do not make.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use ambit_tests::fakeapi::{ApiCall, FakeApiServer};
use ambit_tests::kubebed::{control_plane, namespace, pod, sa_token, wait_synced, yaml_docs};
use ambit_tests::{eventually, workspace_root};
use k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Namespace, PodTemplateSpec, Service, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(10);

/// The YAML files of a directory (one level), but its kustomization.
fn yaml_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| p.file_name().is_some_and(|n| n != "kustomization.yaml"))
        .collect();
    files.sort();
    files
}

fn manifests() -> Vec<(String, Value)> {
    let dir = workspace_root().join("deploy/kubernetes");
    let mut files = yaml_files(&dir);
    files.extend(yaml_files(&dir.join("crds")));
    assert!(files.len() >= 6, "{files:?}");
    let mut out = Vec::new();
    for f in files {
        for (i, d) in yaml_docs(&f).unwrap().into_iter().enumerate() {
            out.push((format!("{}#{i}", f.display()), d));
        }
    }
    out
}

/// Parses `doc` as `T` and checks it serializes back to the same JSON.
fn typed<T: DeserializeOwned + Serialize>(at: &str, doc: &Value) -> T {
    let t: T = serde_json::from_value(doc.clone()).unwrap_or_else(|e| panic!("{at}: {e}"));
    let back = serde_json::to_value(&t).unwrap();
    assert_eq!(
        &back,
        doc,
        "{at}: a field is unknown to {}",
        std::any::type_name::<T>()
    );
    t
}

#[derive(Default)]
struct Parsed {
    deployments: Vec<Deployment>,
    daemonsets: Vec<DaemonSet>,
    services: Vec<Service>,
    pdbs: Vec<PodDisruptionBudget>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    webhooks: Vec<MutatingWebhookConfiguration>,
}

fn parse_all() -> Parsed {
    let mut p = Parsed::default();
    for (at, doc) in manifests() {
        let kind = doc["kind"].as_str().unwrap_or_default().to_string();
        if let Some(ns) = doc["metadata"]["namespace"].as_str() {
            assert_eq!(ns, "ambit-system", "{at}");
        }
        match kind.as_str() {
            "Namespace" => drop(typed::<Namespace>(&at, &doc)),
            "CustomResourceDefinition" => drop(typed::<CustomResourceDefinition>(&at, &doc)),
            "ServiceAccount" => p.service_accounts.push(typed(&at, &doc)),
            "ClusterRole" => p.cluster_roles.push(typed(&at, &doc)),
            "ClusterRoleBinding" => p.cluster_role_bindings.push(typed(&at, &doc)),
            "Role" => p.roles.push(typed(&at, &doc)),
            "RoleBinding" => p.role_bindings.push(typed(&at, &doc)),
            "Deployment" => p.deployments.push(typed(&at, &doc)),
            "DaemonSet" => p.daemonsets.push(typed(&at, &doc)),
            "Service" => p.services.push(typed(&at, &doc)),
            "PodDisruptionBudget" => p.pdbs.push(typed(&at, &doc)),
            "MutatingWebhookConfiguration" => p.webhooks.push(typed(&at, &doc)),
            other => panic!("{at}: unexpected kind {other}"),
        }
    }
    p
}

fn labels_match(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn template_labels(t: &PodTemplateSpec) -> BTreeMap<String, String> {
    t.metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default()
}

#[test]
fn every_manifest_is_its_typed_object_and_the_workloads_fit_together() {
    let p = parse_all();
    assert_eq!(p.deployments.len(), 1);
    assert_eq!(p.daemonsets.len(), 2);
    // The injection webhooks call the control plane's Service on a port
    // that reaches the webhook listener (15017), and never ambient pods.
    assert_eq!(p.webhooks.len(), 1);
    for hook in p.webhooks[0].webhooks.iter().flatten() {
        let svc = hook.client_config.service.clone().unwrap();
        assert_eq!(svc.path.as_deref(), Some("/inject"), "{}", hook.name);
        let target = p
            .services
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some(svc.name.as_str()))
            .and_then(|s| {
                s.spec
                    .clone()?
                    .ports?
                    .into_iter()
                    .find(|pt| Some(pt.port) == svc.port)
            })
            .and_then(|pt| pt.target_port);
        assert_eq!(target, Some(IntOrString::Int(15017)), "{}", hook.name);
        let ns_sel = hook.namespace_selector.clone().unwrap_or_default();
        let excludes_ambient = ns_sel.match_expressions.iter().flatten().any(|e| {
            e.key == "istio.io/dataplane-mode"
                && e.operator == "NotIn"
                && e.values.iter().flatten().any(|v| v == "ambient")
        });
        assert!(
            excludes_ambient,
            "{}: ambient namespaces are never sent",
            hook.name
        );
    }
    let sa_names: BTreeSet<String> = p
        .service_accounts
        .iter()
        .filter_map(|s| s.metadata.name.clone())
        .collect();

    let mut templates: Vec<(String, PodTemplateSpec)> = Vec::new();
    for d in &p.deployments {
        let spec = d.spec.clone().unwrap();
        let sel = spec.selector.match_labels.clone().unwrap_or_default();
        assert!(
            labels_match(&sel, &template_labels(&spec.template)),
            "Deployment selector"
        );
        assert_eq!(spec.replicas, Some(2));
        templates.push((d.metadata.name.clone().unwrap(), spec.template));
    }
    for d in &p.daemonsets {
        let spec = d.spec.clone().unwrap();
        let sel = spec.selector.match_labels.clone().unwrap_or_default();
        assert!(
            labels_match(&sel, &template_labels(&spec.template)),
            "DaemonSet selector"
        );
        templates.push((d.metadata.name.clone().unwrap(), spec.template));
    }
    for (name, t) in &templates {
        let spec = t.spec.clone().unwrap();
        let sa = spec.service_account_name.clone().unwrap_or_default();
        assert!(
            sa_names.contains(&sa),
            "{name}: ServiceAccount {sa} is defined"
        );
        for c in &spec.containers {
            let sc = c.security_context.clone().unwrap();
            assert_eq!(sc.read_only_root_filesystem, Some(true), "{name}");
            assert_eq!(sc.allow_privilege_escalation, Some(false), "{name}");
            assert_ne!(sc.privileged, Some(true), "{name}");
            let drop = sc.capabilities.clone().unwrap().drop.unwrap_or_default();
            assert_eq!(
                drop,
                ["ALL"],
                "{name}: drops every capability it does not add"
            );
            assert!(
                c.resources
                    .as_ref()
                    .and_then(|r| r.limits.as_ref())
                    .is_some(),
                "{name}: limits"
            );
            assert!(
                c.readiness_probe.is_some() || name == "ambit-node-agent",
                "{name}: probe"
            );
        }
    }
    // The control plane: non-root, probes on the monitoring port.
    let (_, cp) = templates
        .iter()
        .find(|(n, _)| n == "ambit-control")
        .unwrap();
    let cp_spec = cp.spec.clone().unwrap();
    let pod_sc = cp_spec.security_context.clone().unwrap();
    assert_eq!(pod_sc.run_as_non_root, Some(true));
    assert!(cp_spec.containers[0].liveness_probe.is_some());
    // ztunnel: not on the host network, the projected token for istio-ca.
    let (_, zt) = templates.iter().find(|(n, _)| n == "ztunnel").unwrap();
    let zt_spec = zt.spec.clone().unwrap();
    assert_ne!(zt_spec.host_network, Some(true));
    let audiences: Vec<String> = zt_spec
        .volumes
        .unwrap_or_default()
        .iter()
        .filter_map(|v| v.projected.clone())
        .flat_map(|p| p.sources.unwrap_or_default())
        .filter_map(|s| s.service_account_token.and_then(|t| t.audience))
        .collect();
    assert_eq!(audiences, ["istio-ca"]);
    let caps = zt_spec.containers[0]
        .security_context
        .clone()
        .unwrap()
        .capabilities
        .unwrap()
        .add
        .unwrap();
    assert_eq!(caps, ["NET_ADMIN", "SYS_ADMIN", "NET_RAW"]);

    // Services select the control plane's pods and target its ports; the
    // PDB selects them too.
    let cp_labels = template_labels(cp);
    let container_ports: BTreeSet<i32> = cp_spec
        .containers
        .iter()
        .flat_map(|c| c.ports.clone().unwrap_or_default())
        .map(|p| p.container_port)
        .collect();
    for s in &p.services {
        let spec = s.spec.clone().unwrap();
        assert!(labels_match(
            &spec.selector.clone().unwrap_or_default(),
            &cp_labels
        ));
        let ports = spec.ports.unwrap_or_default();
        let targets: BTreeSet<i32> = ports
            .iter()
            .map(|p| match &p.target_port {
                Some(IntOrString::Int(n)) => *n,
                other => panic!("numeric targetPort expected, got {other:?}"),
            })
            .collect();
        assert_eq!(targets, [15012, 15014, 15017].into(), "15012/15014/15017");
        assert!(
            targets.is_subset(&container_ports),
            "{targets:?} ⊆ {container_ports:?}"
        );
    }
    for pdb in &p.pdbs {
        let sel = pdb
            .spec
            .clone()
            .unwrap()
            .selector
            .unwrap()
            .match_labels
            .unwrap();
        assert!(labels_match(&sel, &cp_labels));
    }
}

/// (rule index within the subject's roles, group, resource, verb).
type Grant = (String, String, String, String);

/// The rules bound to ServiceAccount `sa`, with the namespace they apply
/// in (`None`: every namespace).
fn rules_of(p: &Parsed, sa: &str) -> Vec<(String, Option<String>, PolicyRule)> {
    let bound = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount"
                && s.name == sa
                && s.namespace.as_deref() == Some("ambit-system")
        })
    };
    let mut out = Vec::new();
    for b in p
        .cluster_role_bindings
        .iter()
        .filter(|b| bound(&b.subjects))
    {
        let role = p
            .cluster_roles
            .iter()
            .find(|r| r.metadata.name.as_deref() == Some(b.role_ref.name.as_str()))
            .unwrap();
        for (i, r) in role
            .rules
            .clone()
            .unwrap_or_default()
            .into_iter()
            .enumerate()
        {
            out.push((format!("ClusterRole {} rule {i}", b.role_ref.name), None, r));
        }
    }
    for b in p.role_bindings.iter().filter(|b| bound(&b.subjects)) {
        let ns = b.metadata.namespace.clone();
        let role = p
            .roles
            .iter()
            .find(|r| {
                r.metadata.name.as_deref() == Some(b.role_ref.name.as_str())
                    && r.metadata.namespace == ns
            })
            .unwrap();
        for (i, r) in role
            .rules
            .clone()
            .unwrap_or_default()
            .into_iter()
            .enumerate()
        {
            out.push((format!("Role {} rule {i}", b.role_ref.name), ns.clone(), r));
        }
    }
    out
}

fn allows(ns: &Option<String>, r: &PolicyRule, c: &ApiCall) -> Option<Grant> {
    let resource = if c.subresource.is_empty() {
        c.resource.clone()
    } else {
        format!("{}/{}", c.resource, c.subresource)
    };
    let ok = ns.as_ref().is_none_or(|n| *n == c.namespace)
        && r.api_groups.iter().flatten().any(|g| *g == c.group)
        && r.resources.iter().flatten().any(|x| *x == resource)
        && r.verbs.contains(&c.verb)
        && r.resource_names
            .as_ref()
            .is_none_or(|names| !c.name.is_empty() && names.contains(&c.name));
    ok.then(|| (String::new(), c.group.clone(), resource, c.verb.clone()))
}

/// Every call is allowed; every (rule, resource, verb) granted is used.
fn check_rbac(p: &Parsed, sa: &str, calls: &[ApiCall]) {
    let rules = rules_of(p, sa);
    assert!(!rules.is_empty(), "{sa} has rules");
    let mut used: BTreeSet<Grant> = BTreeSet::new();
    for c in calls {
        let hit = rules.iter().find_map(|(name, ns, r)| {
            allows(ns, r, c).map(|(_, g, res, v)| (name.clone(), g, res, v))
        });
        match hit {
            Some(g) => {
                used.insert(g);
            }
            None => panic!("{sa} makes a call its RBAC does not allow: {c:?}"),
        }
    }
    for (name, _, r) in &rules {
        for g in r.api_groups.iter().flatten() {
            for res in r.resources.iter().flatten() {
                for v in &r.verbs {
                    let grant = (name.clone(), g.clone(), res.clone(), v.clone());
                    assert!(
                        used.contains(&grant),
                        "{sa}: {grant:?} is granted but never used"
                    );
                }
            }
        }
    }
}

fn waypoint() -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": "waypoint", "namespace": "shop"},
        "spec": {"gatewayClassName": "istio-waypoint",
                 "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_grants_exactly_the_calls_the_control_plane_and_node_agent_make() {
    let p = parse_all();
    let fake = FakeApiServer::start().await.unwrap();
    fake.apply(namespace(
        "shop",
        json!({"istio.io/dataplane-mode": "ambient"}),
    ))
    .unwrap();
    fake.apply(pod("shop", "web-0", "10.1.0.5", "node-1", json!({})))
        .unwrap();
    fake.apply(waypoint()).unwrap();
    fake.set_token_review(
        "web",
        sa_token("shop", "default", Some("web-0"), &["istio-ca"]),
    );
    // The injector's webhook configuration as installed: no caBundle yet.
    let injector = workspace_root().join("deploy/kubernetes/06-sidecar-injector.yaml");
    for doc in yaml_docs(&injector).unwrap() {
        fake.apply(doc).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();

    // The first replica creates the Lease, the root Secret and the root
    // ConfigMap in every namespace, sets the injector's caBundle, writes
    // Gateway status and reviews a token.
    let a = control_plane(&fake, dir.path(), "a").await.unwrap();
    wait_synced(&a, LIMIT).await.unwrap();
    eventually(
        LIMIT,
        "root ConfigMaps, caBundle and Gateway status",
        || async {
            let cm = fake.get("v1", "ConfigMap", "ambit-system", "istio-ca-root-cert");
            let in_shop = fake.get("v1", "ConfigMap", "shop", "istio-ca-root-cert");
            let hooks = fake.get(
                "admissionregistration.k8s.io/v1",
                "MutatingWebhookConfiguration",
                "",
                "ambit-sidecar-injector",
            )?;
            let bundles_set = hooks["webhooks"].as_array()?.iter().all(|h| {
                h["clientConfig"]["caBundle"]
                    .as_str()
                    .is_some_and(|b| !b.is_empty())
            });
            let gw = fake.get(
                "gateway.networking.k8s.io/v1",
                "Gateway",
                "shop",
                "waypoint",
            );
            (cm.is_some()
                && in_shop.is_some()
                && bundles_set
                && gw.is_some_and(|g| !g["status"].is_null()))
            .then_some(())
        },
    )
    .await
    .unwrap();
    // A rejected object of every Istio kind: the leader reports each in
    // its status.
    let istio = [
        ("networking.istio.io/v1", "VirtualService"),
        ("networking.istio.io/v1", "DestinationRule"),
        ("networking.istio.io/v1", "ServiceEntry"),
        ("networking.istio.io/v1", "WorkloadEntry"),
        ("networking.istio.io/v1", "Sidecar"),
        ("security.istio.io/v1", "PeerAuthentication"),
        ("security.istio.io/v1", "AuthorizationPolicy"),
    ];
    for (v, k) in istio {
        fake.apply(json!({"apiVersion": v, "kind": k,
            "metadata": {"name": "broken", "namespace": "shop"}, "spec": "not-an-object"}))
            .unwrap();
    }
    eventually(LIMIT, "every rejected Istio object reported", || async {
        istio
            .iter()
            .all(|(v, k)| {
                fake.get(v, k, "shop", "broken")
                    .is_some_and(|o| !o["status"]["conditions"].is_null())
            })
            .then_some(())
    })
    .await
    .unwrap();
    let mut obs = ambit_tests::kubebed::Observer::connect_with_token(
        a.xds_addr(),
        ambit_proto::ADDRESS_TYPE_URL,
        ambit_tests::kubebed::NODE_TOKEN,
    )
    .await
    .unwrap();
    obs.next(LIMIT).await.unwrap();
    // A CRD kind vanishes from discovery: its CRD is read to tell a
    // restarting API server from a deleted CRD (here: deleted).
    fake.unregister("telemetry.istio.io/v1", "Telemetry");
    eventually(LIMIT, "Telemetry absent", || async {
        a.kube_source()?.states()[&ambit_config::Kind::Telemetry]
            .starts_with("absent")
            .then_some(())
    })
    .await
    .unwrap();
    // A stale root ConfigMap: the next leader updates it.
    let mut cm = fake
        .get("v1", "ConfigMap", "ambit-system", "istio-ca-root-cert")
        .unwrap();
    cm["data"]["root-cert.pem"] = json!("stale");
    fake.apply(cm).unwrap();
    a.kill().await;
    let b = control_plane(&fake, dir.path(), "b").await.unwrap();
    wait_synced(&b, LIMIT).await.unwrap();
    eventually(LIMIT, "b updates the root ConfigMap", || async {
        let cm = fake.get("v1", "ConfigMap", "ambit-system", "istio-ca-root-cert")?;
        (cm["data"]["root-cert.pem"] != "stale").then_some(())
    })
    .await
    .unwrap();
    b.shutdown().await;

    // The node agent's view.
    let client = fake
        .client("ambit-node-agent/node-1", "agent-token")
        .unwrap();
    tokio::time::timeout(
        LIMIT,
        ambit_cni::agent::kube::spawn_kube_view(client, "node-1"),
    )
    .await
    .unwrap()
    .unwrap();

    eventually(LIMIT, "the node agent watches both kinds", || async {
        let watching: BTreeSet<String> = fake
            .calls()
            .into_iter()
            .filter(|c| c.identity.starts_with("ambit-node-agent/") && c.verb == "watch")
            .map(|c| c.resource)
            .collect();
        (watching.len() == 2).then_some(())
    })
    .await
    .unwrap();
    let calls = fake.calls();
    let of = |prefix: &str| -> Vec<ApiCall> {
        calls
            .iter()
            .filter(|c| c.identity.starts_with(prefix))
            .cloned()
            .collect()
    };
    let control = of("ambit-control/");
    let agent = of("ambit-node-agent/");
    for c in control.iter().chain(&agent) {
        eprintln!(
            "{} {} {}/{} {} {}",
            c.identity, c.verb, c.group, c.resource, c.subresource, c.name
        );
    }
    check_rbac(&p, "ambit-control", &control);
    check_rbac(&p, "ambit-node-agent", &agent);
    assert!(
        rules_of(&p, "ztunnel").is_empty(),
        "ztunnel needs no API access"
    );
}

/// `<binary> --help` of the built binary (clap lists `[env: NAME=]` for
/// every flag settable from the environment).
async fn help_of(binary: &str) -> String {
    let exe = workspace_root().join("target/debug").join(binary);
    assert!(
        exe.exists(),
        "{} is not built: cargo build --workspace",
        exe.display()
    );
    let out = tokio::time::timeout(
        LIMIT,
        tokio::process::Command::new(&exe).arg("--help").output(),
    )
    .await
    .unwrap()
    .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn every_env_var_and_arg_the_manifests_set_is_a_flag_of_the_binary() {
    let p = parse_all();
    let mut templates = Vec::new();
    for d in &p.deployments {
        templates.push(d.spec.clone().unwrap().template);
    }
    for d in &p.daemonsets {
        templates.push(d.spec.clone().unwrap().template);
    }
    let mut checked = 0;
    for t in templates {
        for c in t.spec.unwrap().containers {
            let binary = match c.name.as_str() {
                "ambit-control" => "ambit-control",
                "ztunnel" => "ztunnel",
                "node-agent" => "ambit-node-agent",
                other => panic!("which binary runs in container {other}?"),
            };
            let help = help_of(binary).await;
            for e in c.env.unwrap_or_default() {
                if e.name == "RUST_LOG" {
                    continue;
                }
                assert!(
                    help.contains(&format!("[env: {}=", e.name)),
                    "{binary} has no flag for env {} (its --help:\n{help})",
                    e.name
                );
                checked += 1;
            }
            for a in c.args.unwrap_or_default() {
                assert!(help.contains(&a), "{binary} has no flag {a}");
            }
        }
    }
    assert!(checked > 15, "{checked}");
}

/// `kubectl apply -k deploy/kubernetes` (and `-k deploy/kubernetes/crds`)
/// apply exactly the files `ambitctl install` compiles in.
#[test]
fn the_kustomizations_list_every_manifest_and_install_compiles_them_in() {
    let dir = workspace_root().join("deploy/kubernetes");
    for (sub, prefix) in [(dir.clone(), ""), (dir.join("crds"), "crds/")] {
        let k = yaml_docs(&sub.join("kustomization.yaml")).unwrap();
        let listed: Vec<String> = k[0]["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| format!("{prefix}{}", r.as_str().unwrap()))
            .collect();
        let files: Vec<String> = yaml_files(&sub)
            .iter()
            .map(|p| format!("{prefix}{}", p.file_name().unwrap().to_string_lossy()))
            .collect();
        assert_eq!(listed, files, "{}", sub.display());
        for f in &files {
            assert!(
                ambitctl::install::MANIFESTS.iter().any(|(n, _)| n == f),
                "{f} is compiled into ambitctl install"
            );
        }
    }
    assert_eq!(ambitctl::install::MANIFESTS.len(), 7);
}
