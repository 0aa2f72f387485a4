#!/usr/bin/env bash
# One short run on a lent GPU machine (about 5 minutes on 16 cores + one H200; never past ~8): the Diagnoser's cost on
# a GPU training step, the CUDA-parametrised tests, a CPU-vs-GPU check of every figure on a 200 M-token dump, and the
# benchmark at 200 M tokens on CUDA and on the CPU.
#
#   OUT=/some/dir bash bench/gpu_check.sh
#
# Needs no network: torch (CUDA build), pyarrow, pandas, typer, rich, pytest and hypothesis must be installed; the
# package runs from this checkout (PYTHONPATH), not from an install. Logs and JSON results go to $OUT; the dump is
# written under bench/out/ (about 3.7 GiB) and never copied to $OUT. Each step has its own time limit and a failing
# step does not stop the others: read $OUT/summary.txt first.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

BUDGET="${BUDGET:-420}"  # seconds: later steps are skipped once the run has taken this long

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log, record the exit code
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  if (( SECONDS > BUDGET )); then
    echo "$name: skipped (the run is past its ${BUDGET} s budget)" | tee -a "$SUMMARY"
    return
  fi
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code after $((SECONDS - start)) s" | tee -a "$SUMMARY"
}

step env 60 bash -c "nvidia-smi; nproc; free -g; uptime; $PY -c 'import torch, pyarrow, pandas; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0), pyarrow.__version__, pandas.__version__)'"

# 0. What grpo_cli.Diagnoser adds to a training step on the GPU (a tiny model's step; docs/performance.md).
step online_cuda 90 "$PY" bench/online.py --device cuda --d-model 512 --batch 64 --length 512 --memory-steps 50 \
  --json "$OUT/online_cuda.json"

# 1. Every test parametrised by device runs its CUDA case (plus the CPU/GPU agreement test).
step tests_cuda 180 "$PY" -m pytest -q -p no:cacheprovider -k "cuda" tests

# 2. The 200 M-token dump: pyarrow's default writer settings, written in 20 M-token chunks (one row group each).
step dump 200 "$PY" bench/run.py --tokens 2e8 --prepare

DUMP=bench/out/synthetic-200000000.parquet
# 3. Every figure on CUDA against the CPU, 1e-6 relative (counts, histograms and top-k exactly).
step analyze_cpu 120 "$PY" -m grpo_cli analyze "$DUMP" -f json -o "$OUT/analyze_cpu.json" -q
step analyze_cuda 120 "$PY" -m grpo_cli analyze "$DUMP" -f json -o "$OUT/analyze_cuda.json" -q \
  --device cuda --batch-tokens 4194304
step compare_cpu_cuda 60 "$PY" - "$OUT/analyze_cpu.json" "$OUT/analyze_cuda.json" <<'EOF'
import json, math, sys
cpu, gpu = (json.load(open(p))["metrics"] for p in sys.argv[1:3])
bad = []
def walk(a, b, path):
    if isinstance(a, dict):
        if a.keys() != b.keys():
            bad.append((path, "keys", sorted(set(a) ^ set(b))))
        for k in a.keys() & b.keys():
            walk(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, list):
        if len(a) != len(b):
            bad.append((path, "length", len(a), len(b)))
        for i, (x, y) in enumerate(zip(a, b)):
            walk(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        if not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9):
            bad.append((path, a, b))
    elif a != b:
        bad.append((path, a, b))
walk(cpu, gpu, "")
print(f"{len(cpu)} figures compared; {len(bad)} outside 1e-6 relative")
for item in bad[:50]:
    print(item)
sys.exit(1 if bad else 0)
EOF

# 4. The benchmark: CUDA (one process, decoding ahead into pinned memory) and the CPU (--workers = all cores).
step bench_cuda 150 "$PY" bench/run.py --tokens 2e8 --rounds 2 --only decode,analyze,compare-prox \
  --json "$OUT/bench_cuda.json" --device cuda --batch-tokens 4194304
step bench_cpu 120 "$PY" bench/run.py --tokens 2e8 --rounds 2 --only decode,analyze,compare-prox \
  --json "$OUT/bench_cpu.json"
step bench_cpu_workers 120 "$PY" bench/run.py --tokens 2e8 --rounds 1 --only analyze --workers 1,4,10 \
  --json "$OUT/bench_workers.json"

echo "done; logs in $OUT" | tee -a "$SUMMARY"
