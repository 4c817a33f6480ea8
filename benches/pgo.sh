#!/usr/bin/env bash
# Profile-guided build of ztunnel (benches/README.md, "Data plane against the
# floor", lever (p)). Builds an instrumented ztunnel, trains it on the floor
# bed's short run (bulk, request/response, new and idle connections through
# two ztunnels), merges what it counted and builds ztunnel with that profile.
#
#   benches/pgo.sh                    # root: the bed needs netns, iptables, CNI plugins
#   PGO_DIR=/some/dir benches/pgo.sh  # where the builds and the profile go
#
# Output: $PGO_DIR/use/release/ztunnel (default PGO_DIR: target/pgo). Swap it
# in with the floor bench's BINS= (see the lever) or ship it. A profile is
# only as good as the code it was taken from: rerun after data-path changes.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${PGO_DIR:-$root/target/pgo}
cd "$root"

if [ "$(id -u)" != 0 ]; then
    echo "pgo: the training run uses the floor bed, which needs root" >&2
    exit 1
fi
profdata=$(find "$(rustc --print sysroot)" -name llvm-profdata -type f | head -1)
if [ -z "$profdata" ]; then
    echo "pgo: llvm-profdata not found; install it with: rustup component add llvm-tools-preview" >&2
    exit 1
fi

raw=$out/raw
rm -rf "$raw" "$out/bins"
mkdir -p "$raw" "$out/bins"

echo "pgo: building the bed and the bench (release)"
cargo build --release --workspace --bins
cargo bench -p ambit-benches --bench floor --no-run

echo "pgo: building the instrumented ztunnel"
RUSTFLAGS="-Cprofile-generate=$raw" \
    cargo build --release -p ambit-ztunnel --bin ztunnel --target-dir "$out/gen"
# Build scripts of the instrumented build wrote profiles too: not ztunnel's.
rm -f "$raw"/*.profraw

for b in target/release/*; do
    if [ -f "$b" ] && [ -x "$b" ]; then ln -sf "$root/$b" "$out/bins/"; fi
done
rm -f "$out/bins/ztunnel"
cp "$out/gen/release/ztunnel" "$out/bins/ztunnel"

echo "pgo: training (the floor bed, QUICK, ztunnel path only)"
bench=$(ls -t target/release/deps/floor-* | grep -v '\.d$' | head -1)
QUICK=1 PATHS=ztunnel BINS="$out/bins" "$bench" --bench
if ! ls "$raw"/*.profraw > /dev/null 2>&1; then
    echo "pgo: the training run left no profile in $raw (did ztunnel exit cleanly?)" >&2
    exit 1
fi
"$profdata" merge -o "$out/ztunnel.profdata" "$raw"

echo "pgo: building ztunnel with the profile"
RUSTFLAGS="-Cprofile-use=$out/ztunnel.profdata" \
    cargo build --release -p ambit-ztunnel --bin ztunnel --target-dir "$out/use"
echo "pgo: $out/use/release/ztunnel"
