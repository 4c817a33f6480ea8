#!/usr/bin/env bash
# Runs Ambit's fuzz targets, one at a time, single job (the machine is shared).
#
#   fuzz/run.sh                   every target, 10 minutes each
#   fuzz/run.sh TARGET [MINUTES]  one target (default 10 minutes)
#   fuzz/run.sh all MINUTES       every target, MINUTES each
#   fuzz/run.sh seed [TARGET]     (re)write the seeds into corpus/TARGET
#   fuzz/run.sh cmin TARGET       minimize corpus/TARGET (keeps the named seeds)
#   fuzz/run.sh list              the targets
#
# Each run prints the executions, the exec/s, the coverage reached and the
# crashes found (files in artifacts/TARGET/). New inputs go to a scratch
# corpus (corpus-tmp/, not committed) and are folded into corpus/TARGET
# afterwards, minimized with `cargo fuzz cmin` by edge coverage: the named
# seeds (written by `seed`) always stay, the inputs the fuzzer found are the
# files named by their SHA-1.
#
# Needs a nightly toolchain and cargo-fuzz (`cargo install cargo-fuzz`).
# Not run in CI. See README.md.
set -euo pipefail

cd "$(dirname "$0")"
TARGETS=(ztunnel_xds config_decode cni_plugin zds hbone_connect csr xds_delta)
TOOLCHAIN=${FUZZ_TOOLCHAIN:-nightly}
# No sanitizer: every Ambit crate forbids unsafe code; a panic (including
# overflow and debug assertions, -a) is the bug class we look for.
FUZZ=(cargo "+$TOOLCHAIN" fuzz)
BUILD_FLAGS=(--sanitizer none --debug-assertions)
export CARGO_INCREMENTAL=0 CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-2}

max_len() {
    case "$1" in
        config_decode) echo 16384 ;;
        ztunnel_xds) echo 8192 ;;
        *) echo 4096 ;;
    esac
}

build() {
    "${FUZZ[@]}" build "${BUILD_FLAGS[@]}" "$@" >&2
}

bin_of() {
    echo "target/x86_64-unknown-linux-gnu/release/$1"
}

seed() {
    local t=$1
    mkdir -p "corpus/$t"
    AMBIT_FUZZ_SEEDS="corpus/$t" "$(bin_of "$t")" >&2
}

# A fuzzer-found input is named by the SHA-1 of its bytes; anything else in
# corpus/TARGET is a named seed.
is_found() {
    [[ "$1" =~ ^[0-9a-f]{40}$ ]]
}

# Minimizes corpus/TARGET with `cargo fuzz cmin` (libFuzzer -merge=1), by
# edges only (-use_counters=0: hit counts would keep thousands of inputs
# that differ only in how often a loop ran) and as a set cover
# (-set_cover_merge=1: fewer files than the greedy smallest-first merge for
# the same features). cmin renames everything it keeps to its SHA-1, so the
# named seeds are set aside and put back, and a found input with the same
# bytes as a seed is dropped.
minimize() {
    local t=$1 dir="corpus/$1" seeds="corpus-tmp/$1.seeds" log="artifacts/$1/cmin.log"
    mkdir -p "artifacts/$t"
    rm -rf "$seeds" && mkdir -p "$seeds"
    local f
    for f in "$dir"/*; do
        [ -f "$f" ] || continue
        is_found "$(basename "$f")" || mv "$f" "$seeds/"
    done
    local before
    before=$(find "$dir" -maxdepth 1 -type f | wc -l)
    if [ "$before" -gt 0 ]; then
        # cmin renames corpus/TARGET aside and merges it back into an empty
        # one; it prints the "MERGE-OUTER" summary in the log.
        "${FUZZ[@]}" cmin "${BUILD_FLAGS[@]}" "$t" "$dir" -- \
            -max_len="$(max_len "$t")" -use_counters=0 -set_cover_merge=1 -timeout=10 -rss_limit_mb=2048 \
            >"$log" 2>&1 || echo "cmin $t failed (see $log)" >&2
    fi
    mkdir -p "$dir"
    for f in "$seeds"/*; do
        [ -f "$f" ] || continue
        rm -f "$dir/$(sha1sum "$f" | cut -d' ' -f1)"
        mv "$f" "$dir/"
    done
    rm -rf "$seeds"
    echo "corpus/$t: $before found inputs -> $(find "$dir" -maxdepth 1 -type f | wc -l) files ($(( $(du -sb "$dir" | cut -f1) / 1024 )) KiB) with the seeds" >&2
}

run_one() {
    local t=$1 minutes=$2
    local art="artifacts/$t" tmp="corpus-tmp/$t"
    mkdir -p "$art" "$tmp" "corpus/$t"
    [ -n "$(ls -A "corpus/$t")" ] || seed "$t"
    local before
    before=$(find "$art" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) | wc -l)
    local log="$art/run-$(date -u +%Y%m%dT%H%M%SZ).log"
    touch "$art/.start"
    echo "== $t: $minutes min, log $log" >&2
    # -jobs=1 -workers=1: one fuzzing process (libFuzzer then writes its
    # output to fuzz-0.log in the working directory; we keep it as $log).
    set +e
    "$(bin_of "$t")" "$tmp" "corpus/$t" \
        -artifact_prefix="$art/" \
        -max_total_time=$((minutes * 60)) \
        -max_len="$(max_len "$t")" \
        -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 \
        -jobs=1 -workers=1 >/dev/null 2>&1
    local rc=$?
    set -e
    mv -f fuzz-0.log "$log" 2>/dev/null || true
    local execs speed cov
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)
    speed=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*$' || true)
    local after
    after=$(find "$art" -maxdepth 1 -type f \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) | wc -l)
    # Fold what was found into the committed corpus, minimized.
    find "$tmp" -maxdepth 1 -type f -exec cp -n -t "corpus/$t" {} +
    rm -rf "$tmp"
    minimize "$t"
    printf 'target=%s minutes=%s executions=%s exec_per_sec=%s cov=%s new_crashes=%s exit=%s corpus_files=%s\n' \
        "$t" "$minutes" "${execs:-?}" "${speed:-?}" "${cov:-?}" "$((after - before))" "$rc" \
        "$(ls "corpus/$t" | wc -l)"
    if [ "$after" -gt "$before" ]; then
        find "$art" -maxdepth 1 -type f -newer "$art/.start" \( -name 'crash-*' -o -name 'timeout-*' -o -name 'oom-*' -o -name 'leak-*' \) |
            sed "s|^|  reproduce: cargo +$TOOLCHAIN fuzz run ${BUILD_FLAGS[*]} $t |"
        grep -m1 -A3 'panicked at' "$log" | sed 's/^/  /' || true
    fi
}

case "${1:-all}" in
    list) printf '%s\n' "${TARGETS[@]}" ;;
    cmin)
        printf '%s\n' "${TARGETS[@]}" | grep -qx "${2:-}" || { echo "usage: run.sh cmin TARGET" >&2; exit 2; }
        build "$2"
        minimize "$2"
        ;;
    seed)
        build
        if [ -n "${2:-}" ]; then seed "$2"; else for t in "${TARGETS[@]}"; do seed "$t"; done; fi
        ;;
    all)
        build
        for t in "${TARGETS[@]}"; do run_one "$t" "${2:-10}"; done
        ;;
    *)
        printf '%s\n' "${TARGETS[@]}" | grep -qx "$1" || { echo "unknown target $1 (fuzz/run.sh list)" >&2; exit 2; }
        build "$1"
        run_one "$1" "${2:-10}"
        ;;
esac
