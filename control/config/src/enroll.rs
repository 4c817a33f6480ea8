//! The ambient enrollment rule, shared by the control plane (which workloads
//! get HBONE) and the node agent (which pods get redirected), and the rule
//! for which sidecar pods the node agent captures.

use crate::objects::{LABEL_DATAPLANE_MODE, Labels};

/// The annotation injection leaves on a sidecar pod (Istio's JSON: the
/// containers, init containers and volumes it added).
pub const SIDECAR_STATUS: &str = "sidecar.istio.io/status";
/// The init container that captures a sidecar pod's traffic itself.
pub const SIDECAR_INIT_CONTAINER: &str = "istio-init";
/// The label naming a gateway's (waypoint's) pods; they are never sidecars.
const GATEWAY_NAME: &str = "gateway.networking.k8s.io/gateway-name";

/// Whether the node agent programs a sidecar pod's capture (node-agent
/// redirection, as istio-cni does): the pod was injected (its status
/// annotation parses) without the `istio-init` init container, and is no
/// gateway's pod. A pod whose status lists `istio-init` captures itself.
pub fn wants_sidecar_capture(labels: &Labels, annotations: &Labels) -> bool {
    if labels.contains_key(GATEWAY_NAME) {
        return false;
    }
    let Some(status) = annotations.get(SIDECAR_STATUS) else {
        return false;
    };
    let Ok(status) = serde_json::from_str::<serde_json::Value>(status) else {
        return false;
    };
    let captures_itself = status["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c.as_str() == Some(SIDECAR_INIT_CONTAINER));
    status.is_object() && !captures_itself
}

/// `istio.io/dataplane-mode`: the object's own label wins (`none` opts out,
/// `ambient` opts in), else the namespace's `ambient` enrolls.
pub fn is_enrolled(ns_labels: &Labels, labels: &Labels) -> bool {
    match labels.get(LABEL_DATAPLANE_MODE).map(String::as_str) {
        Some("none") => false,
        Some("ambient") => true,
        _ => ns_labels.get(LABEL_DATAPLANE_MODE).map(String::as_str) == Some("ambient"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_agent_captures_sidecar_pods_injected_without_istio_init() {
        let ann =
            |status: &str| -> Labels { [(SIDECAR_STATUS.to_string(), status.to_string())].into() };
        let none = Labels::new();
        let with_init = r#"{"containers":["istio-proxy"],"initContainers":["istio-init"]}"#;
        let without = r#"{"containers":["istio-proxy"],"initContainers":[]}"#;
        let istio_cni = r#"{"containers":["istio-proxy"],"initContainers":["istio-validation"]}"#;
        assert!(!wants_sidecar_capture(&none, &ann(with_init)));
        assert!(wants_sidecar_capture(&none, &ann(without)));
        assert!(wants_sidecar_capture(&none, &ann(istio_cni)));
        assert!(!wants_sidecar_capture(&none, &ann("not json")));
        assert!(!wants_sidecar_capture(&none, &Labels::new()));
        let gateway: Labels = [(GATEWAY_NAME.to_string(), "wp".to_string())].into();
        assert!(!wants_sidecar_capture(&gateway, &ann(without)));
    }

    #[test]
    fn enrollment_table() {
        let l = |v: Option<&str>| -> Labels {
            v.map(|v| [(LABEL_DATAPLANE_MODE.to_string(), v.to_string())].into())
                .unwrap_or_default()
        };
        // (namespace label, pod label, enrolled)
        let cases = [
            (None, None, false),
            (Some("ambient"), None, true),
            (Some("ambient"), Some("none"), false),
            (None, Some("ambient"), true),
            (Some("none"), Some("ambient"), true),
            (Some("sidecar"), None, false),
        ];
        for (ns, pod, want) in cases {
            assert_eq!(is_enrolled(&l(ns), &l(pod)), want, "{ns:?} {pod:?}");
        }
    }
}
