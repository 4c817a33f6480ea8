//! What a pod with an injected sidecar has beyond a waypoint pod: the
//! capture `istio-init` installs (`ambit-agent redirect`), which exempts
//! the proxy's own group. The agent and Envoy are run like a waypoint's
//! ([`crate::waypointpod`], kind `sidecar`).

use anyhow::{Context, Result};

use crate::agentbed::agent_binary;
use crate::netbed::{self, PodNet};

/// The proxy's group id: the capture lets its connections through.
pub const PROXY_GID: u32 = 1337;

/// Runs `ambit-agent redirect` inside `pod`'s netns, as the injected init
/// container does.
pub fn install_capture(pod: &PodNet) -> Result<()> {
    let bin = agent_binary()?;
    let bin = bin.to_str().context("agent binary path is not UTF-8")?;
    netbed::netns_exec(&pod.netns, &[bin, "redirect"])
        .with_context(|| format!("installing the sidecar capture in pod {}", pod.name))?;
    Ok(())
}
