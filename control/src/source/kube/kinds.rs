//! What the Kubernetes source watches: one entry per [`Kind`] the model
//! knows, with the API resource it is served as.

use ambit_config::Kind;
use kube::discovery::ApiResource;

/// One watched resource.
#[derive(Debug, Clone)]
pub struct WatchSpec {
    pub kind: Kind,
    /// Group, version, kind and plural as the API server serves them.
    pub resource: ApiResource,
    /// Watched as `PartialObjectMetadata`: the model reads only the
    /// metadata of this kind (labels, annotations), so the API server
    /// sends nothing else.
    pub metadata_only: bool,
    /// Served by a CustomResourceDefinition that may not be installed: a
    /// `404` on its list counts as "synced, empty" for readiness (warned
    /// once) and the watch keeps retrying until the CRD appears.
    pub optional: bool,
    /// A field selector narrowing the watch (`metadata.name=istio` for
    /// the mesh configuration: of the ConfigMaps, only that one is
    /// modelled).
    pub field_selector: Option<&'static str>,
}

fn resource(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    let api_version = if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    };
    ApiResource {
        group: group.to_string(),
        version: version.to_string(),
        api_version,
        kind: kind.to_string(),
        plural: plural.to_string(),
    }
}

impl WatchSpec {
    /// The spec of `kind`: the version watched is the newest one
    /// `ambit-config` accepts for it (`Kind::api_versions()[0]`).
    pub fn of(kind: Kind) -> WatchSpec {
        let (group, version) = kind.api_versions()[0]
            .rsplit_once('/')
            .unwrap_or(("", kind.api_versions()[0]));
        let plural = match kind {
            Kind::Namespace => "namespaces",
            Kind::Pod => "pods",
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
            Kind::ServiceEntry => "serviceentries",
            Kind::WorkloadEntry => "workloadentries",
            Kind::PeerAuthentication => "peerauthentications",
            Kind::AuthorizationPolicy => "authorizationpolicies",
            Kind::VirtualService => "virtualservices",
            Kind::DestinationRule => "destinationrules",
            Kind::Sidecar => "sidecars",
            Kind::Gateway => "gateways",
            Kind::HttpRoute => "httproutes",
            Kind::GrpcRoute => "grpcroutes",
            Kind::TcpRoute => "tcproutes",
            Kind::Telemetry => "telemetries",
            Kind::MeshConfig => "configmaps",
        };
        WatchSpec {
            kind,
            resource: resource(group, version, kind.as_str(), plural),
            metadata_only: matches!(kind, Kind::Namespace),
            optional: !group.is_empty()
                && (group.ends_with(".istio.io") || group == "gateway.networking.k8s.io"),
            field_selector: (kind == Kind::MeshConfig).then_some("metadata.name=istio"),
        }
    }

    /// Every kind the model knows, in [`Kind::ALL`] order.
    pub fn all() -> Vec<WatchSpec> {
        Kind::ALL.into_iter().map(WatchSpec::of).collect()
    }

    /// `plural.group` (`pods`, `virtualservices.networking.istio.io`), as
    /// RBAC rules and CRDs name it.
    pub fn qualified_plural(&self) -> String {
        if self.resource.group.is_empty() {
            self.resource.plural.clone()
        } else {
            format!("{}.{}", self.resource.plural, self.resource.group)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_a_resource() {
        let all = WatchSpec::all();
        assert_eq!(all.len(), Kind::ALL.len());
        let pods = WatchSpec::of(Kind::Pod);
        assert_eq!(pods.resource.api_version, "v1");
        assert!(!pods.optional && !pods.metadata_only);
        let vs = WatchSpec::of(Kind::VirtualService);
        assert_eq!(vs.resource.api_version, "networking.istio.io/v1");
        assert_eq!(vs.qualified_plural(), "virtualservices.networking.istio.io");
        assert!(vs.optional);
        let tcp = WatchSpec::of(Kind::TcpRoute);
        assert_eq!(
            tcp.resource.api_version,
            "gateway.networking.k8s.io/v1alpha2"
        );
        assert!(WatchSpec::of(Kind::Namespace).metadata_only);
        assert!(!WatchSpec::of(Kind::EndpointSlice).optional);
    }
}
