//! The edge towards the CA: [`CaClient`] (swapped by tests) and
//! [`GrpcCaClient`], which speaks `istio.v1.auth.IstioCertificateService`
//! exactly as Istio's ztunnel does.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use ambit_proto::auth::IstioCertificateRequest;
use ambit_proto::auth::istio_certificate_service_client::IstioCertificateServiceClient;
use futures::future::BoxFuture;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

use super::Identity;

/// Metadata field carrying the SPIFFE id a node proxy requests on behalf of.
pub const IMPERSONATED_IDENTITY: &str = "ImpersonatedIdentity";

/// Errors of a [`CaClient`].
#[derive(Debug, Clone, thiserror::Error)]
pub enum CaClientError {
    /// The CA address is not a valid URL.
    #[error(
        "invalid CA address {address:?}: {reason}; set --ca-address / CA_ADDRESS (it defaults to --xds-address / XDS_ADDRESS) to a URL such as http://127.0.0.1:15010"
    )]
    InvalidAddress {
        /// The address given.
        address: String,
        /// Why it was rejected.
        reason: String,
    },
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

    /// A client of the CA at `address` (`http://host:port`; plaintext h2c
    /// for now). Connects lazily, so the CA need not be up yet.
    pub fn new(address: &str, token_file: Option<PathBuf>) -> Result<Self, CaClientError> {
        let endpoint = Endpoint::from_shared(address.to_string())
            .map_err(|e| CaClientError::InvalidAddress {
                address: address.to_string(),
                reason: e.to_string(),
            })?
            .connect_timeout(Self::CONNECT_TIMEOUT)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true);
        Ok(Self {
            client: IstioCertificateServiceClient::new(endpoint.connect_lazy()),
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
