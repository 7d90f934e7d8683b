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
#include <c10/util/Half.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

// Round to nearest even, as torch's float -> bfloat16 conversion; NaN stays a (quiet) NaN.
static inline uint16_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

// One tensor of the call: its place in the concatenated element range and its own step's constants.
struct Span {
  float* p; const float* g; float* m; float* v; uint16_t* c;
  int64_t start, n;
  float step_size, bc2_sqrt, decay, l2;
};

struct Common { float b2, one_minus_b1, one_minus_b2, eps, unscale, clip; };

// The gradient is unscaled, then clipped, each a rounding of its own (as the separate passes it replaces), then
// torch's AdamW in fp32, operation by operation (no FMA contraction), so the split of the range changes no bit.
template <int COPY, bool UNSCALE, bool CLIP>
static void step_range(const Span& s, const Common& k, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float g = s.g[i];
    if (UNSCALE) g = g * k.unscale;
    if (CLIP) g = g * k.clip;
    float w = s.p[i] * s.decay;
    float gi = g + s.l2 * s.p[i];
    float mi = s.m[i] + k.one_minus_b1 * (gi - s.m[i]);  // torch: exp_avg.lerp_(grad, 1 - beta1)
    float vi = k.b2 * s.v[i] + k.one_minus_b2 * gi * gi;
    float denom = std::sqrt(vi) / s.bc2_sqrt + k.eps;
    w = w - s.step_size * mi / denom;
    s.m[i] = mi;
    s.v[i] = vi;
    s.p[i] = w;
    if (COPY == 1) s.c[i] = bf16_bits(w);
    if (COPY == 2) s.c[i] = c10::Half(w).x;
  }
}

using RangeFn = void (*)(const Span&, const Common&, int64_t, int64_t);

template <int COPY>
static RangeFn pick(bool unscale, bool clip) {
  if (unscale) return clip ? step_range<COPY, true, true> : step_range<COPY, true, false>;
  return clip ? step_range<COPY, false, true> : step_range<COPY, false, false>;
}

static void check_state(const at::Tensor& t, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel,
              "adamw_many_: fp32 contiguous CPU tensors of one size per parameter expected");
}

// One AdamW step of every tensor given (each with its own step count and decay), in one parallel region of
// `threads` threads over all their elements together, writing each compute copy (bf16/fp16) in the same pass.
// Runs without the GIL: the Python threads launching device work and handing gradients over go on meanwhile.
void adamw_many_(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
                 std::vector<at::Tensor> exp_avg_sqs, std::vector<at::Tensor> copies, std::vector<double> steps,
                 std::vector<bool> decays, double lr, double beta1, double beta2, double eps, double weight_decay,
                 bool decoupled, std::optional<double> unscale, std::optional<double> clip, int64_t threads) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && copies.size() == n &&
              steps.size() == n && decays.size() == n, "adamw_many_: one entry per parameter in every list");
  int mode = 0;
  std::vector<Span> spans;
  spans.reserve(n);
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    for (const auto& t : {params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]}) check_state(t, numel);
    const auto& c = copies[i];
    TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.numel() == numel &&
                (c.scalar_type() == at::kBFloat16 || c.scalar_type() == at::kHalf),
                "adamw_many_: each copy must be a contiguous bf16/fp16 CPU tensor of its parameter's size");
    const int m = c.scalar_type() == at::kBFloat16 ? 1 : 2;
    TORCH_CHECK(mode == 0 || mode == m, "adamw_many_: the copies of one call share a dtype");
    mode = m;
    const double bias_correction1 = 1.0 - std::pow(beta1, steps[i]);
    const double bias_correction2 = 1.0 - std::pow(beta2, steps[i]);
    const double wd = decays[i] ? weight_decay : 0.0;
    spans.push_back({params[i].data_ptr<float>(), grads[i].data_ptr<float>(), exp_avgs[i].data_ptr<float>(),
                     exp_avg_sqs[i].data_ptr<float>(), reinterpret_cast<uint16_t*>(c.data_ptr()), total, numel,
                     static_cast<float>(lr / bias_correction1), static_cast<float>(std::sqrt(bias_correction2)),
                     decoupled ? static_cast<float>(1.0 - lr * wd) : 1.0f,
                     decoupled ? 0.0f : static_cast<float>(wd)});
    total += numel;
  }
  if (total == 0) return;
  const Common k{static_cast<float>(beta2), static_cast<float>(1.0 - beta1), static_cast<float>(1.0 - beta2),
                 static_cast<float>(eps), static_cast<float>(unscale.value_or(1.0)),
                 static_cast<float>(clip.value_or(1.0))};
  const RangeFn fn = mode == 1 ? pick<1>(unscale.has_value(), clip.has_value())
                               : pick<2>(unscale.has_value(), clip.has_value());
  // Below this many elements a fork and join costs more than the step.
  const int team = total < 32768 ? 1 : static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, total / 4096)));
  const int64_t unit = 64;  // each thread's range starts on a 256-byte boundary of the concatenated range
#pragma omp parallel num_threads(team) if (team > 1)
  {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t units = (total + unit - 1) / unit, per = (units + nt - 1) / nt;
    const int64_t begin = std::min(total, t * per * unit), end = std::min(total, (t + 1) * per * unit);
    auto it = std::upper_bound(spans.begin(), spans.end(), begin,
                               [](int64_t x, const Span& s) { return x < s.start; });
    for (auto s = it == spans.begin() ? it : it - 1; s != spans.end() && s->start < end; ++s) {
      const int64_t b = std::max(begin, s->start) - s->start, e = std::min(end, s->start + s->n) - s->start;
      if (b < e) fn(*s, k, b, e);
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adamw_many_", &adamw_many_, pybind11::call_guard<pybind11::gil_scoped_release>());
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
        name = f"hf_moe_offload_adamw_many_{isa.lower()}"
        clear_stale_lock(name)
        logger.info("compiling the fused AdamW + compute-copy kernel for %s (once per machine, cached)", isa)
        return load_inline(name=name, cpp_sources=_SOURCE,  # binds itself (PYBIND11_MODULE): without the GIL
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


def adamw_many(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], copies: list[torch.Tensor], steps: list[int], decays: list[bool], *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
               grad_scale: float | None = None, clip_coef: float | None = None, threads: int | None = None) -> None:
    """One AdamW step of every tensor (each with its own step count, already incremented: the count this step uses,
    and its own `decays` flag for `weight_decay`) that also writes each `copies[i]` (bf16/fp16, the same size), in one
    parallel region of `threads` threads (default: the calling thread's intra-op team, `torch.get_num_threads()`)
    without the GIL. Each gradient is read divided by `grad_scale` and times `clip_coef` (each a rounding of its own,
    as `prepare_grads_`'s passes) but left as it was. Only where `fits`."""
    kernel().adamw_many_(params, grads, exp_avgs, exp_avg_sqs, copies, [float(s) for s in steps], decays, lr, beta1,
                         beta2, eps, weight_decay, decoupled, None if grad_scale is None else 1.0 / grad_scale,
                         clip_coef, torch.get_num_threads() if threads is None else threads)


__all__ = ["adamw_many", "clear_stale_lock", "fits", "kernel"]
