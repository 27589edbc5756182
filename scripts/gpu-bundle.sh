#!/usr/bin/env bash
# Builds, on a machine without a GPU, everything the GPU check runs, and packs it into one
# archive for the GPU machine:
#   scripts/gpu-bundle.sh              ->  target/gpu-bundle.tar.xz   (then scripts/gpu-check.sh there)
#
# What goes in: the release examples the check runs, every test binary built with `--features
# cuda,cudnn` (the root package's integration tests, `distributed` with `nccl` too, and
# amp-runtime's unit tests), and the PyTorch peer
# script. Binaries are built for a portable x86-64-v3 CPU (the workspace builds for the CPU at
# hand otherwise; set RUSTFLAGS to choose another). Each binary embeds the same PTX of candle's
# kernels (~50 MB apiece), so they are packed together with a large xz dictionary: one archive
# of ~15 MB rather than a gigabyte of binaries.
#
# Needs what scripts/cuda-env.sh needs (python3, a C compiler, PyPI once), and xz with ~6 GiB of
# memory for the dictionary.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh
export RUSTFLAGS="${RUSTFLAGS:--C target-cpu=x86-64-v3}"

out=target/gpu-bundle
rm -rf "$out" target/gpu-bundle.tar.xz
mkdir -p "$out/examples" "$out/tests"

examples=(quantized_sine amp_recipe gpt resnet bench)
example_args=()
for e in "${examples[@]}"; do example_args+=(--example "$e"); done
cargo build --release --features cuda,cudnn "${example_args[@]}"
for e in "${examples[@]}"; do cp "target/release/examples/$e" "$out/examples/"; done

# The test binaries, named without cargo's hash (`ops-1a2b...` -> `ops`). cargo prints each
# executable it built as JSON.
list_tests() {
  cargo test --release --no-run --message-format=json "$@" | python3 -c '
import json, sys
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-artifact" and msg.get("executable") and msg["profile"]["test"]:
        print(msg["executable"])'
}
{
  list_tests --features cuda,cudnn
  list_tests -p amp-runtime --features cudnn --lib
  # Last, so that it replaces the binary of the same name: only it needs libnccl to start.
  list_tests --features cuda,cudnn,nccl --test distributed
} |
  while read -r exe; do
    name=$(basename "$exe")
    cp "$exe" "$out/tests/${name%-*}"
  done

cp benches/peer/pytorch_peer.py "$out/"
git rev-parse --short HEAD > "$out/COMMIT" 2>/dev/null || echo unknown > "$out/COMMIT"

XZ_OPT='-9e --lzma2=dict=512MiB' tar -C target -cJf target/gpu-bundle.tar.xz gpu-bundle
ls -l target/gpu-bundle.tar.xz
echo "examples: ${examples[*]}"
echo "tests: $(ls "$out/tests" | tr '\n' ' ')"
