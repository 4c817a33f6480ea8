//! Core `v1` Node (cluster-scoped): its name, labels and addresses, which
//! the Kubernetes mode needs to place ztunnels and waypoints. Re-exported by
//! [`crate::objects`].

use std::net::IpAddr;

use serde::Deserialize;

use crate::objects::{ObjectMeta, nullable};

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Node {
    #[serde(deserialize_with = "nullable")]
    pub metadata: ObjectMeta,
    #[serde(deserialize_with = "nullable")]
    pub status: NodeStatus,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeStatus {
    #[serde(deserialize_with = "nullable")]
    pub addresses: Vec<NodeAddress>,
}

/// One address of a node: `InternalIP`, `ExternalIP`, `Hostname`, ...
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeAddress {
    #[serde(rename = "type", deserialize_with = "nullable")]
    pub type_: String,
    #[serde(deserialize_with = "nullable")]
    pub address: String,
}

impl Node {
    /// The `InternalIP` addresses that parse as IPs, in order.
    pub fn internal_ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.status
            .addresses
            .iter()
            .filter(|a| a.type_ == "InternalIP")
            .filter_map(|a| a.address.parse().ok())
    }
}
