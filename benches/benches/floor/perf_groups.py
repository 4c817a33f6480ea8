#!/usr/bin/env python3
"""Groups a `perf record` profile's self time (perf report --no-children) by
kind: kernel, memcpy, crypto, rustls, h2, tokio, allocator, rest; prints the
groups and the top symbols.  Usage: perf_groups.py FILE.data [TOP]"""

import re
import subprocess
import sys

GROUPS = [
    ("memcpy (user)", re.compile(r"memcpy|memmove|__memset", re.I)),
    ("crypto", re.compile(r"aes|gcm|ghash|gfmul|sha\d|x25519|p256|ecp_nistz|nistz|"
                          r"chacha|poly1305|bn_|ring_core|ring::|LIMBS|CRYPTO_", re.I)),
    ("rustls", re.compile(r"rustls")),
    ("h2", re.compile(r"\bh2::|<h2::")),
    ("tokio", re.compile(r"tokio")),
    ("allocator", re.compile(r"\bmi_|_mi_|mimalloc|malloc|\bfree\b|cfree|je_|jemalloc")),
]


def main():
    data = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    out = subprocess.run(
        ["perf", "report", "-i", data, "--no-children", "--stdio", "-g", "none",
         "--sort", "dso,sym", "--percent-limit", "0.01"],
        capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+\[(.)\]\s+(.*)", line)
        if m:
            rows.append((float(m.group(1)), m.group(2), m.group(3), m.group(4).strip()))
    groups = {}
    kernel_copy = 0.0
    for pct, dso, kind, sym in rows:
        if kind == "k" or "kernel" in dso:
            g = "kernel"
            if re.search(r"copy_(to|from)_(iter|user)|copy_user|rep_movs", sym):
                kernel_copy += pct
        else:
            g = next((name for name, rx in GROUPS if rx.search(sym)), "rest (user)")
        groups[g] = groups.get(g, 0.0) + pct
    print(f"{data}: {len(rows)} symbols")
    for g, pct in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {g:16} {pct:5.1f} %")
    print(f"  (kernel copies to/from user: {kernel_copy:.1f} %)")
    print("top symbols (self):")
    for pct, dso, kind, sym in rows[:top]:
        print(f"  {pct:5.2f} %  {dso[:20]:20} {sym[:100]}")


if __name__ == "__main__":
    main()
