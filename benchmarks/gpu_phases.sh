#!/usr/bin/env bash
# One phase of the GPU benchmarks and tests, sized to run within ten minutes.
# Results go to $OUT (default /tmp/xgr-gpu); copy the JSON worth keeping into
# benchmarks/results/ as topic[-variant]-DATE-DEVICE.json (docs/performance.md).
#
#   bash benchmarks/gpu_phases.sh tests       # GPU-only tests (kernels, graphs, streams)
#   bash benchmarks/gpu_phases.sh attention   # decode attention table
#   bash benchmarks/gpu_phases.sh ncu         # Nsight Compute counters of the decode attention
#   bash benchmarks/gpu_phases.sh prefill     # prefill attention: Triton, flash varlen, SDPA;
#                                               T5 encoder attention: Triton, SDPA + mask
#   bash benchmarks/gpu_phases.sh e2e         # whole-request latency table + HF
#   bash benchmarks/gpu_phases.sh profile     # kernel time of one request (L=1000, 5000)
#   bash benchmarks/gpu_phases.sh t5          # T5 shapes: one request, xgr vs HF (+ profile)
#   bash benchmarks/gpu_phases.sh bf16        # top-10 agreement, bf16 vs float32, demo models
#                                               (carry the demo cache: cp -r ~/.cache/xgr/demo
#                                               .carry/demo, with /.carry/ in .git/info/exclude)
#   bash benchmarks/gpu_phases.sh serving 0   # req/s within P99 200 ms, batching vs not
#                                               (one config of serving_throughput.py each)
#   bash benchmarks/gpu_phases.sh http        # the HTTP server's tests on CUDA, then
#                                               http_serving.py (HTTP vs in-process, fairness,
#                                               overload); needs the HTTP stack's wheels
#                                               installed on PYTHONPATH first
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # the package, uninstalled there
OUT="${OUT:-/tmp/xgr-gpu}"
mkdir -p "$OUT"
case "${1:?phase: tests|attention|ncu|prefill|e2e|profile|t5|bf16|serving|http}" in
  tests)
    # The engine's GPU tests; the HTTP server's run in the http phase, which needs its wheels.
    # Eight pytest-xdist workers (pytest-xdist, installed apart from the dev extra)
    # compile the kernels in parallel; the scheduler's timing tests run alone.
    timeout 330 python3 -m pytest -q -n 8 -rs tests/kernels tests/beam tests/engine \
      tests/models tests/runner 2>&1 | grep -v "^\.*$" | tail -20
    timeout 200 python3 -m pytest -q -rs tests/scheduler 2>&1 | grep -v "^\.*$" | tail -10
    ;;
  attention)
    timeout 300 python3 benchmarks/attention.py --output "$OUT/attention.json" 2>&1 | tail -40
    ;;
  ncu)
    # Hardware counters of the decode attention's two launches (shared stage, then merge) at
    # L=3000, B=512, one request, Qwen3-1.7B shape; the clocks are left as they are.
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    timeout 300 "$NCU" --clock-control none -k regex:_beam_decode_attention_kernel \
      --launch-count 2 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
      --section Occupancy --section LaunchStats \
      python3 benchmarks/attention.py --profile-launch --output /dev/null \
      --prompt-lens 3000 --beam-widths 512 --requests 1 > "$OUT/ncu.txt" 2>&1
    grep -E "_beam_decode|Duration|Compute \(SM\) Throughput|L2 Cache Throughput|Issue Slots|No Eligible|Registers Per|Achieved Occupancy" \
      "$OUT/ncu.txt"
    ;;
  prefill)
    timeout 300 python3 benchmarks/attention.py --prefill --output "$OUT/attention-prefill.json" \
      2>&1 | tail -20
    timeout 200 python3 benchmarks/attention.py --encoder --output "$OUT/attention-encoder.json" \
      2>&1 | tail -10
    ;;
  e2e)
    timeout 540 python3 benchmarks/e2e_latency.py --output "$OUT/e2e.json" 2>&1 | tail -46
    ;;
  profile)
    for L in 1000 5000; do
      timeout 200 python3 benchmarks/profile_request.py --prompt-len "$L" --beam 256 \
        --output "$OUT/profile-L$L.json" 2>&1 | grep -v "USDT\|profiler_st" | tail -28
    done
    ;;
  t5)
    timeout 560 python3 benchmarks/t5_latency.py --profile --output "$OUT/t5.json" 2>&1 \
      | grep -v "shards\|Loading weights\|USDT" | tail -40
    ;;
  bf16)
    timeout 300 python3 benchmarks/bf16_agreement.py --cache-dir .carry/demo \
      --output "$OUT/bf16.json" 2>&1 | tail -5
    ;;
  serving)
    timeout 560 python3 benchmarks/serving_throughput.py --configs "${2:-0}" --duration 3 \
      --output "$OUT/serving.json" 2>&1 | tee "$OUT/serving.log" | tail -40
    ;;
  http)
    timeout 170 python3 -m pytest -q -rs tests/server/test_in_flight.py \
      tests/server/test_slow_clients.py tests/server/test_error_bodies.py 2>&1 | tail -8
    timeout 410 python3 benchmarks/http_serving.py --duration "${2:-8}" --start-rate 200 \
      --output "$OUT/http-serving.json" 2>&1 | tee "$OUT/http-serving.log" | tail -45
    ;;
  *)
    echo "unknown phase $1" >&2
    exit 2
    ;;
esac
