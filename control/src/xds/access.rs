//! Who may ask the xDS server for what.
//!
//! Every stream authenticates before anything else happens (the same
//! credentials as the CA: a bearer token — a node bootstrap token in local
//! mode, a ServiceAccount token in Kubernetes — or, on 15012, a client
//! certificate issued by the mesh CA). A stream without valid credentials
//! ends with `UNAUTHENTICATED` before its first request is read.
//!
//! Once the first request names the proxy, the caller is authorized for it:
//!
//! - **ztunnel** (the workload API: every workload, service and policy of
//!   the mesh) — a node (node token) or one of the node-proxy service
//!   accounts (`ambit-system/ztunnel` by default, like the CA's rule).
//!   Workload identities are refused: an application pod has no business
//!   reading the whole mesh.
//! - **waypoint / sidecar** (Envoy) — Istio's rule: the identity's namespace
//!   must be the namespace the node claims, and its service account the
//!   `SERVICE_ACCOUNT` the node metadata claims, when it claims one. A node
//!   token is not an Envoy identity and is refused.
//!
//! A refused stream ends with `PERMISSION_DENIED` naming the rule.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use tonic::{Request, Status};
use tracing::warn;

use super::proxy::{ProxyKind, ProxyNode};
use crate::ca::{AuthError, Caller, TokenAuthenticator, authenticate_grpc};

/// Why an authenticated caller may not have what its node asks for.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error(
        "{caller} may not read the workload API (every workload, service and policy of the mesh): it is served only to node proxies — a node token, or a node-proxy service account ({allowed})"
    )]
    NotANodeProxy { caller: String, allowed: String },
    #[error(
        "{caller} claims to be a {kind} in namespace {claimed:?}; an Envoy proxy must run as a service account of the namespace it claims"
    )]
    NamespaceMismatch {
        caller: String,
        kind: ProxyKind,
        claimed: String,
    },
    #[error(
        "{caller} claims service account {claimed:?} in its node metadata; the credentials must be that service account's"
    )]
    ServiceAccountMismatch { caller: String, claimed: String },
    #[error(
        "{caller} is a node bootstrap credential; a {kind} must authenticate as its own service account (token or mesh certificate)"
    )]
    NodeCredentialForEnvoy { caller: String, kind: ProxyKind },
}

/// The xDS server's authentication and authorization.
#[derive(Clone)]
pub struct XdsAccess {
    authenticator: Arc<dyn TokenAuthenticator>,
    /// Service accounts (namespace, name) of node proxies.
    node_proxies: Vec<(String, String)>,
    /// Unix second of the last refusal logged (one line per 10 s at most).
    last_logged: Arc<AtomicU64>,
}

impl std::fmt::Debug for XdsAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XdsAccess")
            .field("node_proxies", &self.node_proxies)
            .finish_non_exhaustive()
    }
}

/// Refusals are logged at most this often (a flood must not flood the log).
const REFUSAL_LOG_EVERY_SECS: u64 = 10;

impl XdsAccess {
    pub fn new(
        authenticator: Arc<dyn TokenAuthenticator>,
        node_proxy_identities: Vec<(String, String)>,
    ) -> Self {
        Self {
            authenticator,
            node_proxies: node_proxy_identities,
            last_logged: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Authenticates a new stream, or the status it must end with.
    pub async fn authenticate<T>(&self, req: &Request<T>, peer: &str) -> Result<Caller, Status> {
        authenticate_grpc(&*self.authenticator, req)
            .await
            .map_err(|e| {
                self.log_refusal(peer, &e.to_string());
                match e {
                    AuthError::Unavailable(_) => Status::unavailable(e.to_string()),
                    _ => Status::unauthenticated(e.to_string()),
                }
            })
    }

    /// Whether `caller` may be served as `proxy`.
    pub fn authorize(&self, caller: &Caller, proxy: &ProxyNode) -> Result<(), AccessError> {
        match (proxy.kind, caller) {
            (ProxyKind::Ztunnel, Caller::Node { .. }) => Ok(()),
            (
                ProxyKind::Ztunnel,
                Caller::Workload {
                    namespace,
                    service_account,
                    ..
                },
            ) => {
                let is_proxy = self
                    .node_proxies
                    .iter()
                    .any(|(ns, sa)| ns == namespace && sa == service_account);
                if is_proxy {
                    Ok(())
                } else {
                    Err(AccessError::NotANodeProxy {
                        caller: caller.to_string(),
                        allowed: self
                            .node_proxies
                            .iter()
                            .map(|(ns, sa)| format!("{ns}/{sa}"))
                            .collect::<Vec<_>>()
                            .join(", "),
                    })
                }
            }
            (kind, Caller::Node { .. }) => Err(AccessError::NodeCredentialForEnvoy {
                caller: caller.to_string(),
                kind,
            }),
            (
                kind,
                Caller::Workload {
                    namespace,
                    service_account,
                    ..
                },
            ) => {
                if !proxy.namespace.is_empty() && proxy.namespace != *namespace {
                    return Err(AccessError::NamespaceMismatch {
                        caller: caller.to_string(),
                        kind,
                        claimed: proxy.namespace.clone(),
                    });
                }
                if !proxy.service_account.is_empty() && proxy.service_account != *service_account {
                    return Err(AccessError::ServiceAccountMismatch {
                        caller: caller.to_string(),
                        claimed: proxy.service_account.clone(),
                    });
                }
                Ok(())
            }
        }
    }

    /// Logs a refusal, at most once per [`REFUSAL_LOG_EVERY_SECS`].
    pub fn log_refusal(&self, peer: &str, reason: &str) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let last = self.last_logged.load(Ordering::Relaxed);
        if now >= last + REFUSAL_LOG_EVERY_SECS
            && self
                .last_logged
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            warn!(%peer, "refused an xDS stream: {reason} (further refusals in the next {REFUSAL_LOG_EVERY_SECS} s are only counted: ambit_xds_auth_failures_total)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ca::StaticTokens;

    fn access() -> XdsAccess {
        XdsAccess::new(
            Arc::new(StaticTokens::default()),
            vec![("ambit-system".into(), "ztunnel".into())],
        )
    }

    fn proxy(kind: ProxyKind, namespace: &str, sa: &str) -> ProxyNode {
        ProxyNode {
            kind,
            id: String::new(),
            pod_name: "p".into(),
            namespace: namespace.into(),
            node_name: String::new(),
            service_account: sa.into(),
            labels: Default::default(),
        }
    }

    fn workload(ns: &str, sa: &str) -> Caller {
        Caller::Workload {
            namespace: ns.into(),
            service_account: sa.into(),
            node: None,
        }
    }

    #[test]
    fn who_may_read_what() {
        let a = access();
        let node = Caller::Node {
            name: "node-1".into(),
        };
        let cases = [
            // (caller, proxy, allowed)
            (node.clone(), proxy(ProxyKind::Ztunnel, "x", ""), true),
            (
                workload("ambit-system", "ztunnel"),
                proxy(ProxyKind::Ztunnel, "", ""),
                true,
            ),
            (
                workload("shop", "web"),
                proxy(ProxyKind::Ztunnel, "shop", ""),
                false,
            ),
            (node.clone(), proxy(ProxyKind::Waypoint, "shop", ""), false),
            (
                workload("shop", "waypoint"),
                proxy(ProxyKind::Waypoint, "shop", ""),
                true,
            ),
            (
                workload("shop", "waypoint"),
                proxy(ProxyKind::Waypoint, "bank", ""),
                false,
            ),
            (
                workload("shop", "web"),
                proxy(ProxyKind::Sidecar, "shop", "web"),
                true,
            ),
            (
                workload("shop", "web"),
                proxy(ProxyKind::Sidecar, "shop", "admin"),
                false,
            ),
        ];
        for (caller, p, allowed) in cases {
            let got = a.authorize(&caller, &p);
            assert_eq!(got.is_ok(), allowed, "{caller} as {p:?}: {got:?}");
        }
    }
}
