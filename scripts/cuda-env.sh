# Source this file (do not execute it) from bash to build the `cuda` feature on a machine without
# a GPU or a CUDA toolkit. From the repository root:
#   source scripts/cuda-env.sh   then   cargo build --release --features cuda
# Needs python3 (with venv and pip, and PyPI reachable on first use) and a C compiler (`cc`).
#
# What it does, once (cached under $CUDA_ENV_DIR, default ~/.cache/candle-amp-cuda):
#  - installs pinned CUDA 13.0 compiler, headers and libraries from PyPI into a virtualenv
#    (13.0 on purpose: PTX from a newer nvcc fails on a CUDA 13.0 driver such as 580);
#  - makes a link folder: lib*.so names for cuBLAS/cuBLASLt/cuRAND/NVRTC/cudart, and link-time
#    stubs of the driver library (libcuda.so, soname libcuda.so.1) and of cuDNN 9 (libcudnn.so,
#    soname libcudnn.so.9) built from the symbol lists kept next to this script
#    (scripts/libcuda-symbols.txt, scripts/libcudnn-symbols.txt: cudarc's cuDNN bindings;
#    scripts/libnccl-symbols.txt: cudarc's NCCL bindings);
#  - exports PATH (nvcc), CUDA_ROOT/CUDA_PATH, CUDA_COMPUTE_CAP (default 90: H100/H200; set it
#    before sourcing for another GPU), LIBRARY_PATH.
#
# Running the result needs a GPU machine with a CUDA 13 driver and the CUDA 13 runtime libraries
# (cuBLAS, cuRAND, cudart, NVRTC; cuDNN 9 for `--features cudnn`) on LD_LIBRARY_PATH. If that
# machine's Python has torch for CUDA 13 (its pip wheels carry those libraries, in
# nvidia/cu13/lib and nvidia/cudnn/lib), copy the built binary there, then:
#   export LD_LIBRARY_PATH=$(python3 -c "import nvidia,os,glob;print(':'.join(glob.glob(os.path.join(nvidia.__path__[0],'*','lib'))))"):$LD_LIBRARY_PATH
# The real libcuda.so.1 and libcudnn.so.9 come from that machine; the stubs are never used at
# run time. If linking reports a missing cu* or cudnn* symbol (after a cudarc upgrade), add its
# name to scripts/libcuda-symbols.txt or libcudnn-symbols.txt (one name a line); the stub is
# rebuilt on the next `source`.

CUDA_ENV_DIR=${CUDA_ENV_DIR:-$HOME/.cache/candle-amp-cuda}
_cuda_env_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -x "$CUDA_ENV_DIR/venv/bin/python" ]; then
  python3 -m venv "$CUDA_ENV_DIR/venv" || return 1
fi
_cuda_nv=$("$CUDA_ENV_DIR/venv/bin/python" -c "import nvidia,os;print(os.path.join(nvidia.__path__[0],'cu13'))" 2>/dev/null)
if [ -z "$_cuda_nv" ] || [ ! -x "$_cuda_nv/bin/nvcc" ]; then
  "$CUDA_ENV_DIR/venv/bin/pip" install -q \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88 \
    nvidia-cublas==13.0.2.14 nvidia-curand==10.4.5.25 || return 1
  _cuda_nv=$("$CUDA_ENV_DIR/venv/bin/python" -c "import nvidia,os;print(os.path.join(nvidia.__path__[0],'cu13'))")
fi
mkdir -p "$CUDA_ENV_DIR/link"
for _l in cublas cublasLt curand nvrtc cudart; do
  _f=$(ls "$_cuda_nv"/lib/lib$_l.so.* 2>/dev/null | head -n 1)
  [ -n "$_f" ] && ln -sf "$_f" "$CUDA_ENV_DIR/link/lib$_l.so"
done
# Link-time stubs: the driver's libcuda.so.1, cuDNN 9's libcudnn.so.9 for `--features cudnn`
# and NCCL 2's libnccl.so.2 for `--features nccl` (cuDNN and NCCL are downloads of hundreds of
# MB; the binary only needs their names to link, and finds the real libraries on the GPU
# machine).
for _l in cuda:1 cudnn:9 nccl:2; do
  _name=${_l%%:*}
  if [ ! -f "$CUDA_ENV_DIR/link/lib$_name.so" ] || [ "$_cuda_env_here/lib$_name-symbols.txt" -nt "$CUDA_ENV_DIR/link/lib$_name.so" ]; then
    awk '{print "void " $1 "(void){}"}' "$_cuda_env_here/lib$_name-symbols.txt" > "$CUDA_ENV_DIR/link/${_name}stub.c"
    cc -shared -fPIC -Wl,-soname,"lib$_name.so.${_l##*:}" -o "$CUDA_ENV_DIR/link/lib$_name.so" "$CUDA_ENV_DIR/link/${_name}stub.c" || return 1
  fi
done
export PATH="$_cuda_nv/bin:$PATH" CUDA_ROOT="$_cuda_nv" CUDA_PATH="$_cuda_nv" CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export LIBRARY_PATH="$CUDA_ENV_DIR/link${LIBRARY_PATH:+:$LIBRARY_PATH}"
unset _cuda_nv _l _f _name _cuda_env_here
