//! One enrolled pod as its proxies see it ([`PodContext`]): its identity, a
//! socket thread inside its netns, its own drain signal (removing a pod
//! drains only its connections), and the
//! tracking that lets the in-pod manager wait for its connections to end.
//! The per-pod counterpart of [`super::ProxyContext`].

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use ambit_inpod::{NetnsSockets, SocketOptions};
use rustls::ServerConfig;
use tokio::sync::mpsc;

use super::{DEFAULT_TRUST_DOMAIN, ProxyContext, ProxyError, workload_identity};
use crate::drain::DrainWatcher;
use crate::identity::Identity;
use crate::state::{StateSnapshot, Workload};

/// One enrolled pod, as its proxies see it.
pub struct PodContext {
    pub uid: String,
    pub name: Arc<str>,
    pub namespace: Arc<str>,
    pub service_account: String,
    /// Makes sockets inside the pod's netns.
    pub sockets: NetnsSockets,
    /// Fires when the pod is removed or ztunnel drains.
    pub drain: DrainWatcher,
    /// Each connection task holds a clone; the manager waits for all of
    /// them to be dropped when the pod goes.
    tracker: mpsc::Sender<()>,
}

impl std::fmt::Debug for PodContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} (uid {})", self.namespace, self.name, self.uid)
    }
}

impl std::fmt::Display for PodContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Resolves once every connection of a pod has ended.
pub struct PodConnections(mpsc::Receiver<()>);

impl PodConnections {
    /// Waits for the pod's connections to end.
    pub async fn closed(mut self) {
        while self.0.recv().await.is_some() {}
    }
}

/// A guard held by a connection task for its pod.
pub struct ConnGuard(#[allow(dead_code)] mpsc::Sender<()>);

impl PodContext {
    /// A pod; the returned [`PodConnections`] resolves once its
    /// connections (each holding a [`ConnGuard`]) have ended.
    pub fn new(
        uid: String,
        name: String,
        namespace: String,
        service_account: String,
        sockets: NetnsSockets,
        drain: DrainWatcher,
    ) -> (Self, PodConnections) {
        let (tracker, rx) = mpsc::channel(1);
        (
            Self {
                uid,
                name: name.into(),
                namespace: namespace.into(),
                service_account,
                sockets,
                drain,
                tracker,
            },
            PodConnections(rx),
        )
    }

    /// Marks a connection as running for this pod.
    pub fn guard(&self) -> ConnGuard {
        ConnGuard(self.tracker.clone())
    }

    /// The pod's identity: the one xDS gives its workload (what peers
    /// verify) when xDS knows it, else the node agent's namespace and
    /// service account in the default trust domain.
    pub fn identity(&self, ctx: &ProxyContext, snap: &StateSnapshot) -> Identity {
        let uid = format!("{}//Pod/{}/{}", ctx.cluster_id, self.namespace, self.name);
        if let Some(w) = snap.workload_by_uid(&uid) {
            return workload_identity(&w);
        }
        let sa = if self.service_account.is_empty() {
            "default"
        } else {
            &self.service_account
        };
        Identity::new(DEFAULT_TRUST_DOMAIN, &*self.namespace, sa)
    }

    /// Whether `w` is this pod.
    pub fn matches_workload(&self, w: &Workload) -> bool {
        *w.name == *self.name && *w.namespace == *self.namespace
    }

    /// The pod's namespace, shared.
    pub fn namespace_arc(&self) -> Arc<str> {
        self.namespace.clone()
    }

    /// The pod's name, shared.
    pub fn name_arc(&self) -> Arc<str> {
        self.name.clone()
    }

    /// The workload of this pod that owns `ip`, if `ip` is one of its
    /// addresses.
    pub fn workload_at(
        &self,
        ctx: &ProxyContext,
        snap: &StateSnapshot,
        ip: IpAddr,
    ) -> Option<Arc<Workload>> {
        snap.workload_by_ip(&ctx.network, ip.to_canonical())
            .filter(|w| self.matches_workload(w))
    }

    /// The HBONE server config for this pod's certificate (cached in the
    /// shared [`super::TlsCache`] until the certificate or the bundle
    /// changes, or the identity leaves the node).
    pub(super) async fn server_config(
        &self,
        ctx: &ProxyContext,
    ) -> Result<Arc<ServerConfig>, ProxyError> {
        let id = self.identity(ctx, &ctx.state.load());
        let cert = ctx.certificate(&id).await?;
        ctx.server_config(&cert).map_err(|source| ProxyError::Tls {
            identity: id,
            source,
        })
    }

    /// Connects to `dst` from inside the pod, marked so the pod's rules let
    /// it through; from `src` (the original client) when transparent.
    pub(super) async fn connect(
        &self,
        ctx: &ProxyContext,
        dst: SocketAddr,
        src: Option<IpAddr>,
    ) -> Result<tokio::net::TcpStream, ProxyError> {
        let bind = src
            .filter(|ip| ip.is_ipv4() == dst.is_ipv4())
            .map(|ip| SocketAddr::new(ip, 0));
        let opts = SocketOptions {
            mark: Some(ctx.cfg.mark),
            transparent: bind.is_some(),
            bind,
        };
        let timeout = ctx.cfg.connect_timeout;
        let stream = tokio::time::timeout(timeout, self.sockets.connect(dst, &opts))
            .await
            .map_err(|_| ProxyError::ConnectTimeout { dst, timeout })?
            .map_err(|source| ProxyError::Connect { dst, source })?;
        let _ = stream.set_nodelay(true);
        Ok(stream)
    }
}
