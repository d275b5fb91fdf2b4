#!/usr/bin/env bash
# GPU runner: check the CUDA environment, then the whole suite on the GPU(s) and the conformance
# suite with both engines on CUDA. `-n auto` starts one pytest worker per CPU core (one torch thread
# each); the workers share the GPU. On a runner with several GPUs, pass --conformance-gpus all to
# spread the workers over them round robin (each worker then sees one device through CUDA_VISIBLE_DEVICES).
#
#   EXPECTED_CUDA=12.8 ci/gpu_runner.sh [extra pytest args]
# Environment: EXPECTED_CUDA (required, e.g. 12.8), CONFORMANCE_ENGINE (default async),
#              REPORTS (default reports/gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${EXPECTED_CUDA:?set EXPECTED_CUDA to the CUDA version torch must be built for, e.g. 12.8}"
REPORTS="${REPORTS:-reports/gpu}"
ENGINE="${CONFORMANCE_ENGINE:-async}"
mkdir -p "$REPORTS"

python ci/check_env.py --device cuda --cuda "$EXPECTED_CUDA"

status=0
# Every Triton kernel compiled for sm_80 and sm_90 at real model shapes: shared memory and registers.
python -m kernels.compile_check --targets sm_80,sm_90 > "$REPORTS/compile-check.txt" || status=1
tail -n 1 "$REPORTS/compile-check.txt"
# Everything, GPU-marked kernel tests included (they skip only without CUDA).
pytest -n auto -rxXfE -o junit_family=xunit1 --junitxml "$REPORTS/tests.xml" "$@" || status=$?
# The conformance suite with both engines on the GPU, every graph mode.
for mode in none piecewise full full_and_piecewise; do
    engine="$ENGINE"
    [ "$ENGINE" = async ] && engine="async:$mode"
    conformance run --engine "$engine" --device cuda --tier default \
        --junit-xml "$REPORTS/conformance-$mode.xml" --report-json "$REPORTS/conformance-$mode.json" || status=1
    [ "$ENGINE" = async ] || break
done
python ci/summarize_junit.py "$REPORTS"/*.xml --title "GPU runner (CUDA $EXPECTED_CUDA)" \
    --output "$REPORTS/summary.md"
cat "$REPORTS/summary.md"
exit "$status"
