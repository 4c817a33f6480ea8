#!/usr/bin/env bash
# Builds Ambit, starts the control plane on the demo config and one ztunnel
# for node-1, and prints the mesh as that ztunnel sees it. Stops both on exit.
# Usage: scripts/demo.sh [CONFIG_DIR] [--keep]   (--keep leaves them running until Ctrl-C)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=deploy/local/demo
keep=
for arg in "$@"; do
  case "$arg" in
    --keep) keep=--keep ;;
    *) dir=$arg ;;
  esac
done
state=$(mktemp -d /tmp/ambit-demo.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

echo "==> building (release)"
cargo build --release --locked -p ambit-control -p ambit-ztunnel

# A per-node bootstrap token, as the local mesh tooling writes them.
token=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
echo "$token node-1" >"$state/node-tokens"
echo "$token" >"$state/node-1.token"

echo "==> starting ambit-control on $dir (xDS+CA TLS 127.0.0.1:15012, plaintext 127.0.0.1:15010, debug 127.0.0.1:15014)"
target/release/ambit-control --config-dir "$dir" --data-dir "$state/data" \
  --node-tokens-file "$state/node-tokens" --xds-tls-addr 127.0.0.1:15012 \
  >"$state/control.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do
  [ -s "$state/data/ca/root-cert.pem" ] && curl -fsS http://127.0.0.1:15014/ready >/dev/null 2>&1 && break
  sleep 0.1
done
echo "==> starting ztunnel for node-1 over TLS (admin 127.0.0.1:15000, metrics :15020, ready :15021)"
target/release/ztunnel --xds-address https://127.0.0.1:15012 --node-name node-1 \
  --token-file "$state/node-1.token" --root-cert "$state/data/ca/root-cert.pem" \
  --stats-addr 127.0.0.1:15020 --readiness-addr 127.0.0.1:15021 \
  --zds-path "" \
  >"$state/ztunnel.log" 2>&1 &
pids+=($!)

for _ in $(seq 100); do
  curl -fsS http://127.0.0.1:15021/healthz/ready >/dev/null 2>&1 && break
  sleep 0.1
done
# Certificates are fetched right after the first sync; give them a moment.
for _ in $(seq 50); do
  curl -fsS http://127.0.0.1:15000/config_dump 2>/dev/null | grep -q '"state": "Available"' && break
  sleep 0.1
done
curl -fsS http://127.0.0.1:15021/healthz/ready >/dev/null || {
  echo "ztunnel did not become ready; logs in $state"; tail -n 20 "$state"/*.log; exit 1; }

echo
echo "==> the mesh as ztunnel on node-1 sees it (GET 127.0.0.1:15000/config_dump)"
curl -fsS http://127.0.0.1:15000/config_dump | python3 -c '
import json, sys
d = json.load(sys.stdin)
row = "%-36s %-28s %-8s %s"
print(row % ("WORKLOAD", "IPS", "PROTOCOL", "IDENTITY"))
for w in sorted(d["workloads"], key=lambda w: w["uid"]):
    ident = "spiffe://%s/ns/%s/sa/%s" % (w.get("trustDomain") or "cluster.local", w["namespace"], w.get("serviceAccount") or "default")
    print(row % (w["namespace"] + "/" + w["name"], ",".join(w.get("workloadIps", [])), w.get("protocol", ""), ident))
print()
row = "%-56s %-16s %-12s %s"
print(row % ("SERVICE", "VIPS", "PORTS", "ENDPOINTS"))
for s in sorted(d["services"], key=lambda s: s["hostname"]):
    ports = ",".join("%s->%s" % (k, v or "pod") for k, v in s.get("ports", {}).items())
    print(row % (s["namespace"] + "/" + s["hostname"], ",".join(s.get("vips", [])), ports, len(s.get("endpoints", {}))))
print()
print("authorization policies: %d" % len(d["policies"]))
print()
row = "%-56s %-10s %s"
print(row % ("CERTIFICATE (node-1 pods, keys made on this node)", "STATE", "EXPIRES"))
for c in d["certificates"]:
    print(row % (c["identity"], c["state"].split(":")[0], c.get("notAfter", "")))
'
echo
echo "xDS clients seen by the control plane (GET 127.0.0.1:15014/debug/connections):"
curl -fsS http://127.0.0.1:15014/debug/connections | python3 -c '
import json, sys
for p in json.load(sys.stdin):
    held = ", ".join("%s=%d" % (t.rsplit(".", 1)[-1], s["resources_held"]) for t, s in p["types"].items())
    print("   %s  holds %s" % (p["node_id"], held))
'
echo
echo "Logs: $state. Try editing a file in $dir while running with --keep."
if [ "$keep" = "--keep" ]; then
  echo "Running; press Ctrl-C to stop."
  wait
fi
