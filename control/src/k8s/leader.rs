//! Leader election through a `coordination.k8s.io/v1` Lease.
//!
//! Every replica serves xDS and signs certificates; only the leader
//! writes (status conditions, the CA root Secret). The algorithm is the
//! usual one: the holder renews `renewTime` every retry period; another
//! replica takes the Lease over once it has seen the same record, unchanged,
//! for the lease duration (by its own clock, so clock skew between nodes
//! does not matter); every write is an update with the record's
//! resourceVersion, so two replicas can never both win (the loser gets
//! `409 Conflict`). A leader that cannot renew within the renew deadline
//! (shorter than the duration) stops acting as leader before anyone can
//! take over. A replica shutting down releases the Lease so the next one
//! takes over at once.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::{K8sError, call, is_not_found};

/// Where the Lease is and how it is held.
#[derive(Debug, Clone)]
pub struct LeaseOptions {
    pub namespace: String,
    pub name: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a record holds without renewal.
    pub duration: Duration,
    /// A leader that could not renew for this long stops leading.
    pub renew_deadline: Duration,
    /// How often the Lease is renewed or tried.
    pub retry: Duration,
}

/// A running election. Dropping it stops taking part (without releasing).
pub struct LeaderElector {
    leader: watch::Receiver<bool>,
    task: JoinHandle<()>,
    api: Api<Lease>,
    opts: LeaseOptions,
}

impl std::fmt::Debug for LeaderElector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderElector")
            .field(
                "lease",
                &format!("{}/{}", self.opts.namespace, self.opts.name),
            )
            .field("identity", &self.opts.identity)
            .field("leader", &*self.leader.borrow())
            .finish()
    }
}

impl Drop for LeaderElector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl LeaderElector {
    /// Starts taking part in the election.
    pub fn spawn(client: Client, opts: LeaseOptions) -> LeaderElector {
        let api: Api<Lease> = Api::namespaced(client, &opts.namespace);
        let (tx, leader) = watch::channel(false);
        let task = tokio::spawn(run(api.clone(), opts.clone(), tx));
        LeaderElector {
            leader,
            task,
            api,
            opts,
        }
    }

    /// Whether this replica leads now.
    pub fn is_leader(&self) -> bool {
        *self.leader.borrow()
    }

    /// Follows leadership changes.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.leader.clone()
    }

    /// Stops taking part and, when leading, releases the Lease (holder
    /// cleared) so another replica takes over without waiting for it to
    /// expire.
    pub async fn release(self) {
        self.task.abort();
        if !self.is_leader() {
            return;
        }
        let what = format!("releasing Lease {}/{}", self.opts.namespace, self.opts.name);
        match call(what.clone(), self.api.get(&self.opts.name)).await {
            Ok(mut lease) => {
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                if spec.holder_identity.as_deref() != Some(self.opts.identity.as_str()) {
                    return;
                }
                spec.holder_identity = None;
                spec.lease_duration_seconds = Some(1);
                spec.renew_time = Some(MicroTime(Timestamp::now()));
                let r = call(
                    what,
                    self.api
                        .replace(&self.opts.name, &PostParams::default(), &lease),
                )
                .await;
                match r {
                    Ok(_) => info!(lease = %self.opts.name, "released the leader Lease"),
                    Err(e) => {
                        warn!(error = %e, "could not release the leader Lease; another replica takes over once it expires")
                    }
                }
            }
            Err(e) => {
                warn!(error = %e, "could not release the leader Lease; another replica takes over once it expires")
            }
        }
    }
}

/// The record last seen and when it was first seen (by this replica's clock).
struct Observed {
    record: (Option<String>, Option<String>, Option<String>),
    at: Instant,
}

fn record_of(lease: &Lease) -> (Option<String>, Option<String>, Option<String>) {
    let spec = lease.spec.as_ref();
    (
        spec.and_then(|s| s.holder_identity.clone()),
        spec.and_then(|s| s.renew_time.as_ref())
            .map(|t| t.0.to_string()),
        lease.metadata.resource_version.clone(),
    )
}

fn secs(d: Duration) -> i32 {
    i32::try_from(d.as_secs().max(1)).unwrap_or(i32::MAX)
}

async fn run(api: Api<Lease>, opts: LeaseOptions, tx: watch::Sender<bool>) {
    let mut observed: Option<Observed> = None;
    let mut last_renew: Option<Instant> = None;
    let mut tick = tokio::time::interval(opts.retry);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_error_log: Option<Instant> = None;
    loop {
        tick.tick().await;
        match try_acquire_or_renew(&api, &opts, &mut observed).await {
            Ok(true) => {
                last_renew = Some(Instant::now());
                if !*tx.borrow() {
                    info!(identity = %opts.identity, lease = %format!("{}/{}", opts.namespace, opts.name), "became the leader: this replica writes status and the CA Secret");
                    tx.send_replace(true);
                }
            }
            Ok(false) => {
                if *tx.borrow() {
                    warn!(identity = %opts.identity, "another replica holds the Lease now; stopped leading");
                    tx.send_replace(false);
                }
                last_renew = None;
            }
            Err(e) => {
                let now = Instant::now();
                if last_error_log.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(30)) {
                    last_error_log = Some(now);
                    warn!(error = %e, "leader election: cannot read or renew the Lease; retrying");
                } else {
                    debug!(error = %e, "leader election failed");
                }
            }
        }
        let expired = last_renew.is_none_or(|t| t.elapsed() > opts.renew_deadline);
        if *tx.borrow() && expired {
            warn!(identity = %opts.identity, deadline = ?opts.renew_deadline, "could not renew the Lease in time; stopped leading");
            tx.send_replace(false);
        }
    }
}

/// One round: Ok(true) when this replica holds the Lease afterwards.
async fn try_acquire_or_renew(
    api: &Api<Lease>,
    opts: &LeaseOptions,
    observed: &mut Option<Observed>,
) -> Result<bool, K8sError> {
    let what = format!("reading Lease {}/{}", opts.namespace, opts.name);
    let now = MicroTime(Timestamp::now());
    let lease = match tokio::time::timeout(super::API_CALL_TIMEOUT, api.get(&opts.name)).await {
        Err(_) => {
            return Err(K8sError::Timeout {
                what,
                limit: super::API_CALL_TIMEOUT,
            });
        }
        Ok(Err(e)) if is_not_found(&e) => {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(opts.name.clone()),
                    namespace: Some(opts.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(opts.identity.clone()),
                    lease_duration_seconds: Some(secs(opts.duration)),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            let created = call(
                format!("creating Lease {}/{}", opts.namespace, opts.name),
                api.create(&PostParams::default(), &lease),
            )
            .await;
            return match created {
                Ok(_) => Ok(true),
                // Another replica created it first.
                Err(e) if e.status_code() == Some(409) => Ok(false),
                Err(e) => Err(e),
            };
        }
        Ok(Err(source)) => return Err(K8sError::Api { what, source }),
        Ok(Ok(l)) => l,
    };
    let record = record_of(&lease);
    let fresh = match observed {
        Some(o) if o.record == record => o.at,
        _ => {
            let at = Instant::now();
            *observed = Some(Observed { record, at });
            at
        }
    };
    let spec = lease.spec.clone().unwrap_or_default();
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let duration = spec
        .lease_duration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(opts.duration, Duration::from_secs);
    let mine = holder == opts.identity;
    let expired = holder.is_empty() || fresh.elapsed() > duration;
    if !mine && !expired {
        return Ok(false);
    }
    let mut next = lease;
    let s = next.spec.get_or_insert_with(LeaseSpec::default);
    s.renew_time = Some(now.clone());
    s.lease_duration_seconds = Some(secs(opts.duration));
    if !mine {
        s.holder_identity = Some(opts.identity.clone());
        s.acquire_time = Some(now);
        s.lease_transitions = Some(s.lease_transitions.unwrap_or(0).saturating_add(1));
        info!(identity = %opts.identity, previous = %holder, "taking over the Lease");
    }
    let replaced = call(
        format!("updating Lease {}/{}", opts.namespace, opts.name),
        api.replace(&opts.name, &PostParams::default(), &next),
    )
    .await;
    match replaced {
        Ok(l) => {
            *observed = Some(Observed {
                record: record_of(&l),
                at: Instant::now(),
            });
            Ok(true)
        }
        // Someone else wrote first (renewed, or took it over).
        Err(e) if e.status_code() == Some(409) => Ok(false),
        Err(e) => Err(e),
    }
}
