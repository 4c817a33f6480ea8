//! What the Kubernetes source watches: one entry per [`Kind`] the model
//! knows, with its API group, plural and the versions the decoder
//! understands. Which of those versions a cluster serves is found by
//! discovery ([`super::discovery`]), never assumed.

use ambit_config::Kind;
use kube::discovery::ApiResource;

/// One watched resource.
#[derive(Debug, Clone)]
pub struct WatchSpec {
    pub kind: Kind,
    /// API group (`""` for the core group).
    pub group: &'static str,
    /// Resource name in URLs and RBAC rules (`virtualservices`).
    pub plural: &'static str,
    /// Versions `ambit-config` decodes, most preferred first; discovery
    /// picks the first one the API server serves.
    pub versions: Vec<&'static str>,
    /// Watched as `PartialObjectMetadata`: the model reads only the
    /// metadata of this kind (labels, annotations), so the API server
    /// sends nothing else.
    pub metadata_only: bool,
    /// Served by a CustomResourceDefinition that may not be installed: when
    /// discovery finds none of its versions served, it is absent (empty,
    /// not waited for) until a later discovery finds it.
    pub optional: bool,
    /// A field selector narrowing the watch (`metadata.name=istio` for
    /// the mesh configuration: of the ConfigMaps, only that one is
    /// modelled).
    pub field_selector: Option<&'static str>,
}

impl WatchSpec {
    /// The spec of `kind`.
    pub fn of(kind: Kind) -> WatchSpec {
        let group = kind.group();
        let versions = kind
            .api_versions()
            .iter()
            .map(|av| av.rsplit_once('/').map_or(*av, |(_, v)| v))
            .collect();
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
            group,
            plural,
            versions,
            metadata_only: matches!(kind, Kind::Namespace),
            optional: group.ends_with(".istio.io") || group == "gateway.networking.k8s.io",
            field_selector: (kind == Kind::MeshConfig).then_some("metadata.name=istio"),
        }
    }

    /// Every kind the model knows, in [`Kind::ALL`] order.
    pub fn all() -> Vec<WatchSpec> {
        Kind::ALL.into_iter().map(WatchSpec::of).collect()
    }

    /// The resource at `version`.
    pub fn at(&self, version: &str) -> ApiResource {
        let api_version = if self.group.is_empty() {
            version.to_string()
        } else {
            format!("{}/{version}", self.group)
        };
        ApiResource {
            group: self.group.to_string(),
            version: version.to_string(),
            api_version,
            kind: self.kind.as_str().to_string(),
            plural: self.plural.to_string(),
        }
    }

    /// The resource at the most preferred version (what a cluster that
    /// serves every version would be watched at).
    pub fn preferred(&self) -> ApiResource {
        self.at(self.versions.first().copied().unwrap_or("v1"))
    }

    /// `plural.group` (`pods`, `virtualservices.networking.istio.io`), as
    /// RBAC rules and CRDs name it.
    pub fn qualified_plural(&self) -> String {
        if self.group.is_empty() {
            self.plural.to_string()
        } else {
            format!("{}.{}", self.plural, self.group)
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
        assert_eq!(pods.preferred().api_version, "v1");
        assert!(!pods.optional && !pods.metadata_only);
        let vs = WatchSpec::of(Kind::VirtualService);
        assert_eq!(vs.preferred().api_version, "networking.istio.io/v1");
        assert_eq!(vs.versions, ["v1", "v1beta1", "v1alpha3"]);
        assert_eq!(vs.qualified_plural(), "virtualservices.networking.istio.io");
        assert!(vs.optional);
        let tcp = WatchSpec::of(Kind::TcpRoute);
        assert_eq!(tcp.versions, ["v1", "v1alpha2"]);
        assert_eq!(
            tcp.at("v1alpha2").api_version,
            "gateway.networking.k8s.io/v1alpha2"
        );
        assert!(WatchSpec::of(Kind::Namespace).metadata_only);
        assert!(!WatchSpec::of(Kind::EndpointSlice).optional);
        assert_eq!(WatchSpec::of(Kind::EndpointSlice).group, "discovery.k8s.io");
    }
}
