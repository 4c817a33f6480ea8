//! The SDS server Envoy reads its certificate and trust bundle from: gRPC
//! `envoy.service.secret.v3.SecretDiscoveryService` on a unix socket
//! (mode 0600) in the state directory.
//!
//! * `StreamSecrets` (state of the world, what Envoy's `api_type: GRPC`
//!   uses): each response carries every requested secret that exists, with
//!   a version hashed from their contents; a response is sent when the
//!   request's names change or a requested secret's bytes change.
//! * `DeltaSecrets`: per-resource versions; only changed secrets are sent.
//! * `FetchSecrets`: one-shot.
//!
//! Each stream is one task watching the published [`SecretSet`] (latest
//! wins). ACKs are logged at DEBUG, NACKs at WARN and counted; the first
//! ACK of `default` tells readiness that Envoy holds the certificate.
//! A secret that does not exist yet is not answered (Envoy treats an empty
//! SDS response as an error); it is sent as soon as it exists.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use envoy_types::pb::envoy::service::secret::v3::secret_discovery_service_server::{
    SecretDiscoveryService, SecretDiscoveryServiceServer,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::UnixListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, info, warn};

use super::secrets::{DEFAULT_SECRET, SECRET_TYPE_URL, SecretSet, content_hash};

/// Errors of the SDS socket.
#[derive(Debug, thiserror::Error)]
pub enum SdsError {
    /// Something that is not a socket sits where the socket goes.
    #[error(
        "{path} exists and is not a unix socket; remove it or choose another --state-dir / STATE_DIR"
    )]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// Another process serves the socket.
    #[error(
        "another process (a second ambit-agent?) is serving {path}; stop it or give each agent its own --state-dir / STATE_DIR"
    )]
    InUse {
        /// The path.
        path: PathBuf,
    },
    /// The socket could not be created or secured.
    #[error(
        "could not create the SDS socket {path}: {source}; check that --state-dir / STATE_DIR is writable"
    )]
    Bind {
        /// The path.
        path: PathBuf,
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}

/// Most resource names one stream may ask for (Envoy asks for two).
const MAX_NAMES: usize = 64;
/// Longest resource name accepted.
const MAX_NAME_LEN: usize = 256;
/// Largest request accepted.
const MAX_REQUEST_BYTES: usize = 64 << 10;
/// Responses queued per stream before it waits for Envoy to read.
const QUEUE: usize = 4;

/// SDS metrics.
#[derive(Debug, Clone, Default)]
pub struct SdsMetrics {
    /// `ambit_agent_sds_pushes_total`: responses sent.
    pub pushes: Counter,
    /// `ambit_agent_sds_nacks_total`: responses Envoy rejected.
    pub nacks: Counter,
    /// `ambit_agent_sds_streams`: open SDS streams.
    pub streams: Gauge,
}

impl SdsMetrics {
    /// Registers the metrics.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "ambit_agent_sds_pushes",
            "SDS responses sent to Envoy",
            self.pushes.clone(),
        );
        registry.register(
            "ambit_agent_sds_nacks",
            "SDS responses Envoy rejected (NACK)",
            self.nacks.clone(),
        );
        registry.register(
            "ambit_agent_sds_streams",
            "Open SDS streams from Envoy",
            self.streams.clone(),
        );
    }
}

/// The SDS service. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SdsServer {
    secrets: watch::Receiver<Arc<SecretSet>>,
    /// The version of `default` Envoy last ACKed.
    acked: Arc<watch::Sender<Option<String>>>,
    metrics: SdsMetrics,
}

impl SdsServer {
    /// A server of `secrets`.
    pub fn new(secrets: watch::Receiver<Arc<SecretSet>>, metrics: SdsMetrics) -> Self {
        Self {
            secrets,
            acked: Arc::new(watch::channel(None).0),
            metrics,
        }
    }

    /// The version of `default` Envoy last ACKed (`None` before the first).
    pub fn acked_default(&self) -> watch::Receiver<Option<String>> {
        self.acked.subscribe()
    }

    /// Serves on `listener` until `shutdown` resolves.
    pub async fn serve(self, listener: UnixListener, shutdown: impl Future<Output = ()>) {
        let service =
            SecretDiscoveryServiceServer::new(self).max_decoding_message_size(MAX_REQUEST_BYTES);
        let result = tonic::transport::Server::builder()
            .max_concurrent_streams(Some(64))
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(Duration::from_secs(10)))
            .add_service(service)
            .serve_with_incoming_shutdown(UnixListenerStream::new(listener), shutdown)
            .await;
        if let Err(e) = result {
            warn!(error = %e, "SDS server stopped");
        }
    }

    fn note_ack(&self, default_version: Option<&String>) {
        if let Some(v) = default_version {
            self.acked.send_if_modified(|acked| {
                if acked.as_ref() == Some(v) {
                    return false;
                }
                info!(version = %v, "Envoy accepted the certificate (secret default)");
                *acked = Some(v.clone());
                true
            });
        }
    }
}

/// Removes a stale socket at `path` (refusing one another process still
/// serves), binds a new one and makes it 0600.
pub async fn bind(path: &Path) -> Result<UnixListener, SdsError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let bind_err = |source| SdsError::Bind {
        path: path.to_path_buf(),
        source,
    };
    match tokio::fs::symlink_metadata(path).await {
        Ok(m) if m.file_type().is_socket() => {
            let probe = tokio::time::timeout(
                Duration::from_secs(1),
                tokio::net::UnixStream::connect(path),
            )
            .await;
            if let Ok(Ok(_)) = probe {
                return Err(SdsError::InUse {
                    path: path.to_path_buf(),
                });
            }
            info!(path = %path.display(), "removing the stale SDS socket of an earlier run");
            tokio::fs::remove_file(path).await.map_err(bind_err)?;
        }
        Ok(_) => {
            return Err(SdsError::NotASocket {
                path: path.to_path_buf(),
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(bind_err(e)),
    }
    let listener = UnixListener::bind(path).map_err(bind_err)?;
    tokio::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .await
        .map_err(bind_err)?;
    Ok(listener)
}

/// Checks a request's names against the bounds.
fn check_names<'a>(names: impl IntoIterator<Item = &'a String>) -> Result<(), Status> {
    let mut n = 0;
    for name in names {
        n += 1;
        if name.len() > MAX_NAME_LEN || n > MAX_NAMES {
            return Err(Status::resource_exhausted(format!(
                "at most {MAX_NAMES} secret names of at most {MAX_NAME_LEN} bytes per stream"
            )));
        }
    }
    Ok(())
}

fn check_type(type_url: &str) -> Result<(), Status> {
    if type_url.is_empty() || type_url == SECRET_TYPE_URL {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "this SDS server serves only {SECRET_TYPE_URL}, not {type_url}"
        )))
    }
}

/// A state-of-the-world response for `names`: (version, resources, version
/// of `default` in it). `None` when none of them exists yet.
fn sotw_response(
    set: &SecretSet,
    names: &BTreeSet<String>,
) -> Option<(String, DiscoveryResponse, Option<String>)> {
    let found: Vec<(&String, &super::secrets::SecretEntry)> = names
        .iter()
        .filter_map(|n| set.get(n).map(|e| (n, e)))
        .collect();
    if found.is_empty() {
        return None;
    }
    let joined: String = found
        .iter()
        .map(|(n, e)| format!("{n}={};", e.version))
        .collect();
    let version = content_hash(joined.as_bytes());
    let default_version = found
        .iter()
        .find(|(n, _)| *n == DEFAULT_SECRET)
        .map(|(_, e)| e.version.clone());
    let response = DiscoveryResponse {
        version_info: version.clone(),
        resources: found.iter().map(|(_, e)| e.resource.clone()).collect(),
        type_url: SECRET_TYPE_URL.into(),
        ..Default::default()
    };
    Some((version, response, default_version))
}

type Tx<T> = mpsc::Sender<Result<T, Status>>;

impl SdsServer {
    async fn run_sotw(self, mut requests: Streaming<DiscoveryRequest>, tx: Tx<DiscoveryResponse>) {
        let mut secrets = self.secrets.clone();
        let mut names: Option<BTreeSet<String>> = None;
        let mut sent_version: Option<String> = None;
        let mut nonce = 0u64;
        // The last response: (nonce, version of `default` in it).
        let mut last: Option<(String, Option<String>)> = None;
        loop {
            let mut force = false;
            tokio::select! {
                req = requests.message() => {
                    let req = match req {
                        Ok(Some(r)) => r,
                        Ok(None) => return,
                        Err(e) => { debug!(error = %e, "SDS stream ended"); return }
                    };
                    if let Err(s) = check_type(&req.type_url).and_then(|()| check_names(&req.resource_names)) {
                        let _ = tx.send(Err(s)).await;
                        return;
                    }
                    let is_last = last.as_ref().is_some_and(|(n, _)| *n == req.response_nonce);
                    if let Some(err) = &req.error_detail {
                        self.metrics.nacks.inc();
                        warn!(nonce = %req.response_nonce, names = ?req.resource_names, error = %err.message, "Envoy rejected secrets (NACK)");
                    } else if is_last {
                        debug!(version = %req.version_info, "Envoy ACKed secrets");
                        self.note_ack(last.as_ref().and_then(|(_, d)| d.as_ref()));
                    }
                    let wanted: BTreeSet<String> = req.resource_names.into_iter().collect();
                    if names.as_ref() != Some(&wanted) {
                        debug!(names = ?wanted, "Envoy asks for secrets");
                        names = Some(wanted);
                        force = true;
                    }
                }
                changed = secrets.changed() => if changed.is_err() { return },
            }
            let Some(wanted) = &names else { continue };
            let set = secrets.borrow_and_update().clone();
            let Some((version, mut response, default_version)) = sotw_response(&set, wanted) else {
                continue;
            };
            if !force && sent_version.as_ref() == Some(&version) {
                continue;
            }
            nonce += 1;
            response.nonce = nonce.to_string();
            last = Some((response.nonce.clone(), default_version));
            sent_version = Some(version);
            self.metrics.pushes.inc();
            if tx.send(Ok(response)).await.is_err() {
                return;
            }
        }
    }

    async fn run_delta(
        self,
        mut requests: Streaming<DeltaDiscoveryRequest>,
        tx: Tx<DeltaDiscoveryResponse>,
    ) {
        let mut secrets = self.secrets.clone();
        let mut subscribed: BTreeSet<String> = BTreeSet::new();
        let mut wildcard = false;
        // What Envoy holds: name → version.
        let mut held: BTreeMap<String, String> = BTreeMap::new();
        let mut first = true;
        let mut nonce = 0u64;
        let mut last: Option<(String, Option<String>)> = None;
        loop {
            tokio::select! {
                req = requests.message() => {
                    let req = match req {
                        Ok(Some(r)) => r,
                        Ok(None) => return,
                        Err(e) => { debug!(error = %e, "SDS delta stream ended"); return }
                    };
                    let checked = check_type(&req.type_url)
                        .and_then(|()| check_names(req.resource_names_subscribe.iter().chain(subscribed.iter())));
                    if let Err(s) = checked {
                        let _ = tx.send(Err(s)).await;
                        return;
                    }
                    if let Some(err) = &req.error_detail {
                        self.metrics.nacks.inc();
                        warn!(nonce = %req.response_nonce, error = %err.message, "Envoy rejected secrets (delta NACK)");
                    } else if last.as_ref().is_some_and(|(n, _)| *n == req.response_nonce) {
                        debug!(nonce = %req.response_nonce, "Envoy ACKed secrets (delta)");
                        self.note_ack(last.as_ref().and_then(|(_, d)| d.as_ref()));
                    }
                    if first {
                        first = false;
                        held = req.initial_resource_versions.into_iter().collect();
                        wildcard = req.resource_names_subscribe.is_empty();
                    }
                    for n in req.resource_names_subscribe {
                        if n == "*" { wildcard = true } else { subscribed.insert(n); }
                    }
                    for n in req.resource_names_unsubscribe {
                        if n == "*" { wildcard = false }
                        held.remove(&n);
                        subscribed.remove(&n);
                    }
                }
                changed = secrets.changed() => if changed.is_err() { return },
            }
            let set = secrets.borrow_and_update().clone();
            let wanted = |n: &String| wildcard || subscribed.contains(n);
            let mut resources = Vec::new();
            let mut default_version = None;
            for (name, e) in set.by_name.iter().filter(|(n, _)| wanted(n)) {
                if held.get(name) != Some(&e.version) {
                    held.insert(name.clone(), e.version.clone());
                    if name == DEFAULT_SECRET {
                        default_version = Some(e.version.clone());
                    }
                    resources.push(Resource {
                        name: name.clone(),
                        version: e.version.clone(),
                        resource: Some(e.resource.clone()),
                        ..Default::default()
                    });
                }
            }
            let removed: Vec<String> = held
                .keys()
                .filter(|n| !set.by_name.contains_key(*n))
                .cloned()
                .collect();
            for n in &removed {
                held.remove(n);
            }
            if resources.is_empty() && removed.is_empty() {
                continue;
            }
            nonce += 1;
            let response = DeltaDiscoveryResponse {
                resources,
                removed_resources: removed,
                type_url: SECRET_TYPE_URL.into(),
                nonce: nonce.to_string(),
                ..Default::default()
            };
            last = Some((response.nonce.clone(), default_version));
            self.metrics.pushes.inc();
            if tx.send(Ok(response)).await.is_err() {
                return;
            }
        }
    }
}

/// Decrements the stream gauge when a stream task ends.
struct StreamGuard(Gauge);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

fn open_stream(metrics: &SdsMetrics) -> StreamGuard {
    metrics.streams.inc();
    StreamGuard(metrics.streams.clone())
}

#[tonic::async_trait]
impl SecretDiscoveryService for SdsServer {
    type DeltaSecretsStream = ReceiverStream<Result<DeltaDiscoveryResponse, Status>>;
    type StreamSecretsStream = ReceiverStream<Result<DiscoveryResponse, Status>>;

    async fn delta_secrets(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaSecretsStream>, Status> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let guard = open_stream(&self.metrics);
        let me = self.clone();
        tokio::spawn(async move {
            let _guard = guard;
            me.run_delta(request.into_inner(), tx).await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn stream_secrets(
        &self,
        request: Request<Streaming<DiscoveryRequest>>,
    ) -> Result<Response<Self::StreamSecretsStream>, Status> {
        let (tx, rx) = mpsc::channel(QUEUE);
        let guard = open_stream(&self.metrics);
        let me = self.clone();
        tokio::spawn(async move {
            let _guard = guard;
            me.run_sotw(request.into_inner(), tx).await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn fetch_secrets(
        &self,
        request: Request<DiscoveryRequest>,
    ) -> Result<Response<DiscoveryResponse>, Status> {
        let req = request.into_inner();
        check_type(&req.type_url)?;
        check_names(&req.resource_names)?;
        let names: BTreeSet<String> = req.resource_names.into_iter().collect();
        let set = self.secrets.borrow().clone();
        match sotw_response(&set, &names) {
            Some((_, response, _)) => Ok(Response::new(response)),
            None => Err(Status::not_found(format!(
                "none of {names:?} is available yet (the certificate may still be on its way from the CA)"
            ))),
        }
    }
}

#[cfg(test)]
#[path = "sds_tests.rs"]
mod tests;
