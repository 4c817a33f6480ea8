//! One shutdown signal for every task and listener of a ztunnel.
//!
//! [`DrainTrigger::start`] (or dropping the trigger) tells every
//! [`DrainWatcher`] to stop: listeners stop accepting, live connections get
//! the watcher's [`DrainWatcher::deadline`] to finish (ztunnel's is
//! `--drain-timeout-secs`, long enough for a rolling update to keep
//! established connections; [`DRAIN_DEADLINE`] elsewhere), then they are
//! closed.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::watch;

/// How long a live connection may keep running once draining has
/// started, unless the channel was made with another deadline.
pub const DRAIN_DEADLINE: Duration = Duration::from_secs(5);

/// Starts draining. Dropping it drains too, so a dropped ztunnel stops.
#[derive(Debug)]
pub struct DrainTrigger {
    tx: watch::Sender<bool>,
}

/// Waits for draining to start. Cheap to clone.
#[derive(Debug, Clone)]
pub struct DrainWatcher {
    rx: watch::Receiver<bool>,
    deadline: Duration,
}

/// A new trigger and its first watcher, with [`DRAIN_DEADLINE`].
pub fn channel() -> (DrainTrigger, DrainWatcher) {
    channel_with(DRAIN_DEADLINE)
}

/// A new trigger and its first watcher: live connections get `deadline`
/// once draining starts.
pub fn channel_with(deadline: Duration) -> (DrainTrigger, DrainWatcher) {
    let (tx, rx) = watch::channel(false);
    (DrainTrigger { tx }, DrainWatcher { rx, deadline })
}

impl DrainTrigger {
    /// Tells every watcher to stop.
    pub fn start(&self) {
        self.tx.send_replace(true);
    }
}

impl DrainWatcher {
    /// Resolves once draining has started (or the trigger is gone).
    pub async fn signaled(&self) {
        let mut rx = self.rx.clone();
        // An error means the trigger was dropped, which also means "stop".
        let _ = rx.wait_for(|draining| *draining).await;
    }

    /// Like [`DrainWatcher::signaled`], owning the watcher: a `'static`
    /// shutdown future for APIs that take one (e.g. `ambit_inpod::ZdsClient::run`).
    pub async fn wait(self) {
        self.signaled().await
    }

    /// How long live connections get once draining has started.
    pub fn deadline(&self) -> Duration {
        self.deadline
    }

    /// True once draining has started.
    pub fn is_draining(&self) -> bool {
        *self.rx.borrow() || self.rx.has_changed().is_err()
    }
}

/// Runs `conn` to completion unless draining starts; then calls `graceful`
/// on it (e.g. hyper's `graceful_shutdown`) and gives it the watcher's
/// deadline before dropping it.
pub async fn run_until_drained<F, G>(mut conn: Pin<&mut F>, drain: &DrainWatcher, graceful: G)
where
    F: Future,
    G: FnOnce(Pin<&mut F>),
{
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = drain.signaled() => {}
    }
    graceful(conn.as_mut());
    let _ = tokio::time::timeout(drain.deadline(), conn).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn watchers_see_start_and_drop() {
        let (trigger, watcher) = channel();
        assert!(!watcher.is_draining());
        let w2 = watcher.clone();
        trigger.start();
        tokio::time::timeout(Duration::from_secs(1), w2.signaled())
            .await
            .unwrap_or_else(|_| panic!("watcher did not see start"));
        assert!(watcher.is_draining());

        let (trigger, watcher) = channel();
        drop(trigger);
        tokio::time::timeout(Duration::from_secs(1), watcher.signaled())
            .await
            .unwrap_or_else(|_| panic!("watcher did not see drop"));
        assert!(watcher.is_draining());
    }
}
