//! The status a waypoint Gateway should have (Gateway API conditions):
//!
//! - `Accepted`: `True` when `ambit-config` decodes the Gateway and it has
//!   an HBONE listener on 15008; `False` with reason `Invalid` (the
//!   decoder's message) or `UnsupportedProtocol` (the listener it lacks).
//! - `Programmed`: `True` once its Deployment has a ready replica and its
//!   Service a ClusterIP; `False` with reason `Pending` and what it waits
//!   for meanwhile, `Invalid` when not accepted.
//! - `addresses`: the Service's ClusterIP (`IPAddress`) and its hostname.
//!
//! Conditions of other types are kept; a condition's transition time moves
//! only when its status does; `observedGeneration` is the Gateway's.

use serde_json::{Value, json};

/// What the controller knows of the objects that run a waypoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Running {
    /// Ready replicas of its Deployment (`None`: no Deployment yet).
    pub ready_replicas: Option<i32>,
    /// Its Service's ClusterIP (`None`: no Service or not allocated yet).
    pub cluster_ip: Option<String>,
}

/// The status `gw` (the object as the API server holds it) should have.
/// `problem` is why it is not accepted (decoding or its listeners).
pub fn desired_status(
    gw: &Value,
    problem: Option<(&str, String)>,
    running: &Running,
    domain: &str,
    now: &str,
) -> Value {
    let name = gw["metadata"]["name"].as_str().unwrap_or_default();
    let ns = gw["metadata"]["namespace"].as_str().unwrap_or_default();
    let generation = gw["metadata"]["generation"].as_i64().unwrap_or(0);
    let (accepted, programmed) = match &problem {
        Some((reason, message)) => (
            ("False", *reason, message.clone()),
            ("False", "Invalid", format!("not accepted: {message}")),
        ),
        None => {
            let accepted = (
                "True",
                "Accepted",
                "accepted by ambit; its configuration is served to its waypoint proxies"
                    .to_string(),
            );
            let ready = running.ready_replicas.unwrap_or(0);
            let programmed = match (&running.cluster_ip, ready) {
                (Some(_), n) if n > 0 => (
                    "True",
                    "Programmed",
                    format!("{n} ready replica(s) behind Service {ns}/{name}"),
                ),
                (None, _) => (
                    "False",
                    "Pending",
                    format!("waiting for Service {ns}/{name} to get a ClusterIP"),
                ),
                (Some(_), _) => (
                    "False",
                    "Pending",
                    format!(
                        "waiting for Deployment {ns}/{name} to have a ready replica (kubectl -n {ns} get pods -l gateway.networking.k8s.io/gateway-name={name})"
                    ),
                ),
            };
            (accepted, programmed)
        }
    };
    let old: Vec<Value> = gw["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let condition = |type_: &str, (status, reason, message): (&str, &str, String)| {
        let mut c = json!({
            "type": type_,
            "status": status,
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": now,
        });
        // Keep the transition time when only the rest moved.
        if let Some(prev) = old.iter().find(|x| x["type"] == type_)
            && prev["status"] == c["status"]
        {
            c["lastTransitionTime"] = prev["lastTransitionTime"].clone();
        }
        c
    };
    let mut conditions: Vec<Value> = old
        .iter()
        .filter(|c| !matches!(c["type"].as_str(), Some("Accepted" | "Programmed")))
        .cloned()
        .collect();
    conditions.push(condition("Accepted", accepted));
    conditions.push(condition("Programmed", programmed));
    let mut addresses = Vec::new();
    if problem.is_none() {
        if let Some(ip) = &running.cluster_ip {
            addresses.push(json!({"type": "IPAddress", "value": ip}));
        }
        addresses.push(json!({"type": "Hostname", "value": format!("{name}.{ns}.svc.{domain}")}));
    }
    json!({"conditions": conditions, "addresses": addresses})
}

/// True when `current` already says what `desired` says (transition
/// times aside; conditions in any order).
pub fn same_status(current: &Value, desired: &Value) -> bool {
    let key = |c: &Value| {
        (
            c["type"].to_string(),
            c["status"].clone(),
            c["reason"].clone(),
            c["message"].clone(),
            c["observedGeneration"].clone(),
        )
    };
    let set = |v: &Value| {
        let mut s: Vec<_> = v["conditions"]
            .as_array()
            .map(|cs| cs.iter().map(key).collect())
            .unwrap_or_default();
        s.sort_by(|a, b| a.0.cmp(&b.0));
        s
    };
    let addrs = |v: &Value| v["addresses"].as_array().cloned().unwrap_or_default();
    set(current) == set(desired) && addrs(current) == addrs(desired)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gw() -> Value {
        json!({
            "apiVersion": "gateway.networking.k8s.io/v1",
            "kind": "Gateway",
            "metadata": {"name": "waypoint", "namespace": "shop", "generation": 3},
            "spec": {"gatewayClassName": "istio-waypoint",
                     "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]},
        })
    }

    #[test]
    fn programmed_only_with_a_ready_replica_and_a_cluster_ip() {
        let t = "2026-01-01T00:00:00Z";
        let pending = desired_status(&gw(), None, &Running::default(), "cluster.local", t);
        assert_eq!(pending["conditions"][0]["status"], "True", "accepted");
        assert_eq!(pending["conditions"][1]["status"], "False");
        assert_eq!(pending["conditions"][1]["reason"], "Pending");
        let running = Running {
            ready_replicas: Some(1),
            cluster_ip: Some("10.96.0.9".into()),
        };
        let up = desired_status(&gw(), None, &running, "cluster.local", t);
        assert_eq!(up["conditions"][1]["status"], "True");
        assert_eq!(up["conditions"][1]["observedGeneration"], 3);
        assert_eq!(up["addresses"][0]["value"], "10.96.0.9");
        assert_eq!(
            up["addresses"][1]["value"],
            "waypoint.shop.svc.cluster.local"
        );
        assert!(same_status(&up, &up) && !same_status(&up, &pending));
        // Only the status moved: the transition time of Accepted stays.
        let mut again = gw();
        again["status"] = pending.clone();
        let later = desired_status(
            &again,
            None,
            &running,
            "cluster.local",
            "2026-01-02T00:00:00Z",
        );
        assert_eq!(later["conditions"][0]["lastTransitionTime"], t);
        assert_eq!(
            later["conditions"][1]["lastTransitionTime"],
            "2026-01-02T00:00:00Z"
        );
    }

    #[test]
    fn a_refused_waypoint_is_neither_accepted_nor_programmed() {
        let s = desired_status(
            &gw(),
            Some(("UnsupportedProtocol", "no HBONE listener".into())),
            &Running::default(),
            "cluster.local",
            "t",
        );
        assert_eq!(s["conditions"][0]["status"], "False");
        assert_eq!(s["conditions"][0]["reason"], "UnsupportedProtocol");
        assert_eq!(s["conditions"][1]["reason"], "Invalid");
        assert!(s["addresses"].as_array().is_some_and(Vec::is_empty));
    }
}
