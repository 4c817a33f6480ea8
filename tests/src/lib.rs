//! Shared test-bed helpers for Ambit's integration tests and benchmarks:
//! fixture directories, in-process control planes, tiny HTTP client.
#![forbid(unsafe_code)]

pub mod agentbed;
pub mod cluster;
pub mod enrollbed;
pub mod envoy;
pub mod fakeapi;
pub mod h2raw;
pub mod httpapp;
pub mod kubeapi;
pub mod kubebed;
pub mod meshbed;
pub mod netbed;
pub mod otlp;
pub mod sidecarpod;
pub mod traffic;
pub mod waypointpod;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Copies every file of `src` (one level) into a fresh temporary directory.
pub fn copy_fixture(src: &Path) -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir().context("creating a temporary config dir")?;
    for entry in std::fs::read_dir(src).with_context(|| format!("reading {}", src.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            std::fs::copy(entry.path(), dir.path().join(entry.file_name()))?;
        }
    }
    Ok(dir)
}

/// Writes `contents` to `path` atomically (write + rename), as editors do,
/// so a watcher never reads half a file.
pub fn write_atomic(path: &Path, contents: &str) -> Result<()> {
    let tmp = path.with_extension("tmp~");
    std::fs::write(&tmp, contents)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// One HTTP/1.1 request on a fresh connection; returns (status, body).
pub async fn http(addr: SocketAddr, method: &str, path: &str) -> Result<(u16, String)> {
    let s = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(addr))
        .await
        .with_context(|| format!("connecting to {addr} timed out"))?
        .with_context(|| format!("connecting to {addr}"))?;
    http_on(s, addr, method, path).await
}

/// One HTTP/1.1 request on `s`, a fresh connection to `addr` (made from
/// wherever the caller needs, e.g. inside a pod); returns (status, body).
pub async fn http_on(
    mut s: TcpStream,
    addr: SocketAddr,
    method: &str,
    path: &str,
) -> Result<(u16, String)> {
    let fut = async {
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text
            .split_once("\r\n\r\n")
            .context("response without header end")?;
        let status: u16 = head
            .split_whitespace()
            .nth(1)
            .context("response without status")?
            .parse()?;
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(body)?
        } else {
            body.to_string()
        };
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .with_context(|| format!("{method} http://{addr}{path} timed out"))?
}

/// Decodes a chunked HTTP/1.1 body.
pub fn dechunk_body(body: &str) -> Result<String> {
    dechunk(body)
}

fn dechunk(mut body: &str) -> Result<String> {
    let mut out = String::new();
    loop {
        let (len, rest) = body.split_once("\r\n").context("bad chunk")?;
        let len = usize::from_str_radix(len.trim(), 16)?;
        if len == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..len).context("short chunk")?);
        body = rest.get(len + 2..).context("short chunk")?;
    }
}

/// GET returning the body, failing on a non-200 status.
pub async fn get(addr: SocketAddr, path: &str) -> Result<String> {
    let (status, body) = http(addr, "GET", path).await?;
    if status != 200 {
        bail!("GET {path} on {addr}: status {status}: {body}");
    }
    Ok(body)
}

/// Polls `check` every 5 ms until it returns `Some`, or fails after `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if start.elapsed() > limit {
            bail!("{what}: not reached within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
