"""AdamW that writes the compute-dtype copy in the pass that updates the fp32 master.

Where the store streams bf16/fp16 copies of the experts (the default under autocast on a GPU), every host step must
also refresh the copy. Done as a second pass (torch's fused AdamW, then `copy.copy_(param)`), the refresh reads the
fp32 weights back and converts them: a third of the Adam step's own time on the 2-core CPU here
(benchmarks/cpu_optimizer.py). DeepSpeed's CPU-Adam writes its fp16 copy in the same loop; so does this kernel, a
small C++ extension compiled at first use (torch.utils.cpp_extension; ~30 s, cached under
`~/.cache/torch_extensions`). Its arithmetic is torch's AdamW in fp32 (bias corrections in float64, as torch's fused
kernel), element by element; its rounding may differ from torch's vectorized kernel in the last bit of an element,
which Adam's own sensitivity bounds like any kernel difference (tests/test_fused_adam.py). Without a compiler, or with
`HF_MOE_OFFLOAD_FUSED_ADAM=0`, the two passes run instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>

// Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays a (quiet) NaN.
static inline uint16_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

template <bool BF16>
static void adamw_copy_range(float* p, const float* g, float* m, float* v, uint16_t* c, int64_t begin, int64_t end,
                             float step_size, float bc2_sqrt, float b2, float one_minus_b1, float one_minus_b2,
                             float decay, float l2, float eps) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float w = p[i] * decay;
    float gi = g[i] + l2 * p[i];
    float mi = m[i] + one_minus_b1 * (gi - m[i]);  // torch: exp_avg.lerp_(grad, 1 - beta1)
    float vi = b2 * v[i] + one_minus_b2 * gi * gi;
    float denom = std::sqrt(vi) / bc2_sqrt + eps;
    w = w - step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
    p[i] = w;
    c[i] = BF16 ? bf16_bits(w) : c10::Half(w).x;
  }
}

void adamw_copy_(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, at::Tensor copy,
                 double lr, double beta1, double beta2, double eps, double weight_decay, double step,
                 bool decoupled) {
  for (const auto& t : {param, grad, exp_avg, exp_avg_sq}) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
                "adamw_copy_: fp32 contiguous CPU tensors expected");
    TORCH_CHECK(t.numel() == param.numel(), "adamw_copy_: sizes differ");
  }
  TORCH_CHECK(copy.device().is_cpu() && copy.is_contiguous() && copy.numel() == param.numel() &&
              (copy.scalar_type() == at::kBFloat16 || copy.scalar_type() == at::kHalf),
              "adamw_copy_: the copy must be a contiguous bf16/fp16 CPU tensor of the same size");
  float* p = param.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  const bool bf16 = copy.scalar_type() == at::kBFloat16;
  uint16_t* c = reinterpret_cast<uint16_t*>(copy.data_ptr());
  const double bias_correction1 = 1.0 - std::pow(beta1, step);
  const double bias_correction2 = 1.0 - std::pow(beta2, step);
  const float step_size = static_cast<float>(lr / bias_correction1);
  const float bc2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float b2 = static_cast<float>(beta2);
  const float one_minus_b1 = static_cast<float>(1.0 - beta1), one_minus_b2 = static_cast<float>(1.0 - beta2);
  const float decay = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  const float l2 = decoupled ? 0.0f : static_cast<float>(weight_decay);
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, param.numel(), 16384, [&](int64_t begin, int64_t end) {
    if (bf16)
      adamw_copy_range<true>(p, g, m, v, c, begin, end, step_size, bc2_sqrt, b2, one_minus_b1, one_minus_b2, decay,
                             l2, epsf);
    else
      adamw_copy_range<false>(p, g, m, v, c, begin, end, step_size, bc2_sqrt, b2, one_minus_b1, one_minus_b2, decay,
                              l2, epsf);
  });
}
"""

_ISA_FLAGS = {"AVX2": ["-mavx2", "-mfma", "-mf16c"],
              "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]}
_lock = threading.Lock()
_kernel = None  # the module, False once it could not be built
# A build takes about 30 s. torch guards it with a lock file that records no owner, and waits for it forever: a lock
# this much older than a build was left by a killed process, and is removed.
STALE_LOCK_SECONDS = 600


def kernel():
    """The compiled extension (built on first call), or None where it cannot be (then the caller takes two passes)."""
    global _kernel
    if _kernel is None:
        with _lock:
            if _kernel is None:
                _kernel = _build()
    return _kernel or None


def _build():
    if os.environ.get("HF_MOE_OFFLOAD_FUSED_ADAM", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load_inline

        # The vector ISA torch itself picked on this CPU: in the name too, so that a cache shared by unlike
        # machines never loads a build for another.
        isa = torch.backends.cpu.get_cpu_capability()
        flags = _ISA_FLAGS.get(isa, [])
        name = f"hf_moe_offload_adamw_copy_{isa.lower()}"
        clear_stale_lock(name)
        logger.info("compiling the fused AdamW + compute-copy kernel for %s (once per machine, cached)", isa)
        return load_inline(name=name, cpp_sources=_SOURCE,
                           functions=["adamw_copy_"],
                           # -fno-math-errno lets sqrt vectorize; no FMA contraction: torch's rounding, op by op.
                           extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", *flags],
                           extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # noqa: BLE001 (no compiler, no headers: the two-pass path is correct too)
        logger.warning("fused AdamW kernel unavailable (%s): the compute copies are refreshed in a second pass", err)
        return False


def clear_stale_lock(name: str) -> bool:
    """Remove extension `name`'s build lock if it is older than `STALE_LOCK_SECONDS` (a build killed midway).
    Returns whether one was removed."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
        age = time.time() - os.path.getmtime(lock)
    except (ImportError, OSError):  # no lock (the usual case), or a torch without the helper
        return False
    if age <= STALE_LOCK_SECONDS:
        return False  # another process may be building right now: torch waits for it
    logger.warning("removing the stale build lock %s (%.0f min old: left by a build that was killed)", lock, age / 60)
    with contextlib.suppress(FileNotFoundError):
        os.remove(lock)
    return True


def fits(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
         exp_avg_sqs: list[torch.Tensor], copies: list[torch.Tensor]) -> bool:
    """Whether `adamw_with_copy` can step these: fp32 contiguous CPU state, bf16/fp16 contiguous copies, and the
    kernel built (building it on first call)."""
    ok = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
             for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts)
    ok = ok and all(c.device.type == "cpu" and c.dtype in (torch.bfloat16, torch.float16) and c.is_contiguous()
                    for c in copies)
    return ok and kernel() is not None


def adamw_with_copy(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                    exp_avg_sqs: list[torch.Tensor], copies: list[torch.Tensor], steps: list[int], *, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool) -> None:
    """One AdamW step per tensor (each with its own step count, already incremented: the count this step uses) that
    also writes each `copies[i]` (bf16/fp16, the same size). Only where `fits`."""
    k = kernel()
    for p, g, m, v, c, step in zip(params, grads, exp_avgs, exp_avg_sqs, copies, steps):
        k.adamw_copy_(p, g, m, v, c, lr, beta1, beta2, eps, weight_decay, float(step), decoupled)


__all__ = ["adamw_with_copy", "clear_stale_lock", "fits", "kernel"]
