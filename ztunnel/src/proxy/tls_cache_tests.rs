//! TLS cache eviction (issue 13): after an identity's pods leave the node
//! (the certificate manager forgets it) or its certificate is renewed, the
//! data path keeps no config — and so no private key — built for it. The
//! proof is that every `Arc` built from the old certificate is freed: a
//! `Weak` to it no longer upgrades.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::{Arc, Weak};
use std::time::Duration;

use hyper::http::HeaderMap;
use tokio::net::TcpListener;
use tokio::time::timeout;

use super::*;
use crate::drain;
use crate::hbone::{HboneServer, PoolKey, TcpDialer};
use crate::identity::IdentityConfig;
use crate::test_support::{TestCa, TestCaClient, id};

const WAIT: Duration = Duration::from_secs(30);

fn manager(ttl: Option<Duration>) -> CertificateManager {
    let ca = TestCaClient {
        ca: TestCa::new("mesh"),
        ttl,
    };
    CertificateManager::new(IdentityConfig::default(), Arc::new(ca)).unwrap()
}

async fn bundle(certs: &CertificateManager) -> Arc<TrustBundle> {
    let mut rx = certs.trust_bundle();
    timeout(WAIT, rx.wait_for(|b| !b.roots.is_empty()))
        .await
        .expect("a root in the bundle in time")
        .unwrap()
        .clone()
}

/// Polls `done` until it holds (bounded).
async fn eventually(what: &str, done: impl Fn() -> bool) {
    let r = timeout(WAIT, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(r.is_ok(), "{what}: not within {WAIT:?}");
}

fn gone<T>(w: &Weak<T>) -> bool {
    w.upgrade().is_none()
}

/// An HBONE server presenting `peer`'s certificate that accepts any
/// CONNECT and holds the stream open until the client ends it.
async fn hbone_peer(certs: &CertificateManager, peer: &Identity) -> SocketAddr {
    let cert = certs.fetch(peer).await.unwrap();
    let server = HboneServer::new(Arc::new(
        crate::hbone::server_config(&cert, &*bundle(certs).await).unwrap(),
    ));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = l.accept().await {
            let server = server.clone();
            tokio::spawn(async move {
                let _ = server
                    // Answer 200 (a dropped PendingConnect resets the
                    // stream), then close the tunnel.
                    .serve(tcp, |_| Ok(()), |_, s| async move { drop(s.accept()) })
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_whose_pods_left_keeps_no_config_no_key_no_pooled_connection() {
    let certs = manager(None);
    let cache = Arc::new(TlsCache::default());
    let pool = HbonePool::default();
    let (_stop, watcher) = drain::channel();
    tokio::spawn(follow_certificates(
        certs.clone(),
        cache.clone(),
        pool.clone(),
        watcher,
    ));
    let (leaving, staying, peer) = (id("leaving"), id("staying"), id("peer"));
    let peer_addr = hbone_peer(&certs, &peer).await;

    let cert = certs.fetch(&leaving).await.unwrap();
    let other = certs.fetch(&staying).await.unwrap();
    let b = bundle(&certs).await;
    let client = cache.client(&cert, &b, &peer).unwrap();
    let server = cache.server(&cert, &b).unwrap();
    let other_client = cache.client(&other, &b, &peer).unwrap();
    let other_server = cache.server(&other, &b).unwrap();
    // An outbound connection of the leaving identity, pooled and now idle.
    let key = PoolKey {
        src: leaving.clone(),
        dst: peer.clone(),
        dst_ip: peer_addr.ip(),
        src_ip: None,
    };
    let stream = timeout(
        WAIT,
        pool.stream(
            key,
            peer_addr,
            &TcpDialer,
            || cache.client(&cert, &b, &peer),
            "10.0.0.1:80".parse().unwrap(),
            HeaderMap::new(),
        ),
    )
    .await
    .unwrap()
    .unwrap();
    drop(stream);
    assert_eq!(pool.stats().connections(), 1);
    let stats = cache.stats();
    assert_eq!((stats.client_entries, stats.server_entries), (2, 2));

    let weak = (
        Arc::downgrade(&cert),
        Arc::downgrade(&client),
        Arc::downgrade(&server),
    );
    drop((cert, client, server));
    // Nothing has changed yet: the cache and the manager hold them.
    assert!(!gone(&weak.0) && !gone(&weak.1) && !gone(&weak.2));

    // The identity's last pod left: app.rs's identity tracker forgets it.
    certs.forget(&leaving);
    eventually("the cache forgets the identity", || {
        !cache.stats().identities.contains(&leaving)
    })
    .await;
    eventually("the pool drops the identity's connections", || {
        pool.stats().connections() == 0
    })
    .await;
    eventually(
        "no certificate, config or key of it is left anywhere",
        || gone(&weak.0) && gone(&weak.1) && gone(&weak.2),
    )
    .await;
    // The identity that stays is untouched.
    let stats = cache.stats();
    assert_eq!(
        stats.identities.into_iter().collect::<Vec<_>>(),
        vec![staying.clone()]
    );
    assert!(Arc::ptr_eq(
        &cache.client(&other, &b, &peer).unwrap(),
        &other_client
    ));
    assert!(Arc::ptr_eq(
        &cache.server(&other, &b).unwrap(),
        &other_server
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_replaces_the_configs_built_from_the_old_one() {
    // Two-second certificates: renewed after about one second.
    let certs = manager(Some(Duration::from_secs(2)));
    let cache = Arc::new(TlsCache::default());
    let (_stop, watcher) = drain::channel();
    tokio::spawn(follow_certificates(
        certs.clone(),
        cache.clone(),
        HbonePool::default(),
        watcher,
    ));
    let (me, peer) = (id("renewing"), id("peer"));
    let old = certs.fetch(&me).await.unwrap();
    let b = bundle(&certs).await;
    let weak = (
        Arc::downgrade(&old),
        Arc::downgrade(&cache.client(&old, &b, &peer).unwrap()),
        Arc::downgrade(&cache.server(&old, &b).unwrap()),
    );
    let old_serial = old.serial_hex();
    drop(old);
    assert_eq!(cache.stats().client_entries, 1);

    let mut changes = certs.changes();
    timeout(
        WAIT,
        changes.wait_for(|_| {
            certs
                .current(&me)
                .is_some_and(|c| c.serial_hex() != old_serial)
        }),
    )
    .await
    .expect("renewed in time")
    .unwrap();
    eventually("the old certificate's configs and key are gone", || {
        gone(&weak.0) && gone(&weak.1) && gone(&weak.2)
    })
    .await;
    let stats = cache.stats();
    assert_eq!(
        (stats.client_entries, stats.server_entries),
        (0, 0),
        "stale entries dropped, not kept until the next lookup"
    );
    // The next lookup builds from the new certificate.
    let new = certs.current(&me).unwrap();
    let b = certs.trust_bundle().borrow().clone();
    let _ = cache.client(&new, &b, &peer).unwrap();
    assert_eq!(cache.stats().client_entries, 1);
}
