//! The checks, one module per concern; each appends [`Message`]s.

use super::Mesh;
use super::message::Message;

mod fields;
mod model;
mod security;
mod traffic;

pub(super) fn run(mesh: &Mesh, out: &mut Vec<Message>) {
    fields::unknown_fields(mesh, out);
    fields::istio_labels(mesh, out);
    traffic::run(mesh, out);
    security::run(mesh, out);
    model::findings(mesh, out);
}
