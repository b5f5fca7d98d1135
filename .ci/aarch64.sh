#!/usr/bin/env bash
# CI, the kernel on AArch64 without ARM hardware: tests/native/kernel_oracle.cpp (every ISA unit against a float64
# oracle and the scalar unit; no torch) built from csrc/ unchanged with Debian's cross compiler and run under
# qemu-aarch64 user-mode emulation, which checks the NEON unit's results (emulation says nothing about its speed).
# Then the same program built natively, for the scalar and x86 units. Exits non-zero on any mismatch.
# Installs g++-aarch64-linux-gnu and qemu-user-static with apt-get when they are missing (needs root; ~20 s).
# Cost here (2 loaded cores): ~40 s of CPU under qemu, ~5 s natively, plus the builds.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(mktemp -d "${TMPDIR:-/tmp}/zero_offload_aarch64.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
FLAGS=(-O3 -std=c++17 -Icsrc)  # the extension's optimisation level (zero_offload/_build.py), without OpenMP

if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user-static >/dev/null
fi

# One object per translation unit, compiled in parallel; the kernel units exactly as the extension compiles them.
build() {  # build COMPILER DIR UNIT...
    local cxx=$1 dir=$2 pids=() unit
    shift 2
    mkdir -p "$dir"
    for unit in "$@" tests/native/kernel_oracle.cpp; do
        "$cxx" "${FLAGS[@]}" -c "$unit" -o "$dir/$(basename "$unit" .cpp).o" & pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
    "$cxx" -static "$dir"/*.o -o "$dir/kernel_oracle"
}

echo "== aarch64 (cross-built, run under qemu-aarch64): scalar and NEON units"
build aarch64-linux-gnu-g++ "$OUT/aarch64" csrc/isa_scalar.cpp csrc/isa_neon.cpp
qemu-aarch64-static "$OUT/aarch64/kernel_oracle"

if [ "$(uname -m)" = x86_64 ]; then
    echo "== x86-64 (native): scalar and the AVX2/AVX-512 units this CPU runs"
    build "${CXX:-g++}" "$OUT/x86_64" csrc/isa_scalar.cpp csrc/isa_avx2.cpp csrc/isa_avx512.cpp
    "$OUT/x86_64/kernel_oracle"
fi
