//! Envoy resources of a hand-built waypoint plan.
