//! Sidecar injection: which pods get an Envoy sidecar, and the JSON Patch
//! (RFC 6902) that adds it. One path for both consumers: the mutating
//! admission webhook ([`webhook`]) returns the patch to the API server, and
//! `ambitctl kube-inject` applies it to a file ([`apply_patch`]).
//!
//! What a pod gets (Istio's names, so tools that look for them find them):
//!
//! ```text
//! initContainers  istio-init    ambit-agent redirect: iptables in the pod netns,
//!                               outbound → 15001, inbound → 15006, the proxy's
//!                               own uid (1337) and its ports exempt
//!                               (omitted when the node agent redirects: node-agent mode)
//! containers      istio-proxy   ambit-agent --kind sidecar, which runs Envoy;
//!                               readiness :15021/healthz/ready, metrics :15020
//! volumes         ambit-token   projected ServiceAccount token, audience istio-ca
//!                 ambit-ca      ConfigMap istio-ca-root-cert (the mesh root)
//!                 ambit-state   emptyDir (SDS socket, bootstrap)
//! labels          security.istio.io/tlsMode: istio, networking.istio.io/tunnel: http
//!                 (peers reach the pod over HBONE, terminated by its Envoy on 15008)
//! annotations     sidecar.istio.io/status: what was added (marks the pod injected)
//! ```

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;

mod patch;
pub mod proxy;
#[cfg(test)]
mod tests;
pub mod webhook;

pub use patch::{PatchError, apply_patch, injection_patch};

/// Namespace label that turns injection on (`enabled`) or off (`disabled`).
pub const NAMESPACE_LABEL: &str = "istio-injection";
/// Pod annotation or label: `"true"` asks for a sidecar, `"false"` refuses one.
pub const POD_INJECT: &str = "sidecar.istio.io/inject";
/// Pod annotation written by injection; its presence means "already injected".
pub const STATUS_ANNOTATION: &str = "sidecar.istio.io/status";
/// The sidecar container's name.
pub const PROXY_CONTAINER: &str = "istio-proxy";
/// The redirection init container's name.
pub const INIT_CONTAINER: &str = "istio-init";
/// Label and value marking a namespace or pod as ambient.
pub const DATAPLANE_MODE: &str = "istio.io/dataplane-mode";

/// How a sidecar pod's traffic reaches its Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redirection {
    /// An init container programs iptables in the pod (needs NET_ADMIN).
    InitContainer,
    /// The node agent programs it when the pod is created, as istio-cni
    /// does for sidecars; the pod needs no privileges.
    NodeAgent,
}

/// What the injected containers are made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InjectSettings {
    /// Image holding `ambit-agent` and Envoy.
    pub proxy_image: String,
    /// The control plane's xDS/CA address the agent dials (`https://host:15012`).
    pub xds_address: String,
    pub trust_domain: String,
    pub cluster_id: String,
    pub redirection: Redirection,
    /// The uid Envoy runs as; its own traffic is never redirected.
    pub proxy_uid: i64,
}

impl Default for InjectSettings {
    fn default() -> Self {
        InjectSettings {
            proxy_image: "ghcr.io/ambit-mesh/proxy:0.1.0".to_string(),
            xds_address: "https://ambit-control.ambit-system.svc:15012".to_string(),
            trust_domain: "cluster.local".to_string(),
            cluster_id: "Kubernetes".to_string(),
            redirection: Redirection::InitContainer,
            proxy_uid: 1337,
        }
    }
}

/// Whether a pod gets a sidecar, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Inject,
    Skip(SkipReason),
}

/// Why a pod is left alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SkipReason {
    /// `sidecar.istio.io/inject: "false"` on the pod.
    OptedOut,
    /// The pod shares the node's network namespace.
    HostNetwork,
    /// It already has a sidecar (the status annotation or an `istio-proxy`).
    AlreadyInjected,
    /// The pod or its namespace is ambient: ztunnel serves it.
    Ambient,
    /// `istio-injection: disabled` on the namespace.
    NamespaceDisabled,
    /// Neither the namespace nor the pod asks for a sidecar.
    NotSelected,
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SkipReason::OptedOut => "the pod opts out (sidecar.istio.io/inject: \"false\")",
            SkipReason::HostNetwork => "the pod uses the host network",
            SkipReason::AlreadyInjected => "the pod already has a sidecar",
            SkipReason::Ambient => "the pod is in ambient mode (istio.io/dataplane-mode)",
            SkipReason::NamespaceDisabled => "the namespace disables injection",
            SkipReason::NotSelected => {
                "neither the namespace (istio-injection=enabled) nor the pod (sidecar.istio.io/inject=\"true\") asks for a sidecar"
            }
        })
    }
}

/// Decides for `pod` in a namespace labelled `ns_labels`. The pod's own
/// choice wins over the namespace's, except that a namespace with
/// injection disabled, an ambient pod or namespace, host networking and an
/// existing sidecar always mean no.
pub fn decide(pod: &Pod, ns_labels: &BTreeMap<String, String>) -> Decision {
    let meta = &pod.metadata;
    let pod_choice = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(POD_INJECT))
        .or_else(|| meta.annotations.as_ref().and_then(|a| a.get(POD_INJECT)))
        .map(|v| v.trim().to_ascii_lowercase());
    let spec = pod.spec.as_ref();
    if spec.and_then(|s| s.host_network).unwrap_or(false) {
        return Decision::Skip(SkipReason::HostNetwork);
    }
    if is_injected(pod) {
        return Decision::Skip(SkipReason::AlreadyInjected);
    }
    let ambient = |labels: Option<&BTreeMap<String, String>>| {
        labels
            .and_then(|l| l.get(DATAPLANE_MODE))
            .map(String::as_str)
            == Some("ambient")
    };
    if ambient(Some(ns_labels)) || ambient(meta.labels.as_ref()) {
        return Decision::Skip(SkipReason::Ambient);
    }
    let ns_choice = ns_labels.get(NAMESPACE_LABEL).map(String::as_str);
    if ns_choice == Some("disabled") {
        return Decision::Skip(SkipReason::NamespaceDisabled);
    }
    match (pod_choice.as_deref(), ns_choice) {
        (Some("false"), _) => Decision::Skip(SkipReason::OptedOut),
        (Some("true"), _) | (_, Some("enabled")) => Decision::Inject,
        _ => Decision::Skip(SkipReason::NotSelected),
    }
}

/// The pod already carries a sidecar: injection wrote its status, or a
/// container has the proxy's name.
pub fn is_injected(pod: &Pod) -> bool {
    let annotated = pod
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(STATUS_ANNOTATION));
    let has_proxy = pod
        .spec
        .as_ref()
        .is_some_and(|s| s.containers.iter().any(|c| c.name == PROXY_CONTAINER));
    annotated || has_proxy
}
