//! One Delta response in, state changes and the ACK/NACK out.
//!
//! Valid resources of a response are applied even when others are
//! rejected; the NACK names every rejected resource and why, so the
//! operator can find it in the control plane.

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
};
use envoy_types::pb::google::rpc::Status;
use prost::Message;

use super::XdsError;
use crate::state::{self, ResourceType, StateSnapshot};

/// `google.rpc.Code.INVALID_ARGUMENT`.
const INVALID_ARGUMENT: i32 = 3;
/// `google.rpc.Code.NOT_FOUND`.
const NOT_FOUND: i32 = 5;
/// At most this many rejections are spelled out in one NACK.
const MAX_REPORTED_ERRORS: usize = 10;

/// What handling one response produced.
#[derive(Debug)]
pub struct Handled {
    /// The response's type, if it is one we hold.
    pub ty: Option<ResourceType>,
    /// The ACK (no `error_detail`) or NACK to send back.
    pub reply: DeltaDiscoveryRequest,
    /// Every rejected resource, for logging.
    pub errors: Vec<XdsError>,
}

impl Handled {
    /// True if the reply is a NACK.
    pub fn is_nack(&self) -> bool {
        self.reply.error_detail.is_some()
    }
}

enum Decoded {
    Address(state::Address),
    Authorization(state::Authorization),
}

fn decode(ty: ResourceType, name: &str, resource: &Resource) -> Result<Option<Decoded>, XdsError> {
    let type_url = ty.type_url();
    // In Delta xDS a resource without a body means "does not exist".
    let Some(body) = &resource.resource else {
        return Ok(None);
    };
    if !body.type_url.is_empty() && body.type_url != type_url {
        return Err(XdsError::WrongBodyType {
            type_url: type_url.to_string(),
            name: name.to_string(),
            got: body.type_url.clone(),
        });
    }
    let invalid = |source| XdsError::InvalidResource {
        type_url: type_url.to_string(),
        name: name.to_string(),
        source,
    };
    let decode_err = |expected, source| XdsError::Decode {
        type_url: type_url.to_string(),
        name: name.to_string(),
        expected,
        source,
    };
    match ty {
        ResourceType::Address => {
            let msg = ambit_proto::workload::Address::decode(body.value.as_slice())
                .map_err(|e| decode_err("istio.workload.Address", e))?;
            let addr = state::Address::try_from(&msg).map_err(invalid)?;
            Ok(Some(Decoded::Address(addr)))
        }
        ResourceType::Authorization => {
            let msg = ambit_proto::security::Authorization::decode(body.value.as_slice())
                .map_err(|e| decode_err("istio.security.Authorization", e))?;
            let auth = state::Authorization::try_from(&msg).map_err(invalid)?;
            Ok(Some(Decoded::Authorization(auth)))
        }
    }
}

fn resource_name(r: &Resource) -> &str {
    if r.name.is_empty() {
        r.resource_name.as_ref().map_or("", |n| n.name.as_str())
    } else {
        &r.name
    }
}

/// Applies `resp` to `state` and builds the reply: the xDS client's whole
/// decode-and-validate path for one Delta response, pure (no I/O), so it
/// can be driven with untrusted bytes (the `ztunnel_xds` fuzz target).
/// Never panics on any response: a resource that does not decode or
/// validate is left out and named in the NACK.
pub fn handle_response(state: &mut StateSnapshot, resp: &DeltaDiscoveryResponse) -> Handled {
    let Some(ty) = ResourceType::from_type_url(&resp.type_url) else {
        let errors = vec![XdsError::UnknownType {
            type_url: resp.type_url.clone(),
        }];
        return Handled {
            ty: None,
            reply: reply(resp, &errors),
            errors,
        };
    };

    let mut errors = Vec::new();
    for r in &resp.resources {
        let name = resource_name(r);
        match decode(ty, name, r) {
            Ok(Some(Decoded::Address(a))) => state.apply_address(name, &r.version, a),
            Ok(Some(Decoded::Authorization(a))) => state.apply_authorization(name, &r.version, a),
            Ok(None) => {
                state.remove_resource(ty, name);
            }
            Err(e) => errors.push(e),
        }
    }
    for name in &resp.removed_resources {
        state.remove_resource(ty, name);
    }
    for rn in &resp.removed_resource_names {
        state.remove_resource(ty, &rn.name);
    }
    for re in &resp.resource_errors {
        let not_found = re
            .error_detail
            .as_ref()
            .is_some_and(|s| s.code == NOT_FOUND);
        if let (true, Some(rn)) = (not_found, &re.resource_name) {
            state.remove_resource(ty, &rn.name);
        }
    }
    Handled {
        ty: Some(ty),
        reply: reply(resp, &errors),
        errors,
    }
}

/// The ACK for `resp`, or a NACK naming `errors`.
fn reply(resp: &DeltaDiscoveryResponse, errors: &[XdsError]) -> DeltaDiscoveryRequest {
    let error_detail = (!errors.is_empty()).then(|| {
        let mut message = format!(
            "ztunnel rejected {} of {} resources in response {}: ",
            errors.len(),
            resp.resources.len(),
            resp.nonce
        );
        let shown: Vec<String> = errors
            .iter()
            .take(MAX_REPORTED_ERRORS)
            .map(|e| e.to_string())
            .collect();
        message.push_str(&shown.join("; "));
        if errors.len() > MAX_REPORTED_ERRORS {
            message.push_str(&format!(
                "; and {} more",
                errors.len() - MAX_REPORTED_ERRORS
            ));
        }
        Status {
            code: INVALID_ARGUMENT,
            message,
            details: Vec::new(),
        }
    });
    DeltaDiscoveryRequest {
        type_url: resp.type_url.clone(),
        response_nonce: resp.nonce.clone(),
        error_detail,
        ..Default::default()
    }
}
