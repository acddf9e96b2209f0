#!/usr/bin/env bash
# One command on an offline GPU host: install the carried wheels, put the real models in place
# (from pieces carried in .gpu/, joined and checked), run the GPU tests, then the benchmarks.
#   bash bench/gpu_host.sh [tests|bench|all|load|prefill|spec|concurrency|drafters|mma]
#                          [pytest / script args]
# Every stage but load first compiles the kernels side by side (`specstream kernels warm`);
# GPU_TEST_WORKERS=N runs the tests on N pytest-xdist workers where xdist is installed.
# The bench stage runs bench/gpu_bench.py (BENCH_ARGS='--quick', BENCH_JSON=path).
# Wheels: `make wheelhouse` (or any folder of wheels) in .whl/; model pieces: .gpu*/NAME.part.*
# with .gpu*/NAME.sha256 (one folder per call when a call carries one piece). Models land in
# $SPECSTREAM_MODELS_DIR (default /tmp/specstream-models).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
export PYTHONUNBUFFERED=1 SPECSTREAM_MODELS_DIR=${SPECSTREAM_MODELS_DIR:-/tmp/specstream-models}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
if [ -d /tmp/site ]; then   # installed by this call or an earlier one on the same warm host
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
mkdir -p "$SPECSTREAM_MODELS_DIR"
for part in .gpu*/*.part.*; do
  [ -e "$part" ] || continue
  cp -n "$part" "$SPECSTREAM_MODELS_DIR/" && echo "stored $(basename "$part")"
done
cp -n .gpu*/*.sha256 "$SPECSTREAM_MODELS_DIR/" 2>/dev/null
for sum in .gpu*/*.sha256 "$SPECSTREAM_MODELS_DIR"/*.sha256; do
  [ -e "$sum" ] || continue
  name=$(basename "$sum" .sha256)
  out="$SPECSTREAM_MODELS_DIR/$name.gguf"
  [ -f "$out" ] && continue
  cat "$SPECSTREAM_MODELS_DIR/$name".part.* > "$out.tmp" 2>/dev/null
  if [ "$(sha256sum < "$out.tmp" | cut -d' ' -f1)" = "$(cut -d' ' -f1 "$sum")" ]; then
    mv "$out.tmp" "$out" && echo "joined $out"
  else
    rm -f "$out.tmp"; echo "$name: pieces incomplete so far"
  fi
done
# xgrammar imports the host's transformers where the host has one, and that one pins its own
# huggingface-hub: the carried one (nothing here imports it) steps aside when they disagree
if [ -d /tmp/site/huggingface_hub ] && ! python3 -c "import xgrammar" >/dev/null 2>&1; then
  rm -rf /tmp/site-aside && mkdir /tmp/site-aside && mv /tmp/site/huggingface_hub* /tmp/site-aside/ \
    && echo "carried huggingface_hub moved aside: the host's transformers pins its own"
fi
python3 -m service.proto_build >/dev/null || exit 1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
status=0
# Every kernel source compiled side by side into CuPy's cache first (a fresh host would
# otherwise compile them one after another inside the first tests or benchmarks).
if [ "$what" != load ]; then
  python3 -m service.cli kernels warm || status=1
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  # GPU_TEST_WORKERS=N: pytest-xdist workers (one file per worker) when the host has it
  workers=()
  if [ -n "${GPU_TEST_WORKERS:-}" ] && python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "$GPU_TEST_WORKERS" --dist loadfile)
  fi
  python3 -m pytest -m gpu -q tests/gpu -p no:cacheprovider "${workers[@]}" "$@" || status=1
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 bench/gpu_bench.py --json "${BENCH_JSON:-/tmp/bench-gpu.json}" ${BENCH_ARGS:-} || status=1
  python3 bench/e2e_decode.py ${E2E_ARGS:-} || status=1
fi
# Weight upload (pinned vs pageable) and prefill (GEMV chunks vs GEMM) on a synthetic 8B file,
# generated on first use into $TMPDIR/specstream-bench (keep the machine warm to reuse it).
if [ "$what" = load ]; then
  python3 bench/gpu_load.py "$@" || status=1
fi
if [ "$what" = prefill ]; then
  python3 bench/gpu_prefill.py "$@" || status=1
fi
# Speculative decoding (bench/speculative.py): real drafters on the real models, verify steps
# and the oracle drafter on synthetic 8B/1B (generated into /tmp/specstream-synth, reused).
if [ "$what" = spec ]; then
  python3 bench/speculative.py --json "${SPEC_JSON:-/tmp/bench-spec.json}" "$@" || status=1
fi
# Concurrent streams through the gRPC server (bench/concurrency.py) on the synthetic 8B
# (generated into /tmp/specstream-synth, reused); script args follow, e.g. --levels 1,16.
if [ "$what" = concurrency ]; then
  python3 bench/concurrency.py --backend cuda --model synth-8b \
    --json "${CONC_JSON:-/tmp/bench-concurrency.json}" "$@" || status=1
fi
# The tensor-core GEMV family against the default dp4a GEMVs (issue 19: whether it can be the
# default): its GPU tests (every tile and the one-column kernels bit for bit), the GEMV table
# (dp4a and mma per width), then one stream end to end with and without --gemv-mma on the
# synthetic 1B / 8B and the real models in place (E2E_MODELS; script args go to e2e_decode),
# then 1 and 64 streams through gRPC on the synthetic 8B with --gemv-mma, with --gemv-mma and
# 64-row prompt chunks (captured steps on the row-invariant GEMVs instead of one eager 128-row
# GEMM step per prompt), and with the dp4a GEMVs.
if [ "$what" = mma ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gemv_mma.py \
    tests/gpu/test_batching.py || status=1
  python3 bench/gpu_bench.py --only gemv --quick --json "${BENCH_JSON:-/tmp/bench-gemv.json}" \
    || status=1
  python3 bench/e2e_decode.py --parts step,engine,mma \
    --models "${E2E_MODELS:-synth-1b,synth-8b,smollm2-135m}" "$@" || status=1
  # many streams through gRPC on the synthetic 8B, the tiles and the dp4a GEMVs (MMA_LEVELS)
  for mode in "--gemv-mma" "--gemv-mma --prefill-chunk 64" ""; do
    tag=$(echo "$mode" | sed -e 's/--gemv-mma/-mma/' -e 's/ --prefill-chunk /-chunk/')
    echo "== concurrency [${mode:-dp4a}]"
    python3 bench/concurrency.py --backend cuda --model synth-8b --levels "${MMA_LEVELS:-1,64}" \
      --tokens 128 --prompts ids --prompt-tokens 128 --prefix-tokens 0 --rounds 1 $mode \
      --json "${MMA_CONC_JSON:-/tmp/bench-conc}$tag.json" || status=1
  done
fi
# EAGLE-3 heads fitted on the GPU host (issue 22's goal): for each real model in place,
# `specstream train-drafter` with the target generating on CUDA (TRAIN_ARGS, default below),
# then bench/speculative.py's real part with that head beside plain decoding and the n-gram
# drafter (script args follow). Heads land in $DRAFTERS_DIR (default /tmp/specstream-heads).
if [ "$what" = drafters ]; then
  heads=${DRAFTERS_DIR:-/tmp/specstream-heads}; mkdir -p "$heads"
  for model in smollm2-135m gemma3-270m; do
    [ -f "$SPECSTREAM_MODELS_DIR/$model.gguf" ] || { echo "$model: not in place"; continue; }
    python3 -m service.cli train-drafter "$SPECSTREAM_MODELS_DIR/$model.gguf" \
      "$heads/$model-eagle3.gguf" --kind eagle3 --backend cuda \
      ${TRAIN_ARGS:---tokens 128 --draft-vocab 16384 --unroll 3 --epochs 8 --max-seconds 240} \
      || { status=1; continue; }
    python3 bench/speculative.py --part real --backend cuda --models "$model" \
      --eagle3 "$heads/$model-eagle3.gguf" \
      --json "${SPEC_JSON:-/tmp/bench-spec}-$model.json" "$@" || status=1
  done
fi
exit $status
