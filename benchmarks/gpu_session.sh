#!/usr/bin/env bash
# Every GPU claim in one run of at most 8 minutes of device time, installs included, steps in priority order.
#
#   bash benchmarks/gpu_session.sh prepare   # here, with the package index: the wheels the GPU machine lacks -> .whl/
#   bash benchmarks/gpu_session.sh           # on the lent GPU machine (the device tool: carry [".whl"]); $OUT
#                                            # receives each step's log, JSON and summary line as the step ends
#
# The GPU machine has python3 with torch (CUDA), transformers, accelerate and peft, but no network, no datasets and no
# bitsandbytes (../shared/ENVIRONMENT.md). Limits in seconds, in priority order (from the H200 runs of 2026-11-28,
# benchmarks/RESULTS.md, cut to fit; the new steps' are estimates: a step cut at its limit keeps what it wrote):
#   installs from .whl/ 18;
#   1 host_adam        45  the host Adam in the training layout on the machine's 16 cores (cpu_optimizer.py
#                          --layout-only: ours with the thread budget vs torch's fused AdamW alone; no GPU needed), our
#                          fused kernel's JIT build (~30 s) included: first, so that even a short window measures it
#   2 cuda_tests       60  tests/test_cuda.py under TORCH_CUDA_SANITIZER=1, while DeepSpeed's CPU-Adam builds (~60 s)
#   3 train_qwen3     140  Qwen3-MoE shape (16 layers x 64 experts, top-8, d=1024) at 16k tokens: resident vs
#                          DeepSpeed ZeRO-2 offload vs ours (host tier, defaults), 2 timed steps, 1 round, `estimate`'s
#                          and `estimate --measure`'s predicted steps beside them (the JSON written after each variant)
#   4 train_qwen3_cap  85  2k tokens at a GPU memory cap where resident and ZeRO-2 do not fit: ZeRO-3 with parameter
#                          offload vs ours
#   5 decode           50  decoding the same family at 8 layers (bf16, batch 1), ours host (device cache off / half
#                          the experts) and disk against the resident model; 1 round of 16 tokens
#   6 lora_nf4         40  LoRA on every expert of Qwen3-30B-A3B's shape, nf4 experts on the disk tier, 2 of its 48
#                          layers, 2 steps; bitsandbytes travels unpacked in .whl/bnb (CUDA 13.0 and CPU libraries)
# The limits add up to 420 s; with installs ~440 s. A step that cannot finish within what is left of the
# GPU_SESSION_BUDGET_S (default 460 s from the start) is skipped and says so in the summary.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "prepare" ]; then
  mkdir -p .whl
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 evaluate==0.4.6 peft==0.21.2 \
    tokenizers==0.23.3 pydantic pydantic-core annotated-types typing-inspection typing_extensions hjson
  # DeepSpeed (the training peer, benchmark-only) has no wheel on the index: built here without its ops.
  DS_BUILD_OPS=0 python3 -m pip wheel --quiet deepspeed==0.19.8 --no-deps --no-build-isolation -w .whl
  # bitsandbytes: its wheel (41 MiB) is mostly one library per CUDA version; the GPU machine's torch is built for
  # CUDA 13.0, so only bitsandbytes/ with the CUDA 13.0 and CPU libraries travels (~5 MiB), on PYTHONPATH there.
  rm -rf .whl/bnb /tmp/bnb-wheel && mkdir -p .whl/bnb /tmp/bnb-wheel
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_24_x86_64 -d /tmp/bnb-wheel bitsandbytes==0.50.2
  python3 -m zipfile -e /tmp/bnb-wheel/bitsandbytes-*.whl /tmp/bnb-wheel/unpacked
  cp -r /tmp/bnb-wheel/unpacked/bitsandbytes .whl/bnb/
  find .whl/bnb -name 'libbitsandbytes_*' ! -name '*cuda130*' ! -name '*_cpu*' -delete
  du -sh .whl .whl/bnb  # the device tool carries at most 64 MiB
  exit 0
fi

OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
START=$SECONDS
BUDGET=${GPU_SESSION_BUDGET_S:-460}
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:.whl/bnb:. PYTHONUNBUFFERED=1
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
summary "start $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') installs $((SECONDS - START))s"

step() {  # step NAME SECONDS COMMAND...: run within its limit if the budget leaves room; log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt "$limit" ]; then
    summary "$name skipped: ${left}s of the budget left, its limit is ${limit}s"
    return
  fi
  echo "== $name (limit ${limit}s, ${left}s left): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -20 "$OUT/$name.log"
  summary "$name rc=$rc $((SECONDS - t0))s $(grep -E '^(RESULT|[0-9]+ (passed|failed))' "$OUT/$name.log" | tail -1)"
}

nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))" \
  >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
python3 -c "import bitsandbytes" 2>/dev/null && HAS_BNB=1 || HAS_BNB=0
summary "bitsandbytes on this machine: $HAS_BNB"

# 1. The host Adam in the training layout (the machine's cores, no GPU work), on a quiet machine: first.
step host_adam 45 python3 benchmarks/cpu_optimizer.py --layout-only --quick --out "$OUT/host_adam.json"

# DeepSpeed's CPU-Adam builds in the background while step 2 runs (it needs it not).
( python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu adam built')"
) > "$OUT/builds.log" 2>&1 &
BUILDS=$!

# 2. The CUDA tests (the CPU suites' comparisons on the GPU, the slab, the device pins and cache, quantized uploads)
#    under the stream sanitizer.
XDIST=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
step cuda_tests 60 env TORCH_CUDA_SANITIZER=1 python3 -m pytest -q -p no:cacheprovider --tb=short -rfE $XDIST \
  tests/test_cuda.py
wait $BUILDS
summary "builds: $(tr '\n' ' ' < "$OUT/builds.log" | tail -c 200)"

# 3. Training at 16k tokens: resident vs DeepSpeed ZeRO-2 offload vs ours (host tier, defaults: pins on the GPU), with
#    `estimate`'s and `estimate --measure`'s predicted step beside each measured one.
step train_qwen3 140 python3 benchmarks/gpu_train_qwen3.py --tokens 16384 --variants resident,ds-zero2,host-pin \
  --steps 2 --rounds 1 --measure --out "$OUT/train_qwen3.json"

# 4. At a GPU memory cap where the resident model and ZeRO-2 do not fit (2k tokens): ZeRO-3 with parameter offload vs
#    ours; the others record OOM.
step train_qwen3_cap 85 python3 benchmarks/gpu_train_qwen3.py --tokens 2048 --gpu-memory-gb below-peers \
  --variants resident,ds-zero2,ds-zero3,host-pin --steps 2 --rounds 1 --out "$OUT/train_qwen3_cap.json"

# 5. Decoding (8 layers): ours host (device cache off / half the experts), ours disk, against the resident model.
step decode 50 python3 benchmarks/generate.py --device cuda --layers 8 --experts 64 --hidden 1024 --inter 512 \
  --top-k 8 --dtype bf16 --batch 1 --cache 256 --rounds 1 --new-tokens 16 --prompt-tokens 16 \
  --variants "ours host, device cache 0;ours host, device cache 1/2;ours disk, device cache 0" --out "$OUT/decode.json"

# 6. LoRA on nf4 experts at Qwen3-30B-A3B's shape (bitsandbytes carried in .whl/bnb).
if [ "$HAS_BNB" = 1 ]; then
  step lora_nf4 40 python3 benchmarks/real_shape_lora.py --device cuda --layers 2 --steps 2 --cache-experts 256 \
    --offload-dir /tmp/real-shape-experts --out "$OUT/lora_nf4.json"
else
  summary "lora_nf4 skipped: bitsandbytes did not import (run 'prepare' here first: it unpacks it into .whl/bnb)"
fi

summary "end $((SECONDS - START))s of ${BUDGET}s"
