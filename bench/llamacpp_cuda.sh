#!/usr/bin/env bash
# llama.cpp on the GPU host, for same-run comparisons (optional: the build takes minutes).
#   bash bench/llamacpp_cuda.sh source OUT.tar.gz   (where PyPI is reachable) the llama.cpp source
#        vendored in the llama-cpp-python 0.3.36 sdist, trimmed to what a CUDA build of
#        llama-bench and llama-batched-bench needs (~6 MB)
#   bash bench/llamacpp_cuda.sh build ARCHIVE DIR   (on the GPU host, offline) configure and build
#        for sm_90 into DIR; DIR/bin/llama-bench and DIR/bin/llama-batched-bench
# bench/e2e_decode.py --llama-bench DIR/bin/llama-bench then runs it on the same files.
set -euo pipefail
what=$1
case "$what" in
  source)
    out=$(realpath -m "$2"); tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary=:all: llama-cpp-python==0.3.36 -d "$tmp"
    tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
    cd "$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp
    tar --exclude=tools/ui --exclude=ggml/src/ggml-sycl --exclude=ggml/src/ggml-opencl \
        --exclude=ggml/src/ggml-hexagon --exclude=ggml/src/ggml-metal \
        --exclude=ggml/src/ggml-vulkan --exclude=ggml/src/ggml-et \
        -czf "$out" CMakeLists.txt CMakePresets.json cmake common ggml include src vendor tools \
        licenses LICENSE
    rm -rf "$tmp"
    echo "wrote $out ($(du -h "$out" | cut -f1))"
    ;;
  build)
    archive=$(realpath "$2"); dir=$(realpath -m "$3")
    mkdir -p "$dir/src"
    tar -xzf "$archive" -C "$dir/src"
    cmake -S "$dir/src" -B "$dir" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
      > "$dir/configure.log" 2>&1 || { tail -30 "$dir/configure.log"; exit 1; }
    cmake --build "$dir" -j "${JOBS:-$(nproc)}" --target llama-bench llama-batched-bench \
      > "$dir/build.log" 2>&1 || { tail -30 "$dir/build.log"; exit 1; }
    echo "built $dir/bin/llama-bench"
    ;;
  *) echo "usage: $0 source OUT.tar.gz | build ARCHIVE DIR" >&2; exit 2 ;;
esac
