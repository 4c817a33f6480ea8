//! What `ambitctl analyze` reports: [`Message`]s with a stable [`Code`], a
//! [`Severity`], the resource and where it was written.

use std::fmt;

use serde::Serialize;

/// How bad a finding is. Ordered: `Info < Warning < Error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Severity {
    Info,
    Warning,
    Error,
}

impl Severity {
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "Info",
            Severity::Warning => "Warning",
            Severity::Error => "Error",
        }
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One kind of finding: Istio's `IST0xxx` code where Istio has the same
/// check, `AMB0xxx` for Ambit's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Code {
    pub id: &'static str,
    pub name: &'static str,
    pub severity: Severity,
    /// What the check finds, for `--list-codes` and the docs.
    pub summary: &'static str,
}

macro_rules! codes {
    ($($konst:ident = $id:literal $name:literal $sev:ident $summary:literal;)*) => {
        $(pub const $konst: Code = Code { id: $id, name: $name, severity: Severity::$sev, summary: $summary };)*
        /// Every code `analyze` can report, in code order.
        pub const ALL: &[Code] = &[$($konst),*];
    };
}

codes! {
    REFERENCED_NOT_FOUND = "IST0101" "ReferencedResourceNotFound" Error
        "a route to an undefined subset or to a host no Service/ServiceEntry defines; a route, policy or label naming a missing Service, Gateway or waypoint";
    SCHEMA = "IST0106" "SchemaValidationError" Error
        "a document the decoder rejects (bad field type, weights not summing to 100, unknown kind or apiVersion, YAML syntax)";
    CONFLICTING_VS_HOSTS = "IST0109" "ConflictingMeshGatewayVirtualServiceHosts" Error
        "two or more VirtualServices for the mesh claim one host; only the first is used";
    NO_MATCHING_WORKLOADS = "IST0127" "NoMatchingWorkloadsFound" Warning
        "an AuthorizationPolicy or PeerAuthentication selector matches no pod or WorkloadEntry in view";
    UNKNOWN_FIELD = "AMB0001" "UnknownField" Warning
        "a field the kind's schema does not have (misspelled or misplaced); the decoders ignore it";
    UNKNOWN_ISTIO_LABEL = "AMB0002" "UnknownIstioLabel" Warning
        "a misspelled istio.io label key or an unknown value of a known one";
    SUBSET_SELECTS_NO_POD = "AMB0003" "SubsetSelectsNoPod" Warning
        "a DestinationRule subset whose labels select none of its Service's pods";
    L7_RULES_ON_TCP_PORT = "AMB0004" "HttpRulesOnTcpPort" Warning
        "HTTP routing for a Service port that is TCP by its name and appProtocol, so no waypoint applies the rules";
    L7_POLICY_NOT_ENFORCED = "AMB0005" "L7PolicyNotEnforced" Warning
        "an AuthorizationPolicy with HTTP rules (or CUSTOM/AUDIT) that no waypoint or sidecar enforces; ztunnel enforces it weakened to L4";
    STRICT_WITH_PLAINTEXT_CLIENTS = "AMB0006" "StrictWithPlaintextClients" Warning
        "STRICT mTLS on workloads that pods outside the mesh can reach: their plaintext connections are refused";
    METRICS_SCRAPE_DENIED = "AMB0007" "MetricsScrapeDenied" Warning
        "a deny-by-default AuthorizationPolicy that refuses the metrics scrape port (15020/15090 or prometheus.io/port)";
    TRANSLATION_FINDING = "AMB0008" "TranslationFinding" Warning
        "a mistake the control plane's translation reports (served as described)";
    DUPLICATE_OBJECT = "AMB0009" "DuplicateObject" Error
        "one object defined twice; the control plane serves the first definition only";
}

/// Where a resource was written.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Origin {
    pub file: String,
    /// 1-based line.
    pub line: usize,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)
    }
}

/// The resource a message is about.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Resource {
    pub kind: String,
    /// Empty for cluster-scoped kinds.
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for Resource {
    /// `Kind namespace/name`, `Kind name` when cluster-scoped.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = if self.kind.is_empty() {
            "?"
        } else {
            &self.kind
        };
        match (self.namespace.is_empty(), self.name.is_empty()) {
            (_, true) => write!(f, "{kind} (unnamed)"),
            (true, false) => write!(f, "{kind} {}", self.name),
            (false, false) => write!(f, "{kind} {}/{}", self.namespace, self.name),
        }
    }
}

/// One finding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Message {
    pub code: &'static str,
    /// The code's name (`ReferencedResourceNotFound`).
    pub name: &'static str,
    pub severity: Severity,
    pub resource: Resource,
    /// File and line, when the resource came from a file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub origin: Option<Origin>,
    /// What is wrong and what to do.
    pub message: String,
}

impl Message {
    pub fn new(code: Code, resource: Resource, origin: Option<Origin>, message: String) -> Self {
        Self {
            code: code.id,
            name: code.name,
            severity: code.severity,
            resource,
            origin,
            message,
        }
    }
}

impl fmt::Display for Message {
    /// `Error [IST0101] (VirtualService ns/name file.yaml:12) message`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}] ({}", self.severity, self.code, self.resource)?;
        if let Some(o) = &self.origin {
            write!(f, " {o}")?;
        }
        write!(f, ") {}", self.message)
    }
}
