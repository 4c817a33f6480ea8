//! Deterministic encoding of workloads into `istio.workload.Address`
//! resources.

use std::hash::{Hash, Hasher};

use ambit_proto::ADDRESS_TYPE_URL;
use ambit_proto::workload::PortList;
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};

use super::snapshot::XdsResource;
use super::translate::{WorkloadDraft, ip_from_bytes};

/// Encodes a finished workload as an `Address`. The `services` map is
/// encoded in key order, so equal workloads always encode to equal bytes
/// (and versions); prost would follow `HashMap` order.
pub(crate) fn workload_resource(wl: WorkloadDraft<'_>, keys: &[String]) -> XdsResource {
    let w = wl.w;
    let aliases = w
        .addresses
        .iter()
        .filter_map(|a| ip_from_bytes(a))
        .map(|ip| format!("{}/{}", w.network, ip))
        .collect();
    let mut members = wl.services;
    members.sort_by(|a, b| keys[a.0 as usize].cmp(&keys[b.0 as usize]));
    let mut groups: Vec<(&String, PortList)> = Vec::new();
    for (k, port) in members {
        let key = &keys[k as usize];
        match groups.last_mut() {
            Some((last, pl)) if *last == key => pl.ports.push(port),
            _ => groups.push((key, PortList { ports: vec![port] })),
        }
    }
    let entry_len = |k: &String, pl: &PortList| {
        prost::encoding::string::encoded_len(1, k) + prost::encoding::message::encoded_len(2, pl)
    };
    let entries: usize = groups
        .iter()
        .map(|(k, pl)| {
            let l = entry_len(k, pl);
            key_len(SERVICES_TAG) + encoded_len_varint(l as u64) + l
        })
        .sum();
    debug_assert!(w.services.is_empty());
    let inner = w.encoded_len() + entries;
    let mut value = Vec::with_capacity(inner + 1 + encoded_len_varint(inner as u64));
    encode_key(1, WireType::LengthDelimited, &mut value);
    encode_varint(inner as u64, &mut value);
    if let Err(e) = w.encode(&mut value) {
        // A Vec grows as needed, so this cannot happen.
        tracing::error!(uid = %w.uid, error = %e, "encoding a workload failed");
    }
    for (k, pl) in &groups {
        encode_key(SERVICES_TAG, WireType::LengthDelimited, &mut value);
        encode_varint(entry_len(k, pl) as u64, &mut value);
        prost::encoding::string::encode(1, k, &mut value);
        prost::encoding::message::encode(2, pl, &mut value);
    }
    encoded_resource(ADDRESS_TYPE_URL, w.uid, aliases, value)
}

/// Field number of `Workload.services`.
const SERVICES_TAG: u32 = 22;

/// An [`XdsResource`] from already encoded bytes, versioned exactly as
/// [`XdsResource::new`] does.
pub(crate) fn encoded_resource(
    type_url: &str,
    name: String,
    aliases: Vec<String>,
    value: Vec<u8>,
) -> XdsResource {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut h);
    let mut r = XdsResource::new(type_url, name, aliases, &());
    r.version = format!("{:016x}", h.finish());
    r.body.value = value;
    r
}
