//! The edge towards the CA: [`CaClient`] (swapped by tests) and
//! [`GrpcCaClient`], which speaks `istio.v1.auth.IstioCertificateService`
//! exactly as Istio's ztunnel does.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ambit_proto::auth::IstioCertificateRequest;
use ambit_proto::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use futures::future::BoxFuture;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

use super::Identity;
use crate::control_channel::{CA_ADDRESS_FLAG, ControlChannel, ControlChannelError};

/// Metadata field carrying the SPIFFE id a node proxy requests on behalf of.
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";

/// Errors of a [`CaClient`].
#[derive(Debug, Clone, thiserror::Error)]
pub enum CaClientError {
    /// The CA address is not a valid URL.
    #[error(
        "invalid CA address {address:?}: {reason}; set --ca-address / CA_ADDRESS (it defaults to --xds-address / XDS_ADDRESS) to a URL such as https://istiod.istio-system.svc:15012 (TLS, needs --root-cert) or http://127.0.0.1:15010 (plaintext)"
    )]
    InvalidAddress {
        /// The address given.
        address: String,
        /// Why it was rejected.
        reason: String,
    },
    /// The TLS side of an `https://` CA address could not be set up
    /// (no `--root-cert`, or an unusable root file).
    #[error("cannot set up TLS towards the CA: {0}")]
    Tls(#[source] ControlChannelError),
    /// The token file could not be read.
    #[error("could not read the CA token file {path}: {reason}")]
    TokenFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        reason: String,
    },
    /// The token is not a valid header value.
    #[error("the token in {path} is not a valid HTTP header value (stray control characters?)")]
    InvalidToken {
        /// The file.
        path: PathBuf,
    },
    /// The CA answered with a gRPC error (or could not be reached).
    #[error("CA returned {code}: {message}")]
    Status {
        /// The gRPC code, e.g. `PermissionDenied`, `Unavailable`.
        code: String,
        /// The CA's explanation.
        message: String,
    },
    /// The CA answered with no certificates.
    #[error("CA returned an empty certificate chain")]
    EmptyChain,
    /// Anything else (fakes in tests use this).
    #[error("{0}")]
    Other(String),
}

impl From<tonic::Status> for CaClientError {
    fn from(s: tonic::Status) -> Self {
        CaClientError::Status {
            code: format!("{:?}", s.code()),
            message: s.message().to_string(),
        }
    }
}

/// Signs CSRs. The one seam tests swap for an in-process CA.
///
/// `sign` returns the chain as PEM strings, leaf first, root last.
/// (A boxed future keeps the trait usable as `Arc<dyn CaClient>`.)
pub trait CaClient: Send + Sync + 'static {
    /// Asks the CA to sign `csr_pem` for `identity`, valid for `ttl`.
    fn sign<'a>(
        &'a self,
        identity: &'a Identity,
        csr_pem: String,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, CaClientError>>;
}

/// [`CaClient`] over gRPC (`IstioCertificateService/CreateCertificate`).
///
/// Sends `authorization: Bearer <token>` (the token file is re-read on every
/// request, so a rotated token is used at once) and the pod's SPIFFE id in
/// the `ImpersonatedIdentity` metadata field, like Istio's ztunnel.
#[derive(Debug, Clone)]
pub struct GrpcCaClient {
    client: IstioCertificateServiceClient<Channel>,
    token_file: Option<PathBuf>,
}

impl GrpcCaClient {
    /// Connect timeout towards the CA.
    pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

    /// A client of the CA at `address` with no `--root-cert`: fine for
    /// `http://` (plaintext h2c); an `https://` address needs
    /// [`GrpcCaClient::with_root_cert`]. Connects lazily, so the CA need not
    /// be up yet.
    pub fn new(address: &str, token_file: Option<PathBuf>) -> Result<Self, CaClientError> {
        Self::with_root_cert(address, token_file, None)
    }

    /// A client of the CA at `address`: `http://host:port` is plaintext
    /// h2c, `https://host:port` is TLS verified against the roots of the PEM
    /// file `root_cert` (required then; read now, and again at every new
    /// connection). Connects lazily, so the CA need not be up yet.
    pub fn with_root_cert(
        address: &str,
        token_file: Option<PathBuf>,
        root_cert: Option<&Path>,
    ) -> Result<Self, CaClientError> {
        let channel = ControlChannel::new(address, root_cert, CA_ADDRESS_FLAG)
            .map_err(|e| match e {
                ControlChannelError::InvalidAddress {
                    address, reason, ..
                } => CaClientError::InvalidAddress { address, reason },
                other => CaClientError::Tls(other),
            })?
            .map_endpoint(|e| {
                e.connect_timeout(Self::CONNECT_TIMEOUT)
                    .http2_keep_alive_interval(Duration::from_secs(30))
                    .keep_alive_while_idle(true)
            });
        Ok(Self {
            client: IstioCertificateServiceClient::new(channel.connect_lazy()),
            token_file,
        })
    }

    async fn token(&self) -> Result<Option<MetadataValue<tonic::metadata::Ascii>>, CaClientError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let raw = tokio::fs::read_to_string(path)
            .await
            .map_err(|e| CaClientError::TokenFile {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        let value = format!("Bearer {}", raw.trim());
        MetadataValue::try_from(value)
            .map(Some)
            .map_err(|_| CaClientError::InvalidToken { path: path.clone() })
    }
}

impl CaClient for GrpcCaClient {
    fn sign<'a>(
        &'a self,
        identity: &'a Identity,
        csr_pem: String,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Vec<String>, CaClientError>> {
        Box::pin(async move {
            let token = self.token().await?;
            let fields = BTreeMap::from([(
                IMPERSONATED_IDENTITY.to_string(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(identity.to_string())),
                },
            )]);
            let body = IstioCertificateRequest {
                csr: csr_pem,
                validity_duration: i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX),
                metadata: Some(prost_types::Struct { fields }),
            };
            let mut request = tonic::Request::new(body);
            if let Some(token) = token {
                request.metadata_mut().insert("authorization", token);
            }
            let mut client = self.client.clone();
            let response = client.create_certificate(request).await?.into_inner();
            if response.cert_chain.is_empty() {
                return Err(CaClientError::EmptyChain);
            }
            Ok(response.cert_chain)
        })
    }
}
