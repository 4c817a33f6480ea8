#!/usr/bin/env bash
# The README's main command. On a fresh Debian/Ubuntu host (as root, with the
# Rust toolchain): installs what is missing (iproute2, iptables, the CNI
# reference plugins), builds Ambit, brings up the demo mesh — two nodes and the
# AI platform of deploy/local/demo — with `ambitctl local up`, lets traffic flow
# and shows it. The mesh keeps running; `scripts/demo.sh --down` removes it.
#
# Usage: scripts/demo.sh [CONFIG_DIR]   |   scripts/demo.sh --down
set -euo pipefail
cd "$(dirname "$0")/.."
name=ambit
ctl=target/release/ambitctl

if [ "${1:-}" = "--down" ]; then
  exec "$ctl" local down --name "$name"
fi
dir=${1:-deploy/local/demo}

if [ "$(id -u)" != 0 ]; then
  echo "run as root (sudo -E scripts/demo.sh): the local mesh builds network namespaces and iptables rules"
  exit 1
fi
missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v iptables >/dev/null || missing+=(iptables)
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] || missing+=(containernetworking-plugins)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "==> installing ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
command -v cargo >/dev/null || { echo "cargo is missing: install Rust from https://rustup.rs"; exit 1; }

echo "==> building (release): ambit-control, ztunnel, ambit-node-agent, ambit-cni, ambitctl, ambit-demo"
cargo build --release --locked -p ambit-control -p ambitctl -p ambit-ztunnel -p ambit-cni -p ambit-tests --bins

# A previous run (or a crashed one) is removed first.
"$ctl" local down --name "$name" >/dev/null 2>&1 || true
echo "==> bringing up the local mesh from $dir"
"$ctl" local up "$dir" --name "$name"

echo
echo "==> letting the demo apps call each other for a few seconds"
sleep 5
"$ctl" local status --name "$name"

echo
echo "==> one request through the chain: orchestrator → embedding → vector-db and orchestrator → llm (all mTLS)"
"$ctl" local exec --name "$name" ai-inference/orchestrator-0 -- \
  ambit-demo --call http://10.96.0.10/ask --once
echo
echo "==> the legacy client (outside the mesh) calling the orchestrator in plaintext: refused by STRICT mTLS"
if "$ctl" local exec --name "$name" legacy/legacy-client -- \
  ambit-demo --call http://10.10.1.10:8080/ask --once; then
  echo "unexpected: the plaintext call was accepted"; exit 1
fi
echo
echo "The mesh keeps running. Look around:"
echo "  $ctl local status                 # nodes, pods, recent connections (mTLS or not)"
echo "  $ctl local exec legacy/legacy-web -- ip addr"
echo "  edit $dir/*.yaml                  # applied live (labels, policies)"
echo "Remove every namespace, process and file it made: scripts/demo.sh --down"
