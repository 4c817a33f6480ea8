//! Who is on the other end of an xDS stream: the proxy kind and where it
//! runs, read from the `Node` of its first request.
//!
//! Node ids follow Istio's convention `KIND~IP~POD.NAMESPACE~NAMESPACE.svc.DOMAIN`
//! (`ztunnel~…`, `router~…` for waypoints and gateways, `sidecar~…`); node
//! metadata adds `NAMESPACE`, `NODE_NAME`, `NAME` and `CLUSTER_ID` as Istio's
//! agents send them. What a proxy is *allowed* to see is decided from its
//! authenticated identity, never from these self-reported fields.

use std::collections::BTreeMap;
use std::fmt;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::google::protobuf::value::Kind as ValueKind;

/// The kinds of proxy the control plane serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ProxyKind {
    /// The per-node L4 proxy: the workload API.
    Ztunnel,
    /// An upstream Envoy acting as a waypoint (node id `router~…`).
    Waypoint,
    /// An upstream Envoy beside one pod (node id `sidecar~…`).
    Sidecar,
}

impl ProxyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyKind::Ztunnel => "ztunnel",
            ProxyKind::Waypoint => "waypoint",
            ProxyKind::Sidecar => "sidecar",
        }
    }

    /// The kind named by the first `~`-separated field of a node id.
    fn from_id_prefix(prefix: &str) -> Option<ProxyKind> {
        match prefix {
            "ztunnel" => Some(ProxyKind::Ztunnel),
            "router" | "waypoint" => Some(ProxyKind::Waypoint),
            "sidecar" => Some(ProxyKind::Sidecar),
            _ => None,
        }
    }
}

impl fmt::Display for ProxyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A connected proxy as its node says it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyNode {
    pub kind: ProxyKind,
    /// The full node id.
    pub id: String,
    /// Pod name (from the id's third field, or metadata `NAME`).
    pub pod_name: String,
    /// Pod namespace (from the id, or metadata `NAMESPACE`).
    pub namespace: String,
    /// Kubernetes node the proxy runs on (metadata `NODE_NAME`).
    pub node_name: String,
    /// Service account the proxy claims (metadata `SERVICE_ACCOUNT`; may be
    /// empty).
    pub service_account: String,
    /// The pod's labels (metadata `LABELS`, a struct of strings).
    pub labels: BTreeMap<String, String>,
}

/// Label naming the Gateway a waypoint (or gateway) pod belongs to.
pub const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";

impl ProxyNode {
    /// The Gateway this proxy runs for (a waypoint's own Gateway), from its
    /// pod labels.
    pub fn gateway_name(&self) -> Option<&str> {
        self.labels.get(GATEWAY_NAME_LABEL).map(String::as_str)
    }
}

impl ProxyNode {
    /// Reads the node of a stream's first request. A node without a
    /// recognisable kind is served as a ztunnel (the workload API is what
    /// every earlier client of this server asked for).
    pub fn from_node(node: Option<&Node>) -> ProxyNode {
        let Some(node) = node else {
            return ProxyNode::unnamed(ProxyKind::Ztunnel);
        };
        let mut parts = node.id.split('~');
        let kind = parts
            .next()
            .and_then(ProxyKind::from_id_prefix)
            .unwrap_or(ProxyKind::Ztunnel);
        let _ip = parts.next();
        let (mut pod_name, mut namespace) = parts
            .next()
            .and_then(|p| p.split_once('.'))
            .map(|(n, ns)| (n.to_string(), ns.to_string()))
            .unwrap_or_default();
        let meta = |key: &str| -> String {
            node.metadata
                .as_ref()
                .and_then(|m| m.fields.get(key))
                .and_then(|v| match &v.kind {
                    Some(ValueKind::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default()
        };
        if pod_name.is_empty() {
            pod_name = meta("NAME");
        }
        if namespace.is_empty() {
            namespace = meta("NAMESPACE");
        }
        ProxyNode {
            kind,
            id: node.id.clone(),
            pod_name,
            namespace,
            node_name: meta("NODE_NAME"),
            service_account: meta("SERVICE_ACCOUNT"),
            labels: node
                .metadata
                .as_ref()
                .and_then(|m| m.fields.get("LABELS"))
                .map(string_fields)
                .unwrap_or_default(),
        }
    }

    fn unnamed(kind: ProxyKind) -> ProxyNode {
        ProxyNode {
            kind,
            id: String::new(),
            pod_name: String::new(),
            namespace: String::new(),
            node_name: String::new(),
            service_account: String::new(),
            labels: BTreeMap::new(),
        }
    }
}

/// The string fields of a `Struct` value (anything else is skipped).
fn string_fields(v: &envoy_types::pb::google::protobuf::Value) -> BTreeMap<String, String> {
    match &v.kind {
        Some(ValueKind::StructValue(s)) => s
            .fields
            .iter()
            .filter_map(|(k, v)| match &v.kind {
                Some(ValueKind::StringValue(s)) => Some((k.clone(), s.clone())),
                _ => None,
            })
            .collect(),
        _ => BTreeMap::new(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use envoy_types::pb::google::protobuf::{Struct, Value};

    use super::*;

    fn node(id: &str, meta: &[(&str, &str)]) -> Node {
        let fields: HashMap<String, Value> = meta
            .iter()
            .map(|(k, v)| {
                (
                    k.to_string(),
                    Value {
                        kind: Some(ValueKind::StringValue(v.to_string())),
                    },
                )
            })
            .collect();
        Node {
            id: id.into(),
            metadata: Some(Struct { fields }),
            ..Default::default()
        }
    }

    #[test]
    fn kinds_and_names_from_istio_style_ids() {
        let cases = [
            (
                "ztunnel~10.0.0.1~ztunnel-abc.ambit-system~ambit-system.svc.cluster.local",
                ProxyKind::Ztunnel,
                "ztunnel-abc",
                "ambit-system",
            ),
            (
                "router~10.1.0.7~waypoint-5f.ai-inference~ai-inference.svc.cluster.local",
                ProxyKind::Waypoint,
                "waypoint-5f",
                "ai-inference",
            ),
            (
                "sidecar~10.1.0.9~llm-v1-0.ai~ai.svc.cluster.local",
                ProxyKind::Sidecar,
                "llm-v1-0",
                "ai",
            ),
        ];
        for (id, kind, pod, ns) in cases {
            let p = ProxyNode::from_node(Some(&node(id, &[("NODE_NAME", "node-1")])));
            assert_eq!(
                (p.kind, p.pod_name.as_str(), p.namespace.as_str()),
                (kind, pod, ns),
                "{id}"
            );
            assert_eq!(p.node_name, "node-1");
        }
    }

    #[test]
    fn unknown_or_missing_nodes_are_ztunnels_and_metadata_fills_gaps() {
        assert_eq!(ProxyNode::from_node(None).kind, ProxyKind::Ztunnel);
        let p = ProxyNode::from_node(Some(&node(
            "test-client",
            &[("NAME", "p"), ("NAMESPACE", "ns")],
        )));
        assert_eq!(p.kind, ProxyKind::Ztunnel);
        assert_eq!((p.pod_name.as_str(), p.namespace.as_str()), ("p", "ns"));
    }
}
