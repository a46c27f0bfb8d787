#!/usr/bin/env bash
# One-command GPU check (< 8 minutes on one modern GPU): the GPU-only tests, the loader, model and training
# benchmarks and the profiler, with every JSON/PNG/log under one folder.
#
#   bash tools/gpu_check.sh [OUT_DIR]        (default: gpu_out; PY=... picks the interpreter)
#
# Needs mmfast installed (bash scripts/setup.sh) with a CUDA build of torch and nvidia-dali-cuda120.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-gpu_out}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
step() { echo "== $*" | tee -a "$OUT/log.txt"; }

step "device"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
"$PY" -c "import torch, nvidia.dali as d; print(torch.__version__, torch.cuda.get_device_name(0), 'DALI', d.__version__)" \
  | tee -a "$OUT/log.txt" || { echo "no CUDA device or DALI: stop"; exit 1; }

step "GPU tests"
timeout 240 "$PY" -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -n 30 | tee "$OUT/gpu_tests.txt"

DATA=$("$PY" -c "from mmfast.benchdata import prepared_photos; print(prepared_photos())")
step "loader benchmark (512 real 800x600 photos, 224 px, batch 64)"
timeout 150 "$PY" tools/bench_loader.py --data "$DATA" --rounds 2 --epochs 2 --json "$OUT/bench_loader.json" 2>&1 | tail -n 8 \
  | tee -a "$OUT/log.txt"

step "model step times (ResNet-50 + BERT-base shape, 224 px, batch 64, fp16)"
timeout 90 "$PY" tools/bench_models.py --preset resnet50-bert --text-model bert-base-random --batch-size 64 \
  --steps 10 --json "$OUT/bench_models.json" 2>&1 | tail -n 5 | tee -a "$OUT/log.txt"

step "training benchmark (DataLoader vs mmfast, fp32 vs fp16)"
timeout 150 "$PY" tools/bench_train.py --data "$DATA" --preset minilm --image-size 224 --batch-size 64 --steps 20 --rounds 1 \
  --json "$OUT/bench_train.json" --png "$OUT/bench_train.png" 2>&1 | tail -n 12 | tee -a "$OUT/log.txt"

step "profiler"
timeout 90 "$PY" tools/profile.py --data "$DATA" --preset minilm --image-size 224 --batch-size 64 --steps 30 \
  --out "$OUT/profile" 2>&1 | tail -n 16 | tee -a "$OUT/log.txt"
echo "outputs in $OUT/"
