//! The CA's CSR handling (`ambit_control::ca::Signer::parse_csr`: PEM →
//! PKCS#10 → signature → exactly one SPIFFE URI SAN in the trust domain),
//! then issuing for what passes.
//!
//! Input: PEM text; or, when the first byte is 0, DER that is wrapped in a
//! PEM `CERTIFICATE REQUEST` block first (so the fuzzer mutates the ASN.1,
//! not the base64).
//!
//! Checks: no panic; an accepted CSR names an identity in the trust domain
//! and is issued a chain.
#![no_main]

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ambit_control::ca::{CaStore, Signer, SignerOptions, generate_csr};
use libfuzzer_sys::fuzz_target;

static SIGNER: LazyLock<Signer> = LazyLock::new(|| {
    let dir = std::env::temp_dir().join(format!("ambit-fuzz-ca-{}", std::process::id()));
    let store = CaStore::load_or_create(&dir, None).unwrap_or_else(|e| panic!("CA store: {e}"));
    let _ = std::fs::remove_dir_all(&dir);
    Signer::new(Arc::new(store), SignerOptions::default())
});

fn seeds() -> Vec<(String, Vec<u8>)> {
    let cases: [(&str, &[&str], &[&str]); 5] = [
        ("workload", &["spiffe://cluster.local/ns/demo/sa/web"], &[]),
        (
            "ztunnel",
            &["spiffe://cluster.local/ns/ambit-system/sa/ztunnel"],
            &[],
        ),
        (
            "other-domain",
            &["spiffe://example.org/ns/demo/sa/web"],
            &[],
        ),
        (
            "two-uris",
            &[
                "spiffe://cluster.local/ns/a/sa/b",
                "spiffe://cluster.local/ns/c/sa/d",
            ],
            &[],
        ),
        (
            "dns-san",
            &["spiffe://cluster.local/ns/demo/sa/web"],
            &["web.demo.svc"],
        ),
    ];
    let mut out = Vec::new();
    for (name, uris, dns) in cases {
        let Ok(csr) = generate_csr(uris, dns) else {
            continue;
        };
        let der = pem::parse(&csr.csr_pem)
            .map(|p| p.into_contents())
            .unwrap_or_default();
        let mut der_input = vec![0u8];
        der_input.extend_from_slice(&der);
        out.push((format!("{name}.pem"), csr.csr_pem.into_bytes()));
        out.push((format!("{name}.der"), der_input));
    }
    out
}

fuzz_target!(
    init: {
        if let Some(dir) = ambit_fuzz::seeds_requested() {
            ambit_fuzz::write_seeds(&dir, seeds());
        }
        LazyLock::force(&SIGNER);
    },
    |data: &[u8]| {
        let text = match data.split_first() {
            Some((0, der)) => pem::encode(&pem::Pem::new("CERTIFICATE REQUEST", der.to_vec())),
            _ => String::from_utf8_lossy(data).into_owned(),
        };
        let Ok(req) = SIGNER.parse_csr(&text) else {
            return;
        };
        assert_eq!(req.identity.trust_domain, SIGNER.options().trust_domain);
        let ttl = SIGNER.granted_ttl(3600).unwrap_or(Duration::from_secs(3600));
        let chain = SIGNER.issue(&req, ttl).unwrap_or_else(|e| panic!("accepted CSR not issued: {e}"));
        assert!(!chain.is_empty());
    }
);
