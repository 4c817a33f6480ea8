//! ZDS datagrams (`ambit_inpod::zds`): the same bytes as a
//! `WorkloadRequest` (what ztunnel reads from the node agent), a
//! `WorkloadResponse` ack and a `ZdsHello` (what the agent reads from
//! ztunnel).
//!
//! Checks: no panic; a request that decodes encodes back to a request that
//! decodes to the same message (what the agent sends is what ztunnel
//! reads); an ack that decodes round-trips too.
#![no_main]

use ambit_inpod::zds::{
    ZdsMessage, decode_ack, decode_hello, decode_request, encode_ack, encode_hello, encode_request,
};
use ambit_proto::workload::zds::WorkloadInfo;
use libfuzzer_sys::fuzz_target;

fn seeds() -> Vec<(String, Vec<u8>)> {
    let info = WorkloadInfo {
        name: "web-1".into(),
        namespace: "demo".into(),
        service_account: "web".into(),
    };
    vec![
        (
            "add".into(),
            encode_request(&ZdsMessage::Add {
                uid: "0b5f6d2e-3c1a-4e8b-9f7a-2d4c6e8a0b1c".into(),
                info,
            }),
        ),
        (
            "keep".into(),
            encode_request(&ZdsMessage::Keep { uid: "u-1".into() }),
        ),
        (
            "del".into(),
            encode_request(&ZdsMessage::Del { uid: "u-1".into() }),
        ),
        (
            "snapshot-sent".into(),
            encode_request(&ZdsMessage::SnapshotSent),
        ),
        ("ack-ok".into(), encode_ack("")),
        (
            "ack-error".into(),
            encode_ack("AddWorkload for uid \"u-1\" came without the pod's netns fd"),
        ),
        ("hello".into(), encode_hello()),
    ]
}

fuzz_target!(
    init: {
        if let Some(dir) = ambit_fuzz::seeds_requested() {
            ambit_fuzz::write_seeds(&dir, seeds());
        }
    },
    |data: &[u8]| {
        if let Ok(msg) = decode_request(data) {
            let again = decode_request(&encode_request(&msg));
            assert_eq!(again.as_ref(), Ok(&msg));
        }
        if let Ok(error) = decode_ack(data) {
            assert_eq!(decode_ack(&encode_ack(&error)).ok(), Some(error));
        }
        let _ = decode_hello(data);
    }
);
