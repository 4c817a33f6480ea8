//! Kubernetes mode beside the config source: the API client, leader
//! election through a Lease, the CA root in a Secret and the status the
//! leader writes (TokenReview authentication is `ca::TokenReview`).
//!
//! Every API call outside a watch has a deadline ([`API_CALL_TIMEOUT`]);
//! watches are bounded by kube's watcher (server-side timeout plus an idle
//! timeout).

use std::future::Future;
use std::time::Duration;

use kube::Client;
use kube::config::{Config, KubeConfigOptions, Kubeconfig};

use crate::config::ClusterAccess;

pub mod ca_secret;
pub mod config_status;
pub mod leader;
pub mod root_configmap;
pub mod waypoint;
pub mod webhook_ca;

/// Deadline of one API call (get, create, update, patch, TokenReview).
pub const API_CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Deadline of the TCP (and TLS) connection to the API server.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors reaching or talking to the API server.
#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    #[error(
        "cannot read the kubeconfig {path}: {source}; check the file (it must name a current context with a server and credentials)"
    )]
    Kubeconfig {
        path: std::path::PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error(
        "cannot configure in-cluster access to the API server: {0}; run inside a pod with a ServiceAccount token mounted, or pass --kubeconfig"
    )]
    InCluster(#[source] kube::config::InClusterError),
    #[error("cannot build the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error(
        "{what} failed: {source}; the API server rejected or could not serve the request — check the control plane's RBAC (deploy/kubernetes) and the API server's health"
    )]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "{what} did not answer within {limit:?}; the API server is slow or unreachable — it is retried"
    )]
    Timeout { what: String, limit: Duration },
    #[error("{what}: {reason}")]
    Invalid { what: String, reason: String },
}

impl K8sError {
    /// The API server's status code, when it answered with one.
    pub fn status_code(&self) -> Option<u16> {
        match self {
            K8sError::Api {
                source: kube::Error::Api(s),
                ..
            } => Some(s.code),
            _ => None,
        }
    }
}

/// A client for `access`: connect timeout [`CONNECT_TIMEOUT`]; no read
/// timeout on the connection (watches are long), so every other call is
/// bounded with [`call`].
pub async fn client(access: &ClusterAccess) -> Result<Client, K8sError> {
    let mut config = match access {
        ClusterAccess::Kubeconfig(path) => {
            let err = |source| K8sError::Kubeconfig {
                path: path.clone(),
                source,
            };
            let kc = Kubeconfig::read_from(path).map_err(err)?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(err)?
        }
        ClusterAccess::InCluster => Config::incluster().map_err(K8sError::InCluster)?,
    };
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    config.write_timeout = Some(API_CALL_TIMEOUT);
    Client::try_from(config).map_err(K8sError::Client)
}

/// Runs one API call with the [`API_CALL_TIMEOUT`] deadline.
pub async fn call<T>(
    what: impl Into<String>,
    fut: impl Future<Output = Result<T, kube::Error>>,
) -> Result<T, K8sError> {
    let what = what.into();
    match tokio::time::timeout(API_CALL_TIMEOUT, fut).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(K8sError::Api { what, source }),
        Err(_) => Err(K8sError::Timeout {
            what,
            limit: API_CALL_TIMEOUT,
        }),
    }
}

/// True when the error is the API server's `404 Not Found`.
pub fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.is_not_found())
}
