#!/usr/bin/env bash
# One GPU session in under 10 minutes: the CUDA tests under the stream sanitizer, then the GPU benchmarks.
#
#   bash benchmarks/gpu_session.sh prepare   # here, with the package index: wheels the GPU machine lacks -> .whl/
#   bash benchmarks/gpu_session.sh           # on the lent GPU machine (the device tool: carry [".whl"]); $OUT
#                                            # receives the logs and the benchmarks' JSON
#
# The GPU machine has python3 with torch (CUDA), transformers, accelerate and peft but no network and no datasets;
# ../shared/ENVIRONMENT.md lists what worked there. Each step has its own time limit so that one hang does not eat
# the session; the summary at the end says which steps passed.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "prepare" ]; then
  mkdir -p .whl
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 evaluate==0.4.6 peft==0.21.2 \
    tokenizers==0.23.3 bitsandbytes==0.50.2 pydantic pydantic-core annotated-types typing-inspection \
    typing_extensions hjson
  # DeepSpeed (the training peer, benchmark-only) has no wheel on the index: built here without its ops; its CPU-Adam
  # compiles at first use on the GPU machine (~60 s).
  DS_BUILD_OPS=0 python3 -m pip wheel --quiet deepspeed==0.19.8 --no-deps --no-build-isolation -w .whl
  ls -la .whl
  exit 0
fi

OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:.
status=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -25 "$OUT/$name.log"
  status+=("$name rc=$rc $((SECONDS - t0))s")
}

nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))" \
  >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

# 0. The host Adam's one-pass kernel (optim/fused_adam.py), built once here rather than inside a timed step.
step fused_adam_build 90 python3 -c "from hf_moe_offload.optim.fused_adam import kernel; print(kernel())"
# 1. The CUDA tests (the CPU suites' comparisons on the GPU) and the slab's, under the stream sanitizer.
step cuda_tests 120 env TORCH_CUDA_SANITIZER=1 python3 -m pytest -q -x -p no:cacheprovider -n 8 tests/test_cuda.py
# 2. Issue 35: offloaded training of the Qwen3-MoE shape against DeepSpeed ZeRO-Offload (2k and 16k tokens per step),
#    and under a 16 GB cap (the resident model OOMs, the host tier trains).
step qwen3_train 240 python3 benchmarks/gpu_offload.py --family qwen3_moe --tokens 2048,16384
# 3. Issue 37: decoding the same shape (bf16, batch 1 and 8): resident, accelerate's CPU and disk offload, ours host
#    and disk (a quarter of the experts in the host cache) with the device cache at 0, 1/4, 1/2 of the experts.
step qwen3_generate 150 python3 benchmarks/generate.py --device cuda --layers 16 --experts 64 --hidden 1024 \
  --inter 512 --top-k 8 --dtype bf16 --batch 1,8 --cache 256 --rounds 2 --new-tokens 32 --prompt-tokens 16
step qwen3_cap16 60 python3 benchmarks/gpu_offload.py --family qwen3_moe --gpu-memory-gb 16 --variants resident,host,host-pin
# 4. Issue 38: LoRA on every expert matrix, peft resident vs streamed (host, disk; bf16, int8, nf4 stores), bf16.
step lora_experts 120 python3 benchmarks/lora_experts.py --device cuda --layers 4 --experts 32 --hidden 1024 \
  --expert-ffn 512 --steps 5 --rounds 1 --out "$OUT/lora_experts_cuda.json"
# 5. Issue 38: Qwen3-30B-A3B's shape (8 of its 48 layers: the store is filled and quantized on the host at ~7-11
#    experts/s, so all 6144 experts would take the whole device budget), nf4 experts on the disk tier, LoRA on every
#    expert, 3 steps on the GPU.
step real_shape 240 python3 benchmarks/real_shape_lora.py --device cuda --layers 8 --steps 3 --cache-experts 512 \
  --offload-dir /tmp/real-shape-experts --out "$OUT/real_shape_lora_cuda.json"
# (The MoE-GPT table of earlier sessions, `benchmarks/gpu_offload.py --tiers host,host-bf16`, runs when time is left.)

cp benchmarks/gpu_train_qwen3*.json benchmarks/gpu_offload*.json benchmarks/generate*-cuda.json "$OUT"/ 2>/dev/null
printf '%s\n' "${status[@]}" | tee "$OUT/summary.txt"
