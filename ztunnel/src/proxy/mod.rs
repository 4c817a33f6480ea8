//! The node proxy's data path. For now only [`metrics`]: the per-connection
//! metrics and access log that every proxy records. The proxies themselves
//! (outbound, inbound HBONE, inbound plaintext) arrive with the data-plane
//! work (issue 4).

pub mod metrics;
