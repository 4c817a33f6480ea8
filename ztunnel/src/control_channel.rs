//! gRPC channels towards the control plane, for both the xDS client and the
//! CA client.
//!
//! ```text
//! http://host:port   plaintext h2c (the local 15010 endpoint), tonic's own connector
//! https://host:port  TCP (nodelay) ─▶ TLS 1.3/1.2, ALPN h2, server certificate
//!                    checked against --root-cert, server name = URL host ─▶ h2
//! ```
//!
//! The TLS side is our own connector (tokio-rustls with the ring provider),
//! handed to tonic with [`Endpoint::connect_with_connector`]. The tonic
//! endpoint itself is given the `http://` form of the URL and an `https://`
//! origin: requests still carry `:scheme https`, and tonic never tries to
//! add a TLS layer of its own (it would if some other crate of the build
//! enabled one of its TLS features).
//!
//! The `--root-cert` file is read once when the channel is built (a missing,
//! unreadable or empty file is a startup error) and again at every new TCP
//! connection, so a rotated root is picked up at the next reconnect. If the
//! re-read fails, the last good roots are kept and a warning is logged.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tracing::{debug, warn};

/// How the xDS address is set, for error messages.
pub const XDS_ADDRESS_FLAG: &str = "--xds-address / XDS_ADDRESS";
/// How the CA address is set, for error messages.
pub const CA_ADDRESS_FLAG: &str =
    "--ca-address / CA_ADDRESS (it defaults to --xds-address / XDS_ADDRESS)";
/// How the root certificate file is set, for error messages.
pub const ROOT_CERT_FLAG: &str = "--root-cert / ROOT_CERT";

/// ALPN protocol offered on TLS connections: gRPC runs over HTTP/2.
const ALPN_H2: &[u8] = b"h2";

/// Errors of building a [`ControlChannel`] (all found at startup).
#[derive(Debug, Clone, thiserror::Error)]
pub enum ControlChannelError {
    /// The address is not an `http://` or `https://` URL with a host.
    #[error(
        "invalid address {address:?} in {flag}: {reason}; use a URL such as https://istiod.istio-system.svc:15012 (TLS) or http://127.0.0.1:15010 (plaintext)"
    )]
    InvalidAddress {
        /// The flag the address came from.
        flag: &'static str,
        /// The address given.
        address: String,
        /// Why it was rejected.
        reason: String,
    },
    /// An `https://` address was given without `--root-cert`.
    #[error(
        "{address} (from {flag}) uses TLS, but {ROOT_CERT_FLAG} is not set; pass the PEM file of the root CA that signed the control plane's serving certificate, or use an http:// address for a plaintext endpoint"
    )]
    MissingRootCert {
        /// The flag the address came from.
        flag: &'static str,
        /// The address given.
        address: String,
    },
    /// The `--root-cert` file could not be read or holds no usable root.
    #[error(
        "cannot use the {ROOT_CERT_FLAG} file {path} to verify the control plane: {reason}; point {ROOT_CERT_FLAG} at a readable PEM file holding the root CA certificate"
    )]
    RootCert {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// rustls refused the client configuration.
    #[error("cannot build the TLS client configuration: {reason}")]
    TlsConfig {
        /// The rustls error.
        reason: String,
    },
}

/// Errors of one TLS connection attempt (reported through tonic's
/// connection error, whose source chain carries this message).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The TCP connection failed.
    #[error("TCP connection to {target} failed: {source}")]
    Tcp {
        /// `host:port`.
        target: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The TLS handshake failed (often: the server certificate is not signed
    /// by a root of `--root-cert`, or does not cover the host name).
    #[error(
        "TLS handshake with {target} (server name {server_name}) failed: {source}; check that {ROOT_CERT_FLAG} holds the root CA that signed the control plane's certificate and that the certificate covers {server_name}"
    )]
    Handshake {
        /// `host:port`.
        target: String,
        /// The name the certificate was checked against.
        server_name: String,
        /// The TLS error.
        #[source]
        source: std::io::Error,
    },
}

/// The TLS half of an `https://` channel.
#[derive(Debug)]
struct TlsTarget {
    /// Host to connect to (brackets of an IPv6 literal removed).
    host: String,
    port: u16,
    server_name: ServerName<'static>,
    root_cert: PathBuf,
    /// The last client configuration built from a good root file.
    config: ArcSwap<ClientConfig>,
}

impl TlsTarget {
    fn target(&self) -> String {
        match self.host.contains(':') {
            true => format!("[{}]:{}", self.host, self.port),
            false => format!("{}:{}", self.host, self.port),
        }
    }

    /// Re-reads the root file; keeps the last good configuration if that fails.
    async fn current_config(&self) -> Arc<ClientConfig> {
        let fresh = match tokio::fs::read(&self.root_cert).await {
            Ok(bytes) => client_config(&self.root_cert, &bytes),
            Err(e) => Err(ControlChannelError::RootCert {
                path: self.root_cert.clone(),
                reason: e.to_string(),
            }),
        };
        match fresh {
            Ok(config) => {
                let config = Arc::new(config);
                self.config.store(config.clone());
                config
            }
            Err(e) => {
                warn!(error = %e, "keeping the previously loaded control plane roots");
                self.config.load_full()
            }
        }
    }

    async fn connect(&self) -> Result<TokioIo<TlsStream<TcpStream>>, ConnectError> {
        let target = self.target();
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|source| ConnectError::Tcp {
                target: target.clone(),
                source,
            })?;
        tcp.set_nodelay(true).map_err(|source| ConnectError::Tcp {
            target: target.clone(),
            source,
        })?;
        let config = self.current_config().await;
        let tls = TlsConnector::from(config)
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|source| ConnectError::Handshake {
                target: target.clone(),
                server_name: self.server_name.to_str().into_owned(),
                source,
            })?;
        debug!(
            %target,
            alpn = ?tls.get_ref().1.alpn_protocol().map(String::from_utf8_lossy),
            "TLS connection to the control plane established"
        );
        Ok(TokioIo::new(tls))
    }
}

/// A way to reach one control plane URL: plaintext h2c for `http://`, TLS
/// for `https://`. Configure the tonic [`Endpoint`] (timeouts, keepalive)
/// with [`ControlChannel::map_endpoint`], then [`ControlChannel::connect`]
/// or [`ControlChannel::connect_lazy`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ControlChannel {
    address: String,
    endpoint: Endpoint,
    tls: Option<Arc<TlsTarget>>,
}

impl ControlChannel {
    /// Parses `address` (from `flag`, named in errors). An `https://`
    /// address needs `root_cert`, which is read now.
    pub fn new(
        address: &str,
        root_cert: Option<&Path>,
        flag: &'static str,
    ) -> Result<Self, ControlChannelError> {
        let invalid = |reason: String| ControlChannelError::InvalidAddress {
            flag,
            address: address.to_string(),
            reason,
        };
        let uri: Uri = address.parse().map_err(|e| invalid(format!("{e}")))?;
        match uri.scheme_str() {
            Some("http") => {
                let endpoint = Endpoint::from_shared(address.to_string())
                    .map_err(|e| invalid(e.to_string()))?;
                Ok(Self {
                    address: address.to_string(),
                    endpoint,
                    tls: None,
                })
            }
            Some("https") => Self::new_tls(address, &uri, root_cert, flag, invalid),
            Some(other) => Err(invalid(format!(
                "scheme {other:?} is not supported (only http and https)"
            ))),
            None => Err(invalid(
                "the URL has no scheme (http:// or https://)".into(),
            )),
        }
    }

    fn new_tls(
        address: &str,
        uri: &Uri,
        root_cert: Option<&Path>,
        flag: &'static str,
        invalid: impl Fn(String) -> ControlChannelError,
    ) -> Result<Self, ControlChannelError> {
        let authority = uri
            .authority()
            .ok_or_else(|| invalid("the URL has no host".into()))?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        if host.is_empty() {
            return Err(invalid("the URL has no host".into()));
        }
        let port = authority.port_u16().unwrap_or(443);
        let server_name = ServerName::try_from(host.clone())
            .map_err(|e| invalid(format!("{host:?} is not a DNS name or IP address: {e}")))?;
        let Some(root_cert) = root_cert else {
            return Err(ControlChannelError::MissingRootCert {
                flag,
                address: address.to_string(),
            });
        };
        let bytes = std::fs::read(root_cert).map_err(|e| ControlChannelError::RootCert {
            path: root_cert.to_path_buf(),
            reason: e.to_string(),
        })?;
        let config = client_config(root_cert, &bytes)?;

        // The tonic side sees http:// (so it never adds TLS of its own) and
        // an https:// origin (so requests carry `:scheme https`).
        let plain = format!("http://{authority}");
        let endpoint = Endpoint::from_shared(plain)
            .map_err(|e| invalid(e.to_string()))?
            .origin(uri.clone());
        Ok(Self {
            address: address.to_string(),
            endpoint,
            tls: Some(Arc::new(TlsTarget {
                host,
                port,
                server_name,
                root_cert: root_cert.to_path_buf(),
                config: ArcSwap::from_pointee(config),
            })),
        })
    }

    /// Applies endpoint settings (timeouts, keepalive, window sizes).
    /// `tcp_nodelay` is always on for TLS connections.
    pub fn map_endpoint(mut self, f: impl FnOnce(Endpoint) -> Endpoint) -> Self {
        self.endpoint = f(self.endpoint);
        self
    }

    /// The address as configured.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Whether connections use TLS (`https://`).
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Connects now (TCP, then TLS for `https://`, then HTTP/2), within the
    /// endpoint's connect timeout.
    pub async fn connect(&self) -> Result<Channel, tonic::transport::Error> {
        match &self.tls {
            None => self.endpoint.connect().await,
            Some(tls) => {
                self.endpoint
                    .connect_with_connector(connector(tls.clone()))
                    .await
            }
        }
    }

    /// A channel that connects on first use and reconnects by itself.
    pub fn connect_lazy(&self) -> Channel {
        match &self.tls {
            None => self.endpoint.connect_lazy(),
            Some(tls) => self
                .endpoint
                .connect_with_connector_lazy(connector(tls.clone())),
        }
    }
}

type ConnectFuture = std::pin::Pin<
    Box<dyn Future<Output = Result<TokioIo<TlsStream<TcpStream>>, ConnectError>> + Send>,
>;

/// The connector tonic calls for every new connection. The URI it is given
/// is the endpoint's (`http://` form); the target is fixed at build time.
fn connector(
    tls: Arc<TlsTarget>,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<TlsStream<TcpStream>>,
    Error = ConnectError,
    Future = ConnectFuture,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |_: Uri| -> ConnectFuture {
        let tls = tls.clone();
        Box::pin(async move { tls.connect().await })
    })
}

/// A rustls client configuration trusting the certificates of the PEM
/// `bytes` (read from `path`): ring provider, TLS 1.3 and 1.2, ALPN h2.
fn client_config(path: &Path, bytes: &[u8]) -> Result<ClientConfig, ControlChannelError> {
    let err = |reason: String| ControlChannelError::RootCert {
        path: path.to_path_buf(),
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(format!("bad PEM: {e}")))?;
    if certs.is_empty() {
        return Err(err("the file holds no PEM certificate".into()));
    }
    let mut roots = rustls::RootCertStore::empty();
    let (added, ignored) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(err(format!(
            "none of its {ignored} certificate(s) is usable as a trust anchor"
        )));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| ControlChannelError::TlsConfig {
            reason: e.to_string(),
        })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(config)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn root_pem() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn http_is_plaintext_and_needs_no_root() {
        let c = ControlChannel::new("http://127.0.0.1:15010", None, XDS_ADDRESS_FLAG).unwrap();
        assert!(!c.is_tls());
        assert_eq!(c.address(), "http://127.0.0.1:15010");
    }

    #[test]
    fn https_without_root_cert_names_the_flag() {
        let err =
            ControlChannel::new("https://127.0.0.1:15012", None, XDS_ADDRESS_FLAG).unwrap_err();
        assert!(matches!(err, ControlChannelError::MissingRootCert { .. }));
        let msg = err.to_string();
        assert!(
            msg.contains("--root-cert") && msg.contains("--xds-address"),
            "{msg}"
        );
    }

    #[test]
    fn unreadable_or_empty_root_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let err =
            ControlChannel::new("https://cp:15012", Some(&missing), CA_ADDRESS_FLAG).unwrap_err();
        assert!(matches!(err, ControlChannelError::RootCert { .. }), "{err}");
        assert!(err.to_string().contains("--root-cert"), "{err}");

        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let err =
            ControlChannel::new("https://cp:15012", Some(&empty), CA_ADDRESS_FLAG).unwrap_err();
        assert!(err.to_string().contains("no PEM certificate"), "{err}");
    }

    #[test]
    fn https_accepts_dns_names_and_ip_literals() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root.pem");
        std::fs::write(&root, root_pem()).unwrap();
        for addr in [
            "https://istiod.istio-system.svc:15012",
            "https://10.0.0.1:15012",
            "https://[::1]:15012",
            "https://cp",
        ] {
            let c = ControlChannel::new(addr, Some(&root), XDS_ADDRESS_FLAG).unwrap();
            assert!(c.is_tls(), "{addr}");
        }
        let tls = ControlChannel::new("https://[::1]:15012", Some(&root), XDS_ADDRESS_FLAG)
            .unwrap()
            .tls
            .unwrap();
        assert_eq!(tls.target(), "[::1]:15012");
        let tls = ControlChannel::new("https://cp", Some(&root), XDS_ADDRESS_FLAG)
            .unwrap()
            .tls
            .unwrap();
        assert_eq!(tls.target(), "cp:443");
    }

    #[test]
    fn bad_addresses_are_refused() {
        for addr in ["not a url", "ftp://cp:21", "127.0.0.1:15010"] {
            let err = ControlChannel::new(addr, None, XDS_ADDRESS_FLAG).unwrap_err();
            assert!(
                matches!(err, ControlChannelError::InvalidAddress { .. }),
                "{addr}: {err}"
            );
            assert!(err.to_string().contains("--xds-address"), "{err}");
        }
    }
}
