//! Waypoints in Kubernetes, as Istio's gateway deployment controller runs
//! them: for each Gateway of class `istio-waypoint` or `ambit-waypoint`,
//! the leader keeps a ServiceAccount, a Deployment of the proxy image and a
//! ClusterIP Service (`objects.rs`, all owned by the Gateway) and the
//! Gateway's `Accepted`/`Programmed` status and addresses (`status.rs`),
//! from watches of the three (`controller.rs`).

mod controller;
pub mod objects;
pub mod status;

pub use controller::{FIELD_MANAGER, WaypointOptions, run};
