#!/usr/bin/env bash
# The GPU check, on a GPU machine, from the archive scripts/gpu-bundle.sh built elsewhere:
#   scripts/gpu-check.sh [target/gpu-bundle.tar.xz]
#
# Runs, in this order, and prints one table at the end (each step's status and seconds; the log
# of each failed step is printed in full above it):
#   1. every CUDA test (test names containing `cuda`) of every test binary (NCCL's at world size
#      1 among them: `distributed` links torch's libnccl.so.2);
#   2. compute-sanitizer memcheck on the binaries that launch this crate's kernels
#      (skipped with a note where compute-sanitizer is not installed);
#   3. the PyTorch comparison, `pytorch_peer.py --device cuda --examples DIR` (needs torch with
#      CUDA in this machine's python3);
#   4. `bench --device cuda --json`.
# Whole run: about 110 s on an H200 (the tree of 2399ef7). The machine needs a CUDA 13 driver; the CUDA runtime
# libraries and cuDNN are taken from torch's pip wheels (`nvidia/cu13/lib`, `nvidia/cudnn/lib`),
# as the binaries were built against CUDA 13.0. Exits non-zero when any step failed.
set -uo pipefail
cd "$(dirname "$0")/.."

archive=${1:-target/gpu-bundle.tar.xz}
work=$(mktemp -d)
tar -C "$work" -xf "$archive" || { echo "cannot unpack $archive"; exit 2; }
bundle=$work/gpu-bundle

libs=$(python3 -c "import nvidia, os, glob; print(':'.join(glob.glob(os.path.join(nvidia.__path__[0], '*', 'lib'))))" 2>/dev/null || true)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

rows=()
failed=0
# step NAME COMMAND...: runs COMMAND with its output in NAME's log, records status and time.
step() {
  local name=$1 start status
  shift
  start=$(date +%s)
  if "$@" >"$work/$name.log" 2>&1; then
    status=ok
  else
    status=FAILED
    failed=1
    echo "=== $name failed: $*"
    cat "$work/$name.log"
  fi
  rows+=("$(printf '%-34s %-8s %5ss' "$name" "$status" "$(($(date +%s) - start))")")
}

echo "commit $(cat "$bundle/COMMIT"), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"

for t in "$bundle"/tests/*; do
  step "cuda tests: $(basename "$t")" "$t" cuda --test-threads 1
done

if command -v compute-sanitizer >/dev/null; then
  for t in amp_runtime ops layers grad_scaler optim cuda_vs_cpu; do
    [ -x "$bundle/tests/$t" ] || continue
    step "memcheck: $t" compute-sanitizer --tool memcheck --error-exitcode 1 \
      "$bundle/tests/$t" cuda --test-threads 1
  done
else
  rows+=("$(printf '%-34s %-8s' 'memcheck' 'skipped (no compute-sanitizer)')")
fi

step "pytorch_peer --device cuda" python3 "$bundle/pytorch_peer.py" --device cuda --examples "$bundle/examples"
step "bench --device cuda" "$bundle/examples/bench" --device cuda --json

for name in "pytorch_peer --device cuda" "bench --device cuda"; do
  echo "=== $name"
  tail -n 40 "$work/$name.log"
done
echo "=== summary"
printf '%s\n' "${rows[@]}"
rm -rf "$work"
exit "$failed"
