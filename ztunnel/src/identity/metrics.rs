//! Metrics of the certificate manager. The manager records CA calls here;
//! the expiry gauge reads the manager's [`CertificateView`] at scrape time.
//!
//! * `ztunnel_certificate_expiry_seconds{identity}`: seconds until each
//!   managed certificate expires, computed at scrape time (a collector, so
//!   forgotten identities disappear and the value never goes stale).
//! * `ztunnel_ca_requests_total{result="ok"|"error"}`.
//! * `ztunnel_ca_request_duration_seconds` histogram.

use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::view::CertificateView;

/// Label set `{result="ok"|"error"}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `ok` or `error`.
    pub result: &'static str,
}

/// Label set `{identity="spiffe://..."}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IdentityLabel {
    /// The SPIFFE id.
    pub identity: String,
}

/// CA request metrics. Register with [`IdentityMetrics::register`] (the
/// certificate manager's `register_metrics` does that and adds the expiry
/// collector).
#[derive(Debug, Clone)]
pub struct IdentityMetrics {
    /// `ztunnel_ca_requests_total{result}`.
    pub ca_requests: Family<ResultLabel, Counter>,
    /// `ztunnel_ca_request_duration_seconds`.
    pub ca_request_duration: Histogram,
}

impl Default for IdentityMetrics {
    fn default() -> Self {
        let ca_requests = Family::default();
        for result in ["ok", "error"] {
            let _ = ca_requests.get_or_create(&ResultLabel { result });
        }
        Self {
            ca_requests,
            // 5 ms .. ~20 s
            ca_request_duration: Histogram::new(exponential_buckets(0.005, 2.0, 13)),
        }
    }
}

impl IdentityMetrics {
    /// Records one CA call.
    pub fn record(&self, ok: bool, elapsed: Duration) {
        let result = if ok { "ok" } else { "error" };
        self.ca_requests
            .get_or_create(&ResultLabel { result })
            .inc();
        self.ca_request_duration.observe(elapsed.as_secs_f64());
    }

    /// CA calls so far with `result` (`ok` or `error`).
    pub fn requests(&self, result: &'static str) -> u64 {
        self.ca_requests
            .get_or_create(&ResultLabel { result })
            .get()
    }

    /// Registers the counter and the histogram.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "ztunnel_ca_requests",
            "Certificate signing requests sent to the CA, by result",
            self.ca_requests.clone(),
        );
        registry.register(
            "ztunnel_ca_request_duration_seconds",
            "Duration of certificate signing requests to the CA",
            self.ca_request_duration.clone(),
        );
    }
}

/// Renders `ztunnel_certificate_expiry_seconds{identity}` at scrape time.
#[derive(Debug)]
pub(crate) struct ExpiryCollector {
    pub(crate) view: CertificateView,
}

impl Collector for ExpiryCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let family = Family::<IdentityLabel, Gauge<f64, AtomicU64>>::default();
        let now = SystemTime::now();
        for (id, state) in self.view.states() {
            let not_after = state.cert.as_ref().map(|c| c.not_after);
            if let Some(not_after) = not_after {
                let secs = match not_after.duration_since(now) {
                    Ok(d) => d.as_secs_f64(),
                    Err(e) => -e.duration().as_secs_f64(),
                };
                family
                    .get_or_create(&IdentityLabel {
                        identity: id.to_string(),
                    })
                    .set(secs);
            }
        }
        let metric = encoder.encode_descriptor(
            "ztunnel_certificate_expiry_seconds",
            "Seconds until the workload certificate expires, by SPIFFE identity",
            None,
            family.metric_type(),
        )?;
        family.encode(metric)
    }
}
