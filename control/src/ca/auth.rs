//! Caller authentication from `authorization: Bearer <token>`.
//!
//! [`NodeTokenFile`] is the local-mode authenticator: a file of
//! `<token> <node-name>` lines (`#` starts a comment), written by the local
//! mesh tooling and re-read whenever its size, mtime or inode changes.
//! [`super::TokenReview`] (`token_review.rs`) asks the Kubernetes API server;
//! [`Unconfigured`] refuses every token (local mode without a tokens file).
//! [`StaticTokens`] is a fixed map, for tests and embedders.
//!
//! [`authenticate_grpc`] is the one entry point every gRPC service (CA and
//! xDS) uses: a bearer token when one is sent, else the SPIFFE identity of a
//! client certificate the TLS listener verified against the mesh's roots.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

/// A boxed, `Send` future (keeps [`TokenAuthenticator`] object-safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A node proxy authenticated by its node token.
    Node { name: String },
    /// A workload authenticated by its ServiceAccount token. `node` is the
    /// node the token's pod runs on when the authenticator knows it (bound
    /// Kubernetes tokens carry it); a node proxy identity needs it.
    Workload {
        namespace: String,
        service_account: String,
        node: Option<String>,
    },
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Caller::Node { name } => write!(f, "node {name}"),
            Caller::Workload {
                namespace,
                service_account,
                node,
            } => {
                write!(f, "service account {namespace}/{service_account}")?;
                if let Some(n) = node {
                    write!(f, " on node {n}")?;
                }
                Ok(())
            }
        }
    }
}

/// Why a caller could not be authenticated.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AuthError {
    #[error(
        "no credentials: send `authorization: Bearer <token>` (the node's bootstrap token in local mode, a ServiceAccount token in Kubernetes) or, on the TLS port, a client certificate issued by the mesh CA"
    )]
    MissingToken,
    #[error("the authorization header is not `Bearer <token>`")]
    Malformed,
    #[error(
        "the bearer token was refused ({0}); in local mode check that the node's --token-file matches the control plane's node tokens file, in Kubernetes that it is a current ServiceAccount token projected with audience istio-ca"
    )]
    Rejected(String),
    #[error("token authentication is unavailable: {0}")]
    Unavailable(String),
}

/// Authenticates bearer tokens.
pub trait TokenAuthenticator: Send + Sync {
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Caller, AuthError>>;
}

/// Authenticates a gRPC request: the bearer token in its `authorization`
/// metadata when present (a token that fails never falls back to the
/// certificate), else the verified client-certificate identity of its TLS
/// connection (15012), else [`AuthError::MissingToken`].
///
/// On success the request's TLS connection counts as authenticated
/// ([`crate::tls_listener::mark_authenticated`]).
pub async fn authenticate_grpc<T>(
    auth: &dyn TokenAuthenticator,
    req: &tonic::Request<T>,
) -> Result<Caller, AuthError> {
    let caller = authenticate_request(auth, req).await?;
    crate::tls_listener::mark_authenticated(req);
    Ok(caller)
}

async fn authenticate_request<T>(
    auth: &dyn TokenAuthenticator,
    req: &tonic::Request<T>,
) -> Result<Caller, AuthError> {
    let header = req.metadata().get("authorization");
    if let Some(value) = header {
        let token = bearer_token(Some(value.to_str().map_err(|_| AuthError::Malformed)?))?;
        return auth.authenticate(token).await;
    }
    match crate::tls_listener::peer_identity(req) {
        Some(id) => Ok(Caller::Workload {
            namespace: id.namespace.clone(),
            service_account: id.service_account.clone(),
            node: None,
        }),
        None => Err(AuthError::MissingToken),
    }
}

/// A fixed token → caller map (tests, embedders).
#[derive(Debug, Default, Clone)]
pub struct StaticTokens {
    tokens: HashMap<String, Caller>,
}

impl StaticTokens {
    pub fn new(tokens: impl IntoIterator<Item = (String, Caller)>) -> Self {
        Self {
            tokens: tokens.into_iter().collect(),
        }
    }
}

impl TokenAuthenticator for StaticTokens {
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Caller, AuthError>> {
        Box::pin(async move {
            self.tokens
                .get(token)
                .cloned()
                .ok_or_else(|| AuthError::Rejected("not in the static token map".into()))
        })
    }
}

/// Extracts the token from an `authorization` header value.
pub(crate) fn bearer_token(value: Option<&str>) -> Result<&str, AuthError> {
    let value = value.ok_or(AuthError::MissingToken)?.trim();
    let (scheme, token) = value.split_once(' ').ok_or(AuthError::Malformed)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(AuthError::Malformed);
    }
    Ok(token)
}

/// Refuses every token: local mode without a node tokens file.
#[derive(Debug, Default, Clone)]
pub struct Unconfigured;

impl TokenAuthenticator for Unconfigured {
    fn authenticate<'a>(&'a self, _token: &'a str) -> BoxFuture<'a, Result<Caller, AuthError>> {
        Box::pin(async {
            Err(AuthError::Unavailable(
                "no token authentication is configured; in local mode start ambit-control \
                 with --node-tokens-file (one `<token> <node-name>` per line), in Kubernetes \
                 with --kubeconfig or --in-cluster (TokenReview)"
                    .into(),
            ))
        })
    }
}

/// Identifies a version of the tokens file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    mtime_ns: i128,
    ino: u64,
}

#[derive(Debug, Default)]
struct Loaded {
    stamp: Option<FileStamp>,
    /// token → node name.
    tokens: Arc<HashMap<String, String>>,
}

/// Local-mode node tokens, from a `<token> <node-name>` file.
#[derive(Debug)]
pub struct NodeTokenFile {
    path: PathBuf,
    loaded: Mutex<Loaded>,
}

impl NodeTokenFile {
    /// Reads `path` lazily on first use; a missing file authenticates no one
    /// until it appears.
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            loaded: Mutex::new(Loaded::default()),
        }
    }

    /// Parses the file format; malformed lines are skipped with a warning.
    pub fn parse(text: &str, path: &Path) -> HashMap<String, String> {
        let mut out = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            match (parts.next(), parts.next(), parts.next()) {
                (Some(token), Some(node), None) => {
                    out.insert(token.to_string(), node.to_string());
                }
                _ => tracing::warn!(file = %path.display(), line = i + 1,
                    "ignoring a malformed node token line; expected `<token> <node-name>`"),
            }
        }
        out
    }

    /// The current token map, re-reading the file if it changed.
    fn tokens(&self) -> Result<Arc<HashMap<String, String>>, AuthError> {
        let stamp = match std::fs::metadata(&self.path) {
            Ok(m) => Some(FileStamp {
                len: m.len(),
                mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
                ino: m.ino(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                return Err(AuthError::Unavailable(format!(
                    "cannot read the node tokens file {}: {e}",
                    self.path.display()
                )));
            }
        };
        let mut loaded = self
            .loaded
            .lock()
            .map_err(|_| AuthError::Unavailable("token cache poisoned".into()))?;
        if loaded.stamp != stamp || stamp.is_none() {
            let tokens = match stamp {
                None => HashMap::new(),
                Some(_) => match std::fs::read_to_string(&self.path) {
                    Ok(text) => Self::parse(&text, &self.path),
                    Err(e) => {
                        return Err(AuthError::Unavailable(format!(
                            "cannot read the node tokens file {}: {e}",
                            self.path.display()
                        )));
                    }
                },
            };
            if stamp.is_some() {
                tracing::info!(file = %self.path.display(), nodes = tokens.len(), "node tokens loaded");
            }
            loaded.stamp = stamp;
            loaded.tokens = Arc::new(tokens);
        }
        Ok(loaded.tokens.clone())
    }
}

/// Compares without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl TokenAuthenticator for NodeTokenFile {
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Caller, AuthError>> {
        Box::pin(async move {
            let tokens = self.tokens()?;
            // Scan all entries with a constant-time compare, so the time
            // taken does not reveal how much of a token matched.
            let mut found = None;
            for (t, node) in tokens.iter() {
                if constant_time_eq(t.as_bytes(), token.as_bytes()) {
                    found = Some(node.clone());
                }
            }
            match found {
                Some(name) => Ok(Caller::Node { name }),
                None => Err(AuthError::Rejected(format!(
                    "no entry in the node tokens file {}",
                    self.path.display()
                ))),
            }
        })
    }
}
