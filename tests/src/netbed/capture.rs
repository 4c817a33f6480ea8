//! Raw packet capture inside a network namespace, to check what crosses the
//! wire (e.g. that pod-to-pod payloads between nodes are encrypted).
//!
//! An `AF_PACKET` socket sees every frame sent or received on every
//! interface of the namespace it was created in. Capture in the cluster's
//! `lan` namespace to see all inter-node traffic; a frame bridged there is
//! seen once entering and once leaving the bridge.

use std::io::{ErrorKind, Read};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ambit_inpod::PodNetns;
use anyhow::{Context, Result};
use socket2::{Domain, Protocol, Socket, Type};

/// Bytes kept at most; later frames are counted but dropped.
pub const MAX_CAPTURE_BYTES: usize = 64 << 20;
/// `ETH_P_ALL`: every protocol (passed in network byte order).
const ETH_P_ALL: u16 = 0x0003;
/// How often the reader looks at the stop flag when the wire is quiet.
const READ_TIMEOUT: Duration = Duration::from_millis(50);
/// After `stop`, the longest the reader keeps draining a busy socket.
const DRAIN_LIMIT: Duration = Duration::from_secs(1);

/// A running capture; frames accumulate until [`Capture::stop`].
pub struct Capture {
    netns: String,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("netns", &self.netns)
            .field("bytes", &self.bytes())
            .field("frames", &self.frames())
            .finish()
    }
}

#[derive(Default)]
struct Shared {
    data: Mutex<Vec<u8>>,
    frames: AtomicUsize,
    dropped: AtomicUsize,
}

impl Shared {
    fn data(&self) -> MutexGuard<'_, Vec<u8>> {
        // The reader never panics while holding the lock; never panic here either.
        self.data.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Capture {
    /// Starts capturing every frame in network namespace `netns` (a name
    /// under `/var/run/netns`).
    pub fn start(netns: &str) -> Result<Capture> {
        let path = super::netns_path(netns);
        let ns = PodNetns::open(&path)
            .with_context(|| format!("capture: opening netns {}", path.display()))?;
        let sock = ns
            .run_in(|| {
                let sock = Socket::new(
                    Domain::PACKET,
                    Type::RAW,
                    Some(Protocol::from(i32::from(ETH_P_ALL.to_be()))),
                )?;
                sock.set_read_timeout(Some(READ_TIMEOUT))?;
                // Best effort: a bigger queue rides out bursts; capped by rmem_max.
                let _ = sock.set_recv_buffer_size(8 << 20);
                Ok(sock)
            })
            .with_context(|| format!("capture: AF_PACKET socket in netns {netns}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared::default());
        let thread = std::thread::Builder::new()
            .name(format!("capture-{netns}"))
            .spawn({
                let stop = stop.clone();
                let shared = shared.clone();
                move || read_frames(&sock, &stop, &shared)
            })
            .context("capture: spawning the reader thread")?;
        Ok(Capture {
            netns: netns.to_string(),
            stop,
            shared,
            thread: Some(thread),
        })
    }

    /// Bytes captured so far.
    pub fn bytes(&self) -> usize {
        self.shared.data().len()
    }

    /// Frames seen so far (including any dropped past [`MAX_CAPTURE_BYTES`]).
    pub fn frames(&self) -> usize {
        self.shared.frames.load(Ordering::Relaxed)
    }

    /// Whether the bytes captured so far contain `needle`.
    pub fn seen(&self, needle: &[u8]) -> bool {
        contains(&self.shared.data(), needle)
    }

    /// Stops the capture after draining frames already queued, and returns
    /// all raw frames concatenated (Ethernet headers included).
    pub fn stop(mut self) -> Vec<u8> {
        self.halt();
        std::mem::take(&mut *self.shared.data())
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let dropped = self.shared.dropped.load(Ordering::Relaxed);
        if dropped > 0 {
            println!(
                "capture in {}: {dropped} frames dropped past {MAX_CAPTURE_BYTES} bytes",
                self.netns
            );
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.halt();
    }
}

fn read_frames(sock: &Socket, stop: &AtomicBool, shared: &Shared) {
    // Large enough for GSO super-frames on veths (up to 64 KiB and more).
    let mut buf = vec![0u8; 256 * 1024];
    let mut draining_since: Option<Instant> = None;
    let mut reader = sock;
    loop {
        match reader.read(&mut buf) {
            Ok(n) => {
                shared.frames.fetch_add(1, Ordering::Relaxed);
                let mut data = shared.data();
                if data.len() + n <= MAX_CAPTURE_BYTES {
                    data.extend_from_slice(&buf[..n]);
                } else {
                    shared.dropped.fetch_add(1, Ordering::Relaxed);
                }
                drop(data);
                if stop.load(Ordering::Relaxed) {
                    let since = *draining_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > DRAIN_LIMIT {
                        return;
                    }
                }
            }
            // Queue empty: everything sent before `stop` has been read.
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
            }
            Err(e) => {
                println!("capture: reading frames failed: {e}");
                return;
            }
        }
    }
}

/// Whether `needle` occurs in `haystack` (an empty needle always does).
pub fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    needle.is_empty() || haystack.windows(needle.len()).any(|w| w == needle)
}
