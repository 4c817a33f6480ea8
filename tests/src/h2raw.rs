//! A deliberately misbehaving HTTP/2 client for the security tests: it
//! writes raw frames over an established TLS connection, ignoring the
//! server's SETTINGS (a conforming client, like h2's, would queue streams
//! past the server's limit instead of sending them), and tallies what the
//! server answers.
//!
//! Only what the tests need: the connection preface, an empty SETTINGS,
//! `CONNECT` HEADERS blocks (HPACK literals without indexing or Huffman),
//! and a reader that counts response HEADERS, RST_STREAM codes and GOAWAY.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;
/// `REFUSED_STREAM` (RFC 9113 §7).
pub const REFUSED_STREAM: u32 = 0x7;
/// `COMPRESSION_ERROR`.
pub const COMPRESSION_ERROR: u32 = 0x9;
/// `ENHANCE_YOUR_CALM`.
pub const ENHANCE_YOUR_CALM: u32 = 0xb;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len())
        .unwrap_or(u32::MAX)
        .to_be_bytes();
    let mut f = Vec::with_capacity(9 + payload.len());
    f.extend_from_slice(&len[1..]);
    f.push(kind);
    f.push(flags);
    f.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// An HPACK string literal (no Huffman); lengths up to 2^21.
fn hpack_string(out: &mut Vec<u8>, s: &[u8]) {
    let mut n = s.len();
    if n < 127 {
        out.push(n as u8);
    } else {
        out.push(127);
        n -= 127;
        while n >= 128 {
            out.push((n % 128) as u8 | 0x80);
            n /= 128;
        }
        out.push(n as u8);
    }
    out.extend_from_slice(s);
}

/// A `CONNECT authority` header block: `:method` (static index 2) and
/// `:authority` (index 1) as literals without indexing, then `extra`
/// headers as literals with new names.
pub fn connect_block(authority: &str, extra: &[(&str, &[u8])]) -> Vec<u8> {
    let mut b = vec![0x02];
    hpack_string(&mut b, b"CONNECT");
    b.push(0x01);
    hpack_string(&mut b, authority.as_bytes());
    for (name, value) in extra {
        b.push(0x00);
        hpack_string(&mut b, name.as_bytes());
        hpack_string(&mut b, value);
    }
    b
}

/// What the server answered.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Streams that got a response HEADERS frame.
    pub responses: usize,
    /// RST_STREAM error codes and how many streams got each.
    pub resets: BTreeMap<u32, usize>,
    /// The GOAWAY error code, if the server closed the connection.
    pub goaway: Option<u32>,
    /// Whether the connection ended (EOF or error) while reading.
    pub closed: bool,
}

impl Tally {
    /// Streams answered one way or the other.
    pub fn answered(&self) -> usize {
        self.responses + self.resets.values().sum::<usize>()
    }
}

/// A raw HTTP/2 client connection.
pub struct RawH2<S> {
    io: S,
    next_stream: u32,
}

impl<S: AsyncRead + AsyncWrite + Unpin> RawH2<S> {
    /// Sends the preface and an empty SETTINGS.
    pub async fn start(mut io: S) -> Result<Self> {
        io.write_all(PREFACE).await?;
        io.write_all(&frame(SETTINGS, 0, 0, &[])).await?;
        io.flush().await?;
        Ok(Self { io, next_stream: 1 })
    }

    /// Opens a stream with header `block` (split into HEADERS of at most
    /// 16 KiB; the rest is not supported), without END_STREAM, ignoring
    /// any limit. Returns its id.
    pub async fn open(&mut self, block: &[u8]) -> Result<u32> {
        if block.len() > 16 * 1024 {
            bail!(
                "header block of {} bytes: over 16 KiB is not supported",
                block.len()
            );
        }
        let id = self.next_stream;
        self.next_stream += 2;
        self.io
            .write_all(&frame(HEADERS, END_HEADERS, id, block))
            .await?;
        Ok(id)
    }

    /// Opens a stream whose header `block` is split into a HEADERS frame
    /// and CONTINUATION frames of `frame_len` bytes each (what a client
    /// does before it has seen the server's larger SETTINGS_MAX_FRAME_SIZE).
    /// Stops quietly when the server closes the connection part way;
    /// returns how many frames were written.
    pub async fn open_split(&mut self, block: &[u8], frame_len: usize) -> usize {
        let id = self.next_stream;
        self.next_stream += 2;
        let chunks: Vec<&[u8]> = block.chunks(frame_len.max(1)).collect();
        let last = chunks.len().saturating_sub(1);
        for (i, chunk) in chunks.iter().enumerate() {
            let kind = if i == 0 { HEADERS } else { CONTINUATION };
            let flags = if i == last { END_HEADERS } else { 0 };
            let written = async {
                self.io.write_all(&frame(kind, flags, id, chunk)).await?;
                self.io.flush().await
            };
            if written.await.is_err() {
                return i;
            }
        }
        chunks.len()
    }

    /// Flushes what was written.
    pub async fn flush(&mut self) -> Result<()> {
        Ok(self.io.flush().await?)
    }

    /// Reads frames until `done(tally)` holds, the connection ends, or
    /// `limit` passes; SETTINGS are acknowledged.
    pub async fn read_until(
        &mut self,
        limit: Duration,
        done: impl Fn(&Tally) -> bool,
    ) -> Result<Tally> {
        let mut tally = Tally::default();
        let deadline = tokio::time::Instant::now() + limit;
        while !done(&tally) {
            let mut head = [0u8; 9];
            let read = tokio::time::timeout_at(deadline, self.io.read_exact(&mut head)).await;
            match read {
                Err(_) => break,
                Ok(Err(_)) => {
                    tally.closed = true;
                    break;
                }
                Ok(Ok(_)) => {}
            }
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            let mut payload = vec![0u8; len];
            tokio::time::timeout_at(deadline, self.io.read_exact(&mut payload))
                .await
                .context("frame payload timed out")??;
            match head[3] {
                HEADERS => tally.responses += 1,
                RST_STREAM if len >= 4 => {
                    let code = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    *tally.resets.entry(code).or_default() += 1;
                }
                GOAWAY if len >= 8 => {
                    let code = u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
                    tally.goaway = Some(code);
                }
                SETTINGS if head[4] & ACK == 0 => {
                    // Best effort: the server may have closed its side.
                    let ack = async {
                        self.io.write_all(&frame(SETTINGS, ACK, 0, &[])).await?;
                        self.io.flush().await
                    };
                    let _ = ack.await;
                }
                _ => {}
            }
        }
        Ok(tally)
    }
}
