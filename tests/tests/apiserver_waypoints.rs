//! The waypoint deployment controller against a real kube-apiserver (the
//! kit in `../shared/kube`; no controller-manager runs, so the test writes
//! the Deployment's status as the Deployment controller would): a waypoint
//! Gateway gets a ServiceAccount, a Deployment and a ClusterIP Service,
//! owned by it; `Programmed` waits for a ready replica and carries the
//! Service's ClusterIP; an HTTP-only waypoint is not accepted and gets
//! nothing; a user's own label on the Deployment survives a reconcile; a
//! leader change writes nothing that is already right.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use ambit_control::ControlPlane;
use ambit_tests::eventually;
use ambit_tests::kubeapi::{Crds, KubeApiServer, api_of};
use ambit_tests::kubebed::wait_synced;
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(20);

async fn control_plane(kube: &KubeApiServer, dir: &Path, replica: &str) -> ControlPlane {
    ControlPlane::start(kube.control_config(dir, replica).await.unwrap())
        .await
        .unwrap()
}

fn gateway(name: &str, listeners: Value, infra: Value) -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
        "metadata": {"name": name, "namespace": "ai"},
        "spec": {"gatewayClassName": "istio-waypoint", "listeners": listeners,
                 "infrastructure": infra},
    })
}

fn hbone() -> Value {
    json!([{"name": "mesh", "port": 15008, "protocol": "HBONE"}])
}

fn object(api_version: &str, kind: &str, name: &str) -> Value {
    json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": "ai"}})
}

/// The Deployment controller's part: `name`'s Deployment has one ready
/// replica.
async fn mark_ready(kube: &KubeApiServer, name: &str) {
    let d = object("apps/v1", "Deployment", name);
    let (api, _) = api_of(&kube.client().await.unwrap(), &d).unwrap();
    api.patch_status(
        name,
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(&json!({"status": {"replicas": 1, "readyReplicas": 1,
            "availableReplicas": 1, "updatedReplicas": 1}})),
    )
    .await
    .unwrap();
}

fn condition<'a>(gw: &'a Value, type_: &str) -> Option<&'a Value> {
    gw["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

/// Successful writes (`patch`, `create`, `update`) of `resource` (and
/// `subresource`, `""` for none) by the control plane, in the audit log.
fn writes(kube: &KubeApiServer, resource: &str, subresource: &str) -> usize {
    kube.audit_events()
        .unwrap()
        .iter()
        .filter(|e| {
            e["objectRef"]["resource"] == resource
                && e["objectRef"]["subresource"].as_str().unwrap_or_default() == subresource
                && matches!(e["verb"].as_str(), Some("patch" | "create" | "update"))
                && e["user"]["username"] == "system:serviceaccount:ambit-system:ambit-control"
                && e["responseStatus"]["code"]
                    .as_i64()
                    .is_some_and(|c| c < 300)
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waypoint_gateway_gets_what_runs_it_and_is_programmed_once_ready() {
    let kube = KubeApiServer::start_audited(Crds::Standard).await.unwrap();
    kube.install_ambit().await.unwrap();
    kube.apply(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ai"}}))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cp = control_plane(&kube, dir.path(), "a").await;
    wait_synced(&cp, LIMIT).await.unwrap();
    eventually(LIMIT, "leading", || async { cp.is_leader().then_some(()) })
        .await
        .unwrap();

    let created = Instant::now();
    let gw = kube
        .apply(&gateway(
            "waypoint",
            hbone(),
            json!({"labels": {"team": "ml"}}),
        ))
        .await
        .unwrap();
    let uid = gw.metadata.uid.clone().unwrap();
    let deployment = eventually(LIMIT, "the Deployment", || async {
        kube.get(&object("apps/v1", "Deployment", "waypoint"))
            .await
            .ok()?
    })
    .await
    .unwrap();
    let written = created.elapsed();
    let service = kube
        .get(&object("v1", "Service", "waypoint"))
        .await
        .unwrap()
        .expect("the Service");
    let sa = kube
        .get(&object("v1", "ServiceAccount", "waypoint"))
        .await
        .unwrap()
        .expect("the ServiceAccount");
    for o in [&deployment, &service, &sa] {
        let owner = &o["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "Gateway", "{o:#}");
        assert_eq!(
            owner["uid"],
            uid.as_str(),
            "garbage-collected with the Gateway"
        );
        assert_eq!(o["metadata"]["labels"]["team"], "ml");
        assert_eq!(
            o["metadata"]["labels"]["gateway.networking.k8s.io/gateway-name"],
            "waypoint"
        );
    }
    let pod = &deployment["spec"]["template"];
    assert_eq!(pod["spec"]["serviceAccountName"], "waypoint");
    assert_eq!(pod["metadata"]["labels"]["istio.io/dataplane-mode"], "none");
    assert_eq!(pod["spec"]["containers"][0]["args"][1], "waypoint");
    assert_eq!(
        deployment["spec"]["replicas"], 1,
        "the API server's default"
    );
    let ip = service["spec"]["clusterIP"].as_str().unwrap().to_string();
    assert!(!ip.is_empty() && ip != "None");

    // Not programmed before a replica is ready.
    let pending = eventually(LIMIT, "Accepted", || async {
        let g = kube
            .get(&gateway("waypoint", hbone(), json!({})))
            .await
            .ok()??;
        condition(&g, "Accepted")?;
        Some(g)
    })
    .await
    .unwrap();
    assert_eq!(
        condition(&pending, "Programmed").unwrap()["status"],
        "False"
    );
    let ready_at = Instant::now();
    mark_ready(&kube, "waypoint").await;
    let programmed = eventually(LIMIT, "Programmed", || async {
        let g = kube
            .get(&gateway("waypoint", hbone(), json!({})))
            .await
            .ok()??;
        (condition(&g, "Programmed")?["status"] == "True").then_some(g)
    })
    .await
    .unwrap();
    let to_programmed = ready_at.elapsed();
    assert_eq!(programmed["status"]["addresses"][0]["value"], ip.as_str());
    println!(
        "Gateway created -> Deployment, Service and ServiceAccount written: {written:?}; Deployment ready -> Programmed: {to_programmed:?}"
    );

    // A user's own label on the Deployment survives a reconcile that
    // changes the Deployment (a new infrastructure label).
    kube.patch(
        &object("apps/v1", "Deployment", "waypoint"),
        &json!({"metadata": {"labels": {"owner": "alice"}}}),
    )
    .await
    .unwrap();
    kube.apply(&gateway(
        "waypoint",
        hbone(),
        json!({"labels": {"team": "ml", "tier": "gold"}}),
    ))
    .await
    .unwrap();
    let d = eventually(LIMIT, "the new label applied", || async {
        let d = kube
            .get(&object("apps/v1", "Deployment", "waypoint"))
            .await
            .ok()??;
        (d["metadata"]["labels"]["tier"] == "gold").then_some(d)
    })
    .await
    .unwrap();
    assert_eq!(
        d["metadata"]["labels"]["owner"], "alice",
        "the user's label stays"
    );

    // HTTP only: not accepted, and nothing runs it.
    kube.apply(&gateway(
        "http-only",
        json!([{"name": "http", "port": 80, "protocol": "HTTP"}]),
        json!({}),
    ))
    .await
    .unwrap();
    let refused = eventually(LIMIT, "Accepted=False", || async {
        let g = kube
            .get(&gateway("http-only", json!([]), json!({})))
            .await
            .ok()??;
        (condition(&g, "Accepted")?["status"] == "False").then_some(g)
    })
    .await
    .unwrap();
    let accepted = condition(&refused, "Accepted").unwrap();
    assert_eq!(accepted["reason"], "UnsupportedProtocol");
    assert!(accepted["message"].as_str().unwrap().contains("15008"));
    assert_eq!(
        condition(&refused, "Programmed").unwrap()["status"],
        "False"
    );
    assert!(
        kube.get(&object("apps/v1", "Deployment", "http-only"))
            .await
            .unwrap()
            .is_none()
    );

    // A new leader finds everything right and writes nothing.
    let count = || {
        [
            ("deployments", ""),
            ("services", ""),
            ("serviceaccounts", ""),
            ("gateways", "status"),
        ]
        .map(|(r, sub)| writes(&kube, r, sub))
    };
    let before = count();
    cp.shutdown().await;
    let b = control_plane(&kube, dir.path(), "b").await;
    wait_synced(&b, LIMIT).await.unwrap();
    eventually(LIMIT, "b leads", || async { b.is_leader().then_some(()) })
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        count(),
        before,
        "nothing written again after the leader change (Deployment, Service, ServiceAccount, status)"
    );
    b.shutdown().await;
}
