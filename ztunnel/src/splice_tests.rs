#![allow(clippy::unwrap_used, clippy::expect_used)]

//! One direction of the splice relay on loopback pairs; the whole relay's
//! contract (payload, half-close, reset) is tested beside the buffered copy
//! in `copy.rs`.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::timeout;

use super::*;
use crate::test_support::loopback_pair as pair;
use std::future::poll_fn;

const WAIT: Duration = Duration::from_secs(30);

/// Polls `d` from `src` to `dst` until `done(d)` holds.
async fn drive(
    d: &mut Direction,
    src: &TcpStream,
    dst: &TcpStream,
    mut done: impl FnMut(&Direction) -> bool,
) {
    let run = poll_fn(|cx| {
        if let Poll::Ready(r) = d.poll_relay(cx, src, dst) {
            r.map_err(|(_, e)| e).unwrap();
        }
        if done(d) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    });
    timeout(WAIT, run).await.unwrap();
}

/// Whether `d` holds nothing, a buffer or a pipe.
fn held(d: &Direction) -> &'static str {
    match d.held {
        None => "nothing",
        Some(Held::Buffer(_)) => "a buffer",
        Some(Held::Pipe(..)) => "a pipe",
    }
}

#[tokio::test]
async fn small_messages_use_no_pipe_and_bulk_moves_to_one_until_eof() {
    let (mut client, src) = pair().await;
    let (dst, mut server) = pair().await;
    let mut d = Direction::default();

    // Nothing sent yet, then a small message: nothing held once idle.
    let idle = poll_fn(|cx| Poll::Ready(d.poll_relay(cx, &src, &dst).is_pending())).await;
    assert!(idle);
    assert_eq!(held(&d), "nothing");
    client.write_all(b"hello").await.unwrap();
    drive(&mut d, &src, &dst, |d| d.copied == 5).await;
    let idle = poll_fn(|cx| Poll::Ready(d.poll_relay(cx, &src, &dst).is_pending())).await;
    assert!(idle);
    assert_eq!(held(&d), "nothing", "an idle direction kept its buffer");
    assert!(!d.bulk);
    let mut got = [0u8; 5];
    server.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"hello");

    // A burst that fills the buffer: the direction turns bulk and splices.
    let burst = vec![7u8; 1024 * 1024];
    let reader = tokio::spawn(async move {
        let mut got = vec![0u8; 1024 * 1024];
        server.read_exact(&mut got).await.unwrap();
        (server, got)
    });
    let sent = burst.clone();
    let writer = tokio::spawn(async move {
        client.write_all(&sent).await.unwrap();
        client
    });
    drive(&mut d, &src, &dst, |d| d.copied == 5 + 1024 * 1024).await;
    let mut client = timeout(WAIT, writer).await.unwrap().unwrap();
    let (mut server, got) = timeout(WAIT, reader).await.unwrap().unwrap();
    assert!(got == burst);
    assert!(d.bulk);
    assert_eq!(held(&d), "a pipe");

    // EOF: the pipe is closed and the server reads EOF too.
    client.shutdown().await.unwrap();
    drive(&mut d, &src, &dst, |d| d.done).await;
    assert_eq!(held(&d), "nothing", "the pipe outlived the direction");
    let mut rest = Vec::new();
    timeout(WAIT, server.read_to_end(&mut rest))
        .await
        .unwrap()
        .unwrap();
    assert!(rest.is_empty());
}

#[tokio::test]
async fn without_a_pipe_a_bulk_direction_copies_through_a_buffer() {
    let (mut client, src) = pair().await;
    let (dst, mut server) = pair().await;
    // What a direction does once `new_pipe` failed (out of fds).
    let mut d = Direction {
        no_pipe: true,
        ..Direction::default()
    };
    const LEN: usize = 4 * 1024 * 1024;
    let data: Vec<u8> = (0..LEN).map(|i| (i * 7 % 253) as u8).collect();
    let sent = data.clone();
    let writer = tokio::spawn(async move {
        client.write_all(&sent).await.unwrap();
        client.shutdown().await.unwrap();
    });
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        got
    });
    let mut saw_pipe = false;
    drive(&mut d, &src, &dst, |d| {
        saw_pipe |= matches!(d.held, Some(Held::Pipe(..)));
        d.done
    })
    .await;
    writer.await.unwrap();
    let got = timeout(WAIT, reader).await.unwrap().unwrap();
    assert_eq!(d.copied, LEN as u64);
    assert!(d.bulk);
    assert!(!saw_pipe);
    assert!(got == data, "payload corrupted");
}
