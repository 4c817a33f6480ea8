//! The HBONE server's check of a request head
//! (`ambit_ztunnel::hbone::check_connect`), with the head built the way h2
//! builds it from the pseudo-headers: a `CONNECT` has only `:authority`,
//! which becomes the URI's authority; other methods carry a full URI.
//!
//! Input: the method, a newline, the `:authority`, a newline, a full URI.
//!
//! Checks: no panic; only `CONNECT` passes; what passes is exactly the
//! socket address the authority spells (it prints back to the same
//! address), never a host name, never with user info.
#![no_main]

use std::net::SocketAddr;

use ambit_ztunnel::hbone::check_connect;
use http::uri::{Authority, Uri};
use http::{Method, StatusCode};
use libfuzzer_sys::fuzz_target;

fn seeds() -> Vec<(String, Vec<u8>)> {
    [
        ("connect-v4", "CONNECT\n10.244.1.5:8080\n"),
        ("connect-v6", "CONNECT\n[fd00::5]:8080\n"),
        ("connect-host", "CONNECT\nweb.demo.svc.cluster.local:80\n"),
        ("connect-no-port", "CONNECT\n10.244.1.5\n"),
        ("connect-userinfo", "CONNECT\nuser@10.244.1.5:80\n"),
        ("get", "GET\n\nhttp://10.244.1.5:8080/healthz"),
        ("post-path", "POST\n\n/x?y=z"),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), s.as_bytes().to_vec()))
    .collect()
}

fn check(method: &Method, uri: &Uri) {
    match check_connect(method, uri) {
        Ok(addr) => {
            assert_eq!(method, Method::CONNECT);
            let authority = uri.authority().map(Authority::as_str).unwrap_or_default();
            assert!(!authority.contains('@'), "user info passed: {authority:?}");
            assert_eq!(authority.parse::<SocketAddr>().ok(), Some(addr));
            assert_eq!(addr.to_string().parse::<SocketAddr>().ok(), Some(addr));
        }
        Err(status) => {
            assert!(
                status == StatusCode::METHOD_NOT_ALLOWED || status == StatusCode::BAD_REQUEST,
                "{status}"
            );
            if method != Method::CONNECT {
                assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
            }
        }
    }
}

fuzz_target!(
    init: {
        if let Some(dir) = ambit_fuzz::seeds_requested() {
            ambit_fuzz::write_seeds(&dir, seeds());
        }
    },
    |data: &[u8]| {
        let mut parts = data.splitn(3, |b| *b == b'\n');
        let method = parts.next().unwrap_or_default();
        let authority = parts.next().unwrap_or_default();
        let full = parts.next().unwrap_or_default();
        let Ok(method) = Method::from_bytes(method) else {
            return;
        };
        // As h2 does for CONNECT: the URI is the authority alone.
        if let Ok(a) = Authority::try_from(authority) {
            let mut p = http::uri::Parts::default();
            p.authority = Some(a);
            if let Ok(uri) = Uri::from_parts(p) {
                check(&method, &uri);
            }
        }
        if let Ok(uri) = Uri::try_from(full) {
            check(&method, &uri);
        }
    }
);
