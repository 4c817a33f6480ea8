//! The rustls configs the proxies reuse, and their eviction.
//!
//! A config holds its identity's private key. Entries are keyed by the
//! local identity (and, for clients, the peer identity that is pinned) and
//! remember the certificate and trust bundle they were built from, so a
//! lookup with a newer certificate or bundle rebuilds them. Nothing is
//! kept only because nobody asked again: [`TlsCache::retain_current`] drops
//! every entry whose identity is no longer managed (its last pod left the
//! node) or whose certificate was replaced, and [`follow_certificates`]
//! runs it after each change the certificate manager announces — also
//! dropping idle pooled HBONE connections that present a forgotten
//! identity. So no private key of an identity that no local pod has is
//! kept by the data path beyond the connections still carrying traffic.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use rustls::{ClientConfig, ServerConfig};

use crate::drain::DrainWatcher;
use crate::hbone::{HbonePool, TlsError, client_config, server_config};
use crate::identity::{CertificateManager, Identity, TrustBundle, WorkloadCertificate};

struct Cached<C> {
    cert: Arc<WorkloadCertificate>,
    bundle: Arc<TrustBundle>,
    config: Arc<C>,
}

impl<C> Cached<C> {
    fn matches(&self, cert: &Arc<WorkloadCertificate>, bundle: &Arc<TrustBundle>) -> bool {
        Arc::ptr_eq(&self.cert, cert) && Arc::ptr_eq(&self.bundle, bundle)
    }
}

/// What the cache holds, for tests and debugging.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsCacheStats {
    /// Client configs (one per local identity and pinned peer identity).
    pub client_entries: usize,
    /// Server configs (one per local identity).
    pub server_entries: usize,
    /// Every local identity an entry is held for.
    pub identities: BTreeSet<Identity>,
}

/// Client and server rustls configs per local identity.
#[derive(Default)]
pub struct TlsCache {
    client: Mutex<HashMap<(Identity, Identity), Cached<ClientConfig>>>,
    server: Mutex<HashMap<Identity, Cached<ServerConfig>>>,
}

impl std::fmt::Debug for TlsCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsCache")
            .field("stats", &self.stats())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl TlsCache {
    /// The client config presenting `cert` and pinning `peer`, rebuilt when
    /// the certificate or the bundle changed.
    pub fn client(
        &self,
        cert: &Arc<WorkloadCertificate>,
        bundle: &Arc<TrustBundle>,
        peer: &Identity,
    ) -> Result<Arc<ClientConfig>, TlsError> {
        let key = (cert.identity.clone(), peer.clone());
        let mut cache = lock(&self.client);
        if let Some(c) = cache.get(&key)
            && c.matches(cert, bundle)
        {
            return Ok(c.config.clone());
        }
        let config = Arc::new(client_config(cert, bundle, peer.clone())?);
        cache.insert(
            key,
            Cached {
                cert: cert.clone(),
                bundle: bundle.clone(),
                config: config.clone(),
            },
        );
        Ok(config)
    }

    /// The HBONE server config presenting `cert`, rebuilt when the
    /// certificate or the bundle changed.
    pub fn server(
        &self,
        cert: &Arc<WorkloadCertificate>,
        bundle: &Arc<TrustBundle>,
    ) -> Result<Arc<ServerConfig>, TlsError> {
        let mut cache = lock(&self.server);
        if let Some(c) = cache.get(&cert.identity)
            && c.matches(cert, bundle)
        {
            return Ok(c.config.clone());
        }
        let config = Arc::new(server_config(cert, bundle)?);
        cache.insert(
            cert.identity.clone(),
            Cached {
                cert: cert.clone(),
                bundle: bundle.clone(),
                config: config.clone(),
            },
        );
        Ok(config)
    }

    /// Keeps only the entries built from the certificate `current` returns
    /// for their identity (`None`: the identity is no longer managed).
    /// Returns how many entries were dropped.
    pub fn retain_current<F>(&self, current: F) -> usize
    where
        F: Fn(&Identity) -> Option<Arc<WorkloadCertificate>>,
    {
        let fresh = |id: &Identity, cert: &Arc<WorkloadCertificate>| {
            current(id).is_some_and(|c| Arc::ptr_eq(&c, cert))
        };
        // Dropped outside the locks: freeing a config frees its key.
        let mut dropped_client = Vec::new();
        let mut dropped_server = Vec::new();
        {
            let mut client = lock(&self.client);
            let stale: Vec<_> = client
                .iter()
                .filter(|((id, _), c)| !fresh(id, &c.cert))
                .map(|(k, _)| k.clone())
                .collect();
            for k in stale {
                dropped_client.extend(client.remove(&k));
            }
        }
        {
            let mut server = lock(&self.server);
            let stale: Vec<_> = server
                .iter()
                .filter(|(id, c)| !fresh(id, &c.cert))
                .map(|(k, _)| k.clone())
                .collect();
            for k in stale {
                dropped_server.extend(server.remove(&k));
            }
        }
        dropped_client.len() + dropped_server.len()
    }

    /// What the cache holds now.
    pub fn stats(&self) -> TlsCacheStats {
        let client = lock(&self.client);
        let server = lock(&self.server);
        TlsCacheStats {
            client_entries: client.len(),
            server_entries: server.len(),
            identities: client
                .keys()
                .map(|(id, _)| id.clone())
                .chain(server.keys().cloned())
                .collect(),
        }
    }
}

/// Drops stale TLS configs (and idle pooled connections of forgotten
/// identities) after every change of `certificates`, until `drain` fires.
pub async fn follow_certificates(
    certificates: CertificateManager,
    cache: Arc<TlsCache>,
    pool: HbonePool,
    drain: DrainWatcher,
) {
    let mut changes = certificates.changes();
    loop {
        changes.borrow_and_update();
        let dropped = cache.retain_current(|id| certificates.current(id));
        let managed: BTreeSet<Identity> = certificates.identities().into_iter().collect();
        let closed = pool.evict_sources(|id| !managed.contains(id));
        if dropped > 0 || closed > 0 {
            tracing::debug!(
                tls_configs = dropped,
                pooled_connections = closed,
                "dropped TLS state of replaced certificates and departed identities"
            );
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            _ = drain.signaled() => return,
        }
    }
}

#[cfg(test)]
#[path = "tls_cache_tests.rs"]
mod tests;
