//! Kubernetes TokenReview authentication for the CA and xDS.
//!
//! A caller's bearer token (a projected ServiceAccount token) is sent to
//! the API server's TokenReview with audience `istio-ca`; it must come back
//! authenticated, bound to that audience (`status.audiences`), for a
//! `system:serviceaccount:<namespace>:<name>` user. A bound token names its
//! pod (`authentication.kubernetes.io/pod-name` / `pod-uid` in the user's
//! extra); the pod's `spec.nodeName` from the watched pods is the caller's
//! node, which a node proxy's impersonation is checked against. A token
//! naming a pod that no longer exists (another uid) gets no node.
//!
//! Results are cached by token: accepted ones [`TokenReviewOptions::ttl`]
//! (unless the pod was not known yet), refusals
//! [`TokenReviewOptions::negative_ttl`]; API failures are not cached. At
//! most [`TokenReviewOptions::max_in_flight`] reviews run at once, each
//! bounded by [`TokenReviewOptions::timeout`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{TokenReview as Review, TokenReviewSpec};
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use super::auth::{AuthError, BoxFuture, Caller, TokenAuthenticator};
use crate::source::kube::PodIndex;

/// The user's extra key naming the pod a bound token belongs to.
pub const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";
/// The user's extra key with that pod's uid.
pub const POD_UID_EXTRA: &str = "authentication.kubernetes.io/pod-uid";

/// How TokenReview authentication behaves.
#[derive(Debug, Clone)]
pub struct TokenReviewOptions {
    /// The audience tokens must be bound to (`istio-ca`).
    pub audience: String,
    /// Deadline of one TokenReview (including the wait for a slot).
    pub timeout: Duration,
    /// How long an accepted token is trusted without asking again.
    pub ttl: Duration,
    /// How long a refused token is refused without asking again.
    pub negative_ttl: Duration,
    /// Tokens cached at most.
    pub max_cached: usize,
    /// Reviews running at once at most.
    pub max_in_flight: usize,
}

impl Default for TokenReviewOptions {
    fn default() -> Self {
        Self {
            audience: "istio-ca".into(),
            timeout: Duration::from_secs(5),
            ttl: Duration::from_secs(30),
            negative_ttl: Duration::from_secs(5),
            max_cached: 4096,
            max_in_flight: 32,
        }
    }
}

type Cached = (Instant, Result<Caller, AuthError>);

/// Authenticates ServiceAccount tokens with the API server.
pub struct TokenReview {
    api: Api<Review>,
    pods: Arc<PodIndex>,
    opts: TokenReviewOptions,
    cache: Mutex<HashMap<String, Cached>>,
    slots: Semaphore,
}

impl std::fmt::Debug for TokenReview {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenReview")
            .field("audience", &self.opts.audience)
            .finish_non_exhaustive()
    }
}

impl TokenReview {
    pub fn new(client: Client, pods: Arc<PodIndex>, opts: TokenReviewOptions) -> Self {
        Self {
            api: Api::all(client),
            pods,
            slots: Semaphore::new(opts.max_in_flight.max(1)),
            opts,
            cache: Mutex::new(HashMap::new()),
        }
    }

    fn cached(&self, token: &str) -> Option<Result<Caller, AuthError>> {
        let cache = self.cache.lock().ok()?;
        let (until, result) = cache.get(token)?;
        (Instant::now() < *until).then(|| result.clone())
    }

    fn remember(&self, token: &str, result: &Result<Caller, AuthError>, ttl: Duration) {
        let Ok(mut cache) = self.cache.lock() else {
            return;
        };
        let now = Instant::now();
        if cache.len() >= self.opts.max_cached {
            cache.retain(|_, (until, _)| *until > now);
            if cache.len() >= self.opts.max_cached {
                // Still full of live entries: start over rather than grow.
                cache.clear();
            }
        }
        cache.insert(token.to_string(), (now + ttl, result.clone()));
    }

    async fn review(&self, token: &str) -> Result<Caller, AuthError> {
        let unavailable = |what: String| {
            AuthError::Unavailable(format!(
                "{what}; check that the API server is reachable and that the control plane may create tokenreviews (ClusterRole ambit-control)"
            ))
        };
        let work = async {
            let _slot = self
                .slots
                .acquire()
                .await
                .map_err(|_| unavailable("the TokenReview limiter is closed".into()))?;
            let review = Review {
                spec: TokenReviewSpec {
                    token: Some(token.to_string()),
                    audiences: Some(vec![self.opts.audience.clone()]),
                },
                ..Review::default()
            };
            self.api
                .create(&PostParams::default(), &review)
                .await
                .map_err(|e| unavailable(format!("TokenReview failed: {e}")))
        };
        let answer = tokio::time::timeout(self.opts.timeout, work)
            .await
            .map_err(|_| {
                unavailable(format!(
                    "TokenReview did not answer within {:?}",
                    self.opts.timeout
                ))
            })??;
        self.judge(answer)
    }

    /// The caller an answered review names, or why it is refused.
    fn judge(&self, answer: Review) -> Result<Caller, AuthError> {
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Err(AuthError::Rejected(format!(
                "the API server did not authenticate the token ({}); send a current ServiceAccount token projected with audience {}",
                status.error.as_deref().unwrap_or("no reason given"),
                self.opts.audience
            )));
        }
        let bound = status
            .audiences
            .as_ref()
            .is_some_and(|a| a.contains(&self.opts.audience));
        if !bound {
            return Err(AuthError::Rejected(format!(
                "the token is not bound to audience {:?} (it is for {:?}); project the ServiceAccount token with `audience: {}`",
                self.opts.audience,
                status.audiences.unwrap_or_default(),
                self.opts.audience
            )));
        }
        let user = status.user.unwrap_or_default();
        let username = user.username.unwrap_or_default();
        let Some((namespace, service_account)) = username
            .strip_prefix("system:serviceaccount:")
            .and_then(|rest| rest.split_once(':'))
            .filter(|(ns, sa)| !ns.is_empty() && !sa.is_empty() && !sa.contains(':'))
        else {
            return Err(AuthError::Rejected(format!(
                "{username:?} is not a ServiceAccount; only ServiceAccount tokens are accepted"
            )));
        };
        let extra = user.extra.unwrap_or_default();
        let first = |k: &str| extra.get(k).and_then(|v| v.first()).cloned();
        let node = first(POD_NAME_EXTRA).and_then(|pod| {
            let placement = self.pods.get(namespace, &pod)?;
            let same_pod = first(POD_UID_EXTRA).is_none_or(|uid| uid == placement.uid);
            (same_pod && !placement.node.is_empty()).then_some(placement.node)
        });
        Ok(Caller::Workload {
            namespace: namespace.to_string(),
            service_account: service_account.to_string(),
            node,
        })
    }
}

impl TokenAuthenticator for TokenReview {
    fn authenticate<'a>(&'a self, token: &'a str) -> BoxFuture<'a, Result<Caller, AuthError>> {
        Box::pin(async move {
            if let Some(hit) = self.cached(token) {
                return hit;
            }
            let result = self.review(token).await;
            match &result {
                Ok(Caller::Workload { node: None, .. }) => {
                    // Its pod may not be watched yet: ask again next time.
                }
                Ok(_) => self.remember(token, &result, self.opts.ttl),
                Err(AuthError::Rejected(_)) => {
                    self.remember(token, &result, self.opts.negative_ttl)
                }
                Err(_) => {}
            }
            result
        })
    }
}
