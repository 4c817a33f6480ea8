//! The ambient enrollment rule, shared by the control plane (which workloads
//! get HBONE) and the node agent (which pods get redirected).

use crate::objects::{LABEL_DATAPLANE_MODE, Labels};

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
