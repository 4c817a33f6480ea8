//! The Delta response as it goes on the wire, encoded straight from the
//! snapshot's resources.
//!
//! The generated `DeltaDiscoveryResponse` owns its resources: sending one
//! means copying every resource's name, version, type URL and bytes into
//! fresh allocations, only to encode and free them a moment later. For a
//! full sync of 11,000 workloads to 100 proxies that is millions of
//! short-lived allocations, and the allocator keeps the memory they churned
//! through. [`DeltaChunk`] holds `Arc`s of the snapshot's resources instead
//! and writes the same bytes (`envoy.service.discovery.v3.DeltaDiscoveryResponse`,
//! the same field numbers) directly into tonic's encode buffer. It is only
//! ever encoded; decoding it is not supported.
//!
//! [`DeltaCodec`] reserves each response's exact size before writing it.
//! tonic keeps a stream's encode buffer for the life of the stream; growing
//! it by doubling while writing would leave up to twice the largest
//! response's size pinned per stream.

use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use prost::Message;
use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, encode_key, encode_varint, encoded_len_varint, key_len, skip_field,
};
use tonic::Status;
use tonic::codec::{Codec, EncodeBuf, Encoder};
use tonic_prost::ProstDecoder;

use crate::model::snapshot::XdsResource;

/// One `DeltaDiscoveryResponse`.
#[derive(Debug, Default)]
pub(super) struct DeltaChunk {
    pub system_version_info: String,
    pub resources: Vec<OutgoingResource>,
    pub type_url: &'static str,
    pub removed_resources: Vec<String>,
    pub nonce: String,
}

/// One `Resource` of a response: the snapshot's resource plus the aliases
/// this client subscribed it by.
#[derive(Debug)]
pub(super) struct OutgoingResource {
    pub resource: Arc<XdsResource>,
    pub aliases: Vec<String>,
}

// Field numbers of envoy.service.discovery.v3.Resource and google.protobuf.Any.
const RESOURCE_VERSION: u32 = 1;
const RESOURCE_BODY: u32 = 2;
const RESOURCE_NAME: u32 = 3;
const RESOURCE_ALIASES: u32 = 4;
const ANY_TYPE_URL: u32 = 1;
const ANY_VALUE: u32 = 2;

// Field numbers of envoy.service.discovery.v3.DeltaDiscoveryResponse.
const RESPONSE_VERSION: u32 = 1;
const RESPONSE_RESOURCES: u32 = 2;
const RESPONSE_TYPE_URL: u32 = 4;
const RESPONSE_NONCE: u32 = 5;
const RESPONSE_REMOVED: u32 = 6;

/// Encoded length of a length-delimited field holding `len` bytes.
fn delimited_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

/// Encoded length of a string or bytes field (proto3 omits empty ones).
fn bytes_field_len(tag: u32, bytes: &[u8]) -> usize {
    if bytes.is_empty() {
        0
    } else {
        delimited_len(tag, bytes.len())
    }
}

fn put_bytes_field(tag: u32, bytes: &[u8], buf: &mut impl BufMut) {
    if !bytes.is_empty() {
        put_delimiter(tag, bytes.len(), buf);
        buf.put_slice(bytes);
    }
}

fn put_delimiter(tag: u32, len: usize, buf: &mut impl BufMut) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(len as u64, buf);
}

impl OutgoingResource {
    fn any_len(&self) -> usize {
        let body = &self.resource.body;
        bytes_field_len(ANY_TYPE_URL, body.type_url.as_bytes())
            + bytes_field_len(ANY_VALUE, &body.value)
    }

    fn encoded_len(&self) -> usize {
        let r = &self.resource;
        bytes_field_len(RESOURCE_VERSION, r.version.as_bytes())
            + delimited_len(RESOURCE_BODY, self.any_len())
            + bytes_field_len(RESOURCE_NAME, r.name.as_bytes())
            + self
                .aliases
                .iter()
                .map(|a| delimited_len(RESOURCE_ALIASES, a.len()))
                .sum::<usize>()
    }

    fn encode(&self, buf: &mut impl BufMut) {
        let r = &self.resource;
        put_bytes_field(RESOURCE_VERSION, r.version.as_bytes(), buf);
        put_delimiter(RESOURCE_BODY, self.any_len(), buf);
        put_bytes_field(ANY_TYPE_URL, r.body.type_url.as_bytes(), buf);
        put_bytes_field(ANY_VALUE, &r.body.value, buf);
        put_bytes_field(RESOURCE_NAME, r.name.as_bytes(), buf);
        for alias in &self.aliases {
            put_delimiter(RESOURCE_ALIASES, alias.len(), buf);
            buf.put_slice(alias.as_bytes());
        }
    }
}

impl Message for DeltaChunk {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        put_bytes_field(RESPONSE_VERSION, self.system_version_info.as_bytes(), buf);
        for r in &self.resources {
            put_delimiter(RESPONSE_RESOURCES, r.encoded_len(), buf);
            r.encode(buf);
        }
        put_bytes_field(RESPONSE_TYPE_URL, self.type_url.as_bytes(), buf);
        put_bytes_field(RESPONSE_NONCE, self.nonce.as_bytes(), buf);
        for name in &self.removed_resources {
            put_delimiter(RESPONSE_REMOVED, name.len(), buf);
            buf.put_slice(name.as_bytes());
        }
    }

    /// Never decoded: every field is skipped.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        bytes_field_len(RESPONSE_VERSION, self.system_version_info.as_bytes())
            + self
                .resources
                .iter()
                .map(|r| delimited_len(RESPONSE_RESOURCES, r.encoded_len()))
                .sum::<usize>()
            + bytes_field_len(RESPONSE_TYPE_URL, self.type_url.as_bytes())
            + bytes_field_len(RESPONSE_NONCE, self.nonce.as_bytes())
            + self
                .removed_resources
                .iter()
                .map(|n| delimited_len(RESPONSE_REMOVED, n.len()))
                .sum::<usize>()
    }

    fn clear(&mut self) {
        *self = DeltaChunk::default();
    }
}

/// Delta ADS: requests decoded as the generated type, responses written
/// from [`DeltaChunk`]s into an exactly sized buffer.
#[derive(Debug, Default)]
pub(super) struct DeltaCodec;

/// The encoding half of [`DeltaCodec`].
#[derive(Debug, Default)]
pub(super) struct DeltaEncoder;

impl Codec for DeltaCodec {
    type Encode = DeltaChunk;
    type Decode = DeltaDiscoveryRequest;
    type Encoder = DeltaEncoder;
    type Decoder = ProstDecoder<DeltaDiscoveryRequest>;

    fn encoder(&mut self) -> DeltaEncoder {
        DeltaEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::default()
    }
}

impl Encoder for DeltaEncoder {
    type Item = DeltaChunk;
    type Error = Status;

    fn encode(&mut self, item: DeltaChunk, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.reserve(item.encoded_len());
        item.encode_raw(buf);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryResponse, Resource};
    use envoy_types::pb::google::protobuf::Any;

    use super::*;

    fn resource(name: &str, value: &[u8]) -> Arc<XdsResource> {
        Arc::new(XdsResource {
            name: name.to_string(),
            aliases: vec![format!("net/{name}")],
            version: format!("v-{name}"),
            body: Any {
                type_url: "type.googleapis.com/istio.workload.Address".to_string(),
                value: value.to_vec(),
            },
        })
    }

    /// What the generated message would put on the wire for the same content.
    fn generated(chunk: &DeltaChunk) -> DeltaDiscoveryResponse {
        DeltaDiscoveryResponse {
            system_version_info: chunk.system_version_info.clone(),
            resources: chunk
                .resources
                .iter()
                .map(|o| Resource {
                    name: o.resource.name.clone(),
                    aliases: o.aliases.clone(),
                    version: o.resource.version.clone(),
                    resource: Some(o.resource.body.clone()),
                    ..Default::default()
                })
                .collect(),
            type_url: chunk.type_url.to_string(),
            removed_resources: chunk.removed_resources.clone(),
            nonce: chunk.nonce.clone(),
            ..Default::default()
        }
    }

    #[test]
    fn encodes_what_the_generated_message_decodes_to_the_same_response() {
        // A 300-byte value makes the lengths take two-byte varints.
        let chunk = DeltaChunk {
            system_version_info: "7".to_string(),
            resources: vec![
                OutgoingResource {
                    resource: resource("a", &[1, 2, 3]),
                    aliases: Vec::new(),
                },
                OutgoingResource {
                    resource: resource("b", &[9; 300]),
                    aliases: vec!["net/b".to_string()],
                },
                OutgoingResource {
                    resource: resource("c", &[]),
                    aliases: Vec::new(),
                },
            ],
            type_url: "type.googleapis.com/istio.workload.Address",
            removed_resources: vec!["gone".to_string(), "also-gone".to_string()],
            nonce: "3-9".to_string(),
        };
        let ours = chunk.encode_to_vec();
        assert_eq!(ours.len(), chunk.encoded_len());
        let expected = generated(&chunk);
        assert_eq!(ours.len(), expected.encoded_len());
        let decoded = DeltaDiscoveryResponse::decode(ours.as_slice()).expect("decodes");
        assert_eq!(decoded, expected);
    }

    #[test]
    fn an_empty_response_is_empty_on_the_wire() {
        let chunk = DeltaChunk::default();
        assert!(chunk.encode_to_vec().is_empty());
        assert_eq!(chunk.encoded_len(), 0);
    }
}
