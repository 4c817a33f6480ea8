//! Prometheus metrics of one ztunnel. Every [`Metrics`] has its own
//! registry, so many ztunnels can run in one process (tests, benchmarks).
//!
//! Names follow Istio's ztunnel where one exists, so dashboards keep working.
//! Counters get their `_total` suffix from the encoder.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The text encoder failed (only on a broken metric implementation).
    #[error(
        "could not encode the metrics registry as Prometheus text: {0}; this is a ztunnel bug, please report it"
    )]
    Encode(#[from] std::fmt::Error),
}

/// Label set `{url="<xDS type url>"}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UrlLabel {
    /// xDS type URL.
    pub url: String,
}

impl UrlLabel {
    /// The label for `type_url`.
    pub fn new(type_url: &str) -> Self {
        Self {
            url: type_url.to_string(),
        }
    }
}

/// Label set `{reason="..."}` of connection terminations.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// One of [`TerminationReason::as_str`].
    pub reason: String,
}

/// Why an xDS connection ended (Istio's label values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TerminationReason {
    /// The connection or the stream could not be established.
    ConnectionError,
    /// The established stream failed with a gRPC error.
    Error,
    /// The server closed the stream without an error.
    Complete,
}

impl TerminationReason {
    /// The `reason` label value.
    pub fn as_str(self) -> &'static str {
        match self {
            TerminationReason::ConnectionError => "ConnectionError",
            TerminationReason::Error => "Error",
            TerminationReason::Complete => "Complete",
        }
    }
}

/// Metrics of the xDS client.
#[derive(Debug, Default)]
pub struct XdsMetrics {
    /// `istio_xds_connection_terminations_total{reason}`.
    pub connection_terminations: Family<ReasonLabel, Counter>,
    /// `ztunnel_xds_connected`: 1 while a stream is established.
    pub connected: Gauge,
    /// `istio_xds_message_total{url}`: responses received per type.
    pub messages: Family<UrlLabel, Counter>,
    /// `istio_xds_message_bytes_total{url}`: encoded bytes of those responses.
    pub message_bytes: Family<UrlLabel, Counter>,
    /// `ztunnel_xds_nacks_sent_total{url}`.
    pub nacks_sent: Family<UrlLabel, Counter>,
    /// `ztunnel_xds_resources{url}`: resources currently held per type.
    pub resources: Family<UrlLabel, Gauge>,
}

impl XdsMetrics {
    /// Counts one terminated connection.
    pub fn record_termination(&self, reason: TerminationReason) {
        self.connection_terminations
            .get_or_create(&ReasonLabel {
                reason: reason.as_str().to_string(),
            })
            .inc();
    }

    /// Terminations counted so far for `reason`.
    pub fn terminations(&self, reason: TerminationReason) -> u64 {
        self.connection_terminations
            .get_or_create(&ReasonLabel {
                reason: reason.as_str().to_string(),
            })
            .get()
    }

    /// Responses received so far for `type_url`.
    pub fn messages_received(&self, type_url: &str) -> u64 {
        self.messages.get_or_create(&UrlLabel::new(type_url)).get()
    }

    /// NACKs sent so far for `type_url`.
    pub fn nacks(&self, type_url: &str) -> u64 {
        self.nacks_sent
            .get_or_create(&UrlLabel::new(type_url))
            .get()
    }

    /// Resources currently held for `type_url`.
    pub fn resources_held(&self, type_url: &str) -> i64 {
        self.resources.get_or_create(&UrlLabel::new(type_url)).get()
    }
}

/// All metrics of one ztunnel and the registry that renders them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// xDS client metrics.
    pub xds: XdsMetrics,
    /// Istio TCP connection metrics of the proxies.
    pub tcp: crate::proxy::metrics::TcpMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A fresh registry with every ztunnel metric registered at zero.
    pub fn new() -> Self {
        let xds = XdsMetrics::default();
        // Show every per-type series at 0 from the start, so dashboards and
        // alerts see the series before the first response.
        for url in [
            ambit_proto::ADDRESS_TYPE_URL,
            ambit_proto::AUTHORIZATION_TYPE_URL,
        ] {
            let label = UrlLabel::new(url);
            let _ = xds.messages.get_or_create(&label);
            let _ = xds.message_bytes.get_or_create(&label);
            let _ = xds.nacks_sent.get_or_create(&label);
            let _ = xds.resources.get_or_create(&label);
        }
        for reason in [
            TerminationReason::ConnectionError,
            TerminationReason::Error,
            TerminationReason::Complete,
        ] {
            let _ = xds.connection_terminations.get_or_create(&ReasonLabel {
                reason: reason.as_str().to_string(),
            });
        }
        let mut registry = Registry::default();
        registry.register(
            "istio_xds_connection_terminations",
            "xDS connections to the control plane that ended, by reason",
            xds.connection_terminations.clone(),
        );
        registry.register(
            "ztunnel_xds_connected",
            "1 while the xDS stream to the control plane is established, else 0",
            xds.connected.clone(),
        );
        registry.register(
            "istio_xds_message",
            "xDS responses received, by type url",
            xds.messages.clone(),
        );
        registry.register(
            "istio_xds_message_bytes",
            "Encoded bytes of the xDS responses received, by type url",
            xds.message_bytes.clone(),
        );
        registry.register(
            "ztunnel_xds_nacks_sent",
            "xDS responses rejected (NACKed), by type url",
            xds.nacks_sent.clone(),
        );
        registry.register(
            "ztunnel_xds_resources",
            "xDS resources currently held, by type url",
            xds.resources.clone(),
        );
        let tcp = crate::proxy::metrics::TcpMetrics::default();
        tcp.register(&mut registry);
        Self { registry, xds, tcp }
    }

    /// The registry, to register other components' metrics (before the
    /// metrics are shared).
    pub fn registry_mut(&mut self) -> &mut Registry {
        &mut self.registry
    }

    /// The registry as Prometheus text exposition format.
    pub fn encode(&self) -> Result<String, MetricsError> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn names_and_labels_render() {
        let m = Metrics::new();
        m.xds.record_termination(TerminationReason::Complete);
        m.xds.connected.set(1);
        m.xds
            .messages
            .get_or_create(&UrlLabel::new(ambit_proto::ADDRESS_TYPE_URL))
            .inc();
        m.xds
            .nacks_sent
            .get_or_create(&UrlLabel::new(ambit_proto::ADDRESS_TYPE_URL))
            .inc();
        m.xds
            .resources
            .get_or_create(&UrlLabel::new(ambit_proto::ADDRESS_TYPE_URL))
            .set(3);
        let text = m.encode().unwrap();
        for want in [
            "istio_xds_connection_terminations_total{reason=\"Complete\"} 1",
            "ztunnel_xds_connected 1",
            "istio_xds_message_total{url=\"type.googleapis.com/istio.workload.Address\"} 1",
            "ztunnel_xds_nacks_sent_total{url=\"type.googleapis.com/istio.workload.Address\"} 1",
            "ztunnel_xds_resources{url=\"type.googleapis.com/istio.workload.Address\"} 3",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    #[test]
    fn registries_are_independent() {
        let a = Metrics::new();
        let b = Metrics::new();
        a.xds.connected.set(1);
        assert_eq!(b.xds.connected.get(), 0);
    }
}
