#!/usr/bin/env bash
# GPU runner: check the CUDA environment, then the whole suite on the GPU(s) and the conformance
# suite with both engines on CUDA. `-n auto` starts one pytest worker per CPU core (one torch thread
# each); the workers share the GPU. On a runner with several GPUs, pass --conformance-gpus all to
# spread the workers over them round robin (each worker then sees one device through CUDA_VISIBLE_DEVICES).
#
#   EXPECTED_CUDA=12.8 ci/gpu_runner.sh [extra pytest args]
#   EXPECTED_CUDA=12.8 ci/gpu_runner.sh --dry-run [extra pytest args]
# --dry-run prints every command a GPU run would run, without running them, and checks what needs no
# GPU: Python, torch and triton versions, EXPECTED_CUDA (well formed, a tox cuXYZ environment for it),
# that the suite's pytest selection (with the extra args) and its GPU-marked tests collect, that the
# compile check and the conformance corpus load.
# Environment: EXPECTED_CUDA (required, e.g. 12.8), CONFORMANCE_ENGINE (default async),
#              REPORTS (default reports/gpu), CONFORMANCE_JOBS (graph modes run at once, default 1;
#              4 on a runner with cores to spare runs the four side by side).
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
: "${EXPECTED_CUDA:?set EXPECTED_CUDA to the CUDA version torch must be built for, e.g. 12.8}"
REPORTS="${REPORTS:-reports/gpu}"
ENGINE="${CONFORMANCE_ENGINE:-async}"
JOBS="${CONFORMANCE_JOBS:-1}"
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_runner: CONFORMANCE_JOBS must be a whole number >= 1, got '$JOBS'" >&2; exit 2; }
DRY_RUN_LOG=()

# A command as a shell would read it back (arguments quoted where they need it).
quoted() {
    local out=() arg
    for arg in "$@"; do
        if [[ "$arg" =~ ^[A-Za-z0-9_./:=,@%+*-]+$ ]]; then out+=("$arg"); else out+=("$(printf '%q' "$arg")"); fi
    done
    echo "${out[*]}"
}
# Runs a command; in a dry run, records it instead (printed as the GPU run's plan).
run() {
    if [ "$DRY_RUN" = 1 ]; then DRY_RUN_LOG+=("$(quoted "$@")"); else "$@"; fi
}
# run_to FILE COMMAND...: the same, stdout into FILE.
run_to() {
    local file="$1"
    shift
    if [ "$DRY_RUN" = 1 ]; then DRY_RUN_LOG+=("$(quoted "$@") > $file"); else "$@" > "$file"; fi
}

run mkdir -p "$REPORTS"
run python ci/check_env.py --device cuda --cuda "$EXPECTED_CUDA"

status=0
# Every Triton kernel compiled for sm_80 and sm_90 at real model shapes: shared memory and registers.
run_to "$REPORTS/compile-check.txt" python -m kernels.compile_check --targets sm_80,sm_90 || status=1
run tail -n 1 "$REPORTS/compile-check.txt"
# Everything, GPU-marked kernel tests included (they skip only without CUDA).
run pytest -n auto -rxXfE -o junit_family=xunit1 --junitxml "$REPORTS/tests.xml" "$@" || status=$?
# The conformance suite with both engines on the GPU, every graph mode; CONFORMANCE_JOBS modes at a time
# (each its own process and log, $REPORTS/conformance-MODE.log, printed when it ends).
pids=()
for mode in none piecewise full full_and_piecewise; do
    engine="$ENGINE"
    [ "$ENGINE" = async ] && engine="async:$mode"
    cmd=(conformance run --engine "$engine" --device cuda --tier default
         --junit-xml "$REPORTS/conformance-$mode.xml" --report-json "$REPORTS/conformance-$mode.json")
    if [ "$DRY_RUN" = 1 ]; then
        DRY_RUN_LOG+=("$(quoted "${cmd[@]}") > $REPORTS/conformance-$mode.log")
    else
        while [ "${#pids[@]}" -ge "$JOBS" ]; do
            wait "${pids[0]}" || status=1
            pids=("${pids[@]:1}")
        done
        ( rc=0; "${cmd[@]}" > "$REPORTS/conformance-$mode.log" 2>&1 || rc=$?
          echo "--- conformance $engine: exit $rc"; cat "$REPORTS/conformance-$mode.log"; exit "$rc" ) &
        pids+=($!)
    fi
    [ "$ENGINE" = async ] || break
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
# The engine in bfloat16 on the GPU, judged by the CPU float32 reference (--verdict rescored: the reference
# scores the engine's own output; a token within the calibrated bfloat16 tolerance of its pick is a near-tie,
# one beyond it is structural and fails).
bf16=(conformance run --engine "$ENGINE" --device cuda --dtype bfloat16 --verdict rescored
      --reference-dtype float32 --reference-device cpu --tier default
      --junit-xml "$REPORTS/conformance-bf16-rescored.xml" --report-json "$REPORTS/conformance-bf16-rescored.json")
run_to "$REPORTS/conformance-bf16-rescored.log" "${bf16[@]}" || status=1
run python ci/summarize_junit.py "$REPORTS"/*.xml --title "GPU runner (CUDA $EXPECTED_CUDA)" \
    --output "$REPORTS/summary.md"
run cat "$REPORTS/summary.md"
[ "$DRY_RUN" = 1 ] || exit "$status"

echo "A GPU run would run:"
printf '  %s\n' "${DRY_RUN_LOG[@]}"
echo "Checks without a GPU:"
status=0
python ci/check_env.py --dry-run --device cuda --cuda "$EXPECTED_CUDA" || status=1
if collected=$(pytest --collect-only -q "$@" 2>&1); then
    echo "  pytest selection: $(echo "$collected" | tail -n 1)"
else
    echo "$collected" | tail -n 20
    echo "gpu_runner: the suite's pytest selection does not collect: pytest $*" >&2
    status=1
fi
gpu_rc=0
gpu=$(pytest --collect-only -q -m gpu "$@" 2>&1) || gpu_rc=$?
if [ "$gpu_rc" = 0 ] || [ "$gpu_rc" = 5 ]; then  # 5: the selection holds no GPU-marked test
    echo "  GPU-marked tests: $(echo "$gpu" | tail -n 1)"
else
    echo "$gpu" | tail -n 20
    echo "gpu_runner: the GPU-marked tests do not collect: pytest -m gpu $*" >&2
    status=1
fi
if ! python -c 'import sys; from conformance.cli import build_parser; from conformance.verdict import calibrated_tolerance
build_parser().parse_args(sys.argv[1:]); calibrated_tolerance("bfloat16", "float32")' "${bf16[@]:1}"; then
    echo "gpu_runner: the bfloat16 pass (${bf16[*]}) does not parse, or bfloat16 has no calibrated tolerance" >&2
    status=1
fi
if ! python -c "import kernels.compile_check"; then
    echo "gpu_runner: kernels.compile_check does not import" >&2
    status=1
fi
if scenarios=$(conformance list 2>&1); then
    echo "  conformance corpus: $(echo "$scenarios" | grep -c .) lines listed"
else
    echo "$scenarios" | tail -n 20
    echo "gpu_runner: conformance list failed" >&2
    status=1
fi
exit "$status"
