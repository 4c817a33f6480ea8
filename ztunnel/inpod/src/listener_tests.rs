//! Regression tests (issue 14): a ztunnel taking pods over from another one
//! must be able to bind the in-pod ports while the other still listens and
//! while connections it accepted sit in TIME_WAIT. No root needed: the
//! kernel's rules are the same on loopback in the test's own namespace.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::netns::listener_socket;

/// A listener with only the given reuse options, as another ztunnel (or an
/// older Ambit) makes it.
fn foreign_listener(addr: SocketAddr, reuse_addr: bool, reuse_port: bool) -> TcpListener {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP)).unwrap();
    sock.set_reuse_address(reuse_addr).unwrap();
    sock.set_reuse_port(reuse_port).unwrap();
    sock.bind(&SockAddr::from(addr)).unwrap();
    sock.listen(16).unwrap();
    sock.into()
}

/// Accepts one connection on `listener` and closes it from the server side
/// first, so the server's socket on the listener's port ends in TIME_WAIT
/// (carrying the listener's options); then closes the listener.
fn leave_time_wait(listener: TcpListener) {
    let addr = listener.local_addr().unwrap();
    let mut client = TcpStream::connect(addr).unwrap();
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let (server, _) = listener.accept().unwrap();
    drop(server);
    let mut buf = [0u8; 8];
    assert_eq!(client.read(&mut buf).unwrap(), 0, "server closed first");
    drop(client);
    drop(listener);
}

#[test]
fn a_second_ztunnel_binds_beside_a_live_one() {
    let first = listener_socket("127.0.0.1:0".parse().unwrap(), false).unwrap();
    let addr = first.local_addr().unwrap();
    let second = listener_socket(addr, false);
    assert!(
        second.is_ok(),
        "the new ztunnel's bind must not collide with the old one's live listener: {second:?}"
    );
}

#[test]
fn time_wait_left_by_a_reuseport_only_listener_does_not_block_the_bind() {
    // Istio's ztunnel sets SO_REUSEPORT only.
    let old = foreign_listener("127.0.0.1:0".parse().unwrap(), false, true);
    let addr = old.local_addr().unwrap();
    leave_time_wait(old);
    let bound = listener_socket(addr, false);
    assert!(
        bound.is_ok(),
        "TIME_WAIT on {addr} from a SO_REUSEPORT listener blocked the bind: {bound:?}"
    );
}

#[test]
fn time_wait_left_by_a_reuseaddr_only_listener_does_not_block_the_bind() {
    let old = foreign_listener("127.0.0.1:0".parse().unwrap(), true, false);
    let addr = old.local_addr().unwrap();
    leave_time_wait(old);
    let bound = listener_socket(addr, false);
    assert!(
        bound.is_ok(),
        "TIME_WAIT on {addr} from a SO_REUSEADDR listener blocked the bind: {bound:?}"
    );
}

#[test]
fn a_port_held_by_a_foreign_listener_still_fails_clearly() {
    // A listener without either option is not ztunnel's: refuse, naming it.
    let other = foreign_listener("127.0.0.1:0".parse().unwrap(), false, false);
    let addr = other.local_addr().unwrap();
    let err = listener_socket(addr, false).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse);
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}
