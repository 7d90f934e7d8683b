"""What a training run records for its figures and its model card: tokens per expert per logging interval, offload
telemetry totals, and the plots drawn from them.

- `ExpertLoadCallback`: counts the tokens routed to every expert of every MoE layer during training (a forward
  pre-hook on each experts module reads the `top_k_index` of transformers' experts signature, so every family is
  counted the same way), one row per logging step, summed over processes under `accelerate launch`. It adds
  `expert_load/max_over_mean` and the number of dead experts (no token in the interval) to the logs.
- `OffloadTotalsCallback`: sums the offload engine's counters over the run (bytes read/written, stalls, cache hits),
  although `ExpertOptimizerCallback` resets them at every log.
- `TrainingProgressCallback` / `use_progress_bar`: one progress bar with loss, tokens/s and the cache hit rate.
- `plot_expert_load` / `plot_training_curves`: PNGs with matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict

import torch
from torch import nn
from transformers import ProgressCallback, TrainerCallback

from ..families.moe_path import experts_layers
from ..offload.api import get_offload_engine
from ..offload.telemetry import OffloadStats, add_to_logs

logger = logging.getLogger(__name__)


def routed_counts_tensor(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert of one experts call, on the routing's device (ids >= num_experts are dropped assignments)."""
    return torch.bincount(top_k_index.detach().reshape(-1), minlength=num_experts + 1)[:num_experts]


def routed_counts(top_k_index: torch.Tensor, num_experts: int) -> list[int]:
    """`routed_counts_tensor` as a list (a host sync)."""
    return routed_counts_tensor(top_k_index, num_experts).tolist()


def _all_reduce_counts(counts: list[list[int]], device: torch.device) -> list[list[int]]:
    """Sum per-expert counts over processes (every rank calls this from on_log, which all ranks run)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()) or not counts:
        return counts
    if torch.distributed.get_world_size() == 1:
        return counts
    if torch.distributed.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor(counts, dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t)
    return t.cpu().tolist()


def load_summary(counts: Sequence[int]) -> dict[str, float]:
    """Balance figures of one layer's token counts: max/mean, min/mean, coefficient of variation, idle experts."""
    total = sum(counts)
    if not counts or total == 0:
        return {"tokens": 0, "max_over_mean": 0.0, "min_over_mean": 0.0, "cv": 0.0, "idle_experts": len(counts),
                "top_expert_share": 0.0}
    mean = total / len(counts)
    var = sum((c - mean) ** 2 for c in counts) / len(counts)
    return {
        "tokens": int(total),
        "max_over_mean": max(counts) / mean,
        "min_over_mean": min(counts) / mean,
        "cv": math.sqrt(var) / mean,
        "idle_experts": sum(1 for c in counts if c == 0),
        "top_expert_share": max(counts) / total,
    }


class ExpertLoadCallback(TrainerCallback):
    """Tokens per expert per MoE layer, accumulated over each logging interval of training (not evaluation).

    After training: `history` is a list of `{"step": int, "counts": [[tokens of expert e] per layer]}` and
    `layer_names` names the layers; `totals()` sums the whole run.
    """

    def __init__(self) -> None:
        self.layer_names: list[str] = []
        self.history: list[dict] = []
        # Tokens per expert since the last log, per layer: a tensor on the routing's device, read back only at a log
        # (a per-layer `.tolist()` in the forward would synchronize the GPU once per MoE layer).
        self._acc: list[torch.Tensor | None] = []
        self._widths: list[int] = []
        self._handles: list = []
        self._model: nn.Module | None = None

    # --- collection ---
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._model = model
        experts = experts_layers(model)
        if not experts:
            logger.warning("ExpertLoadCallback: %s has no experts module hf_moe_offload knows; no expert load is "
                           "collected", type(model).__name__)
            return
        self.layer_names = [n for n, _, _ in experts]
        self._widths = [layout.num_experts for _, _, layout in experts]
        self._acc = [None] * len(experts)
        for i, (_, module, layout) in enumerate(experts):

            def hook(module, args, kwargs, i=i, num_experts=layout.num_experts):
                top_k_index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
                if module.training and isinstance(top_k_index, torch.Tensor):
                    counts = routed_counts_tensor(top_k_index, num_experts)
                    self._acc[i] = counts if self._acc[i] is None else self._acc[i] + counts

            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _snapshot(self, args, step: int) -> list[list[int]] | None:
        if not self._acc:
            return None
        counts = [t.tolist() if t is not None else [0] * w for t, w in zip(self._acc, self._widths)]
        counts = _all_reduce_counts(counts, args.device)
        self._acc = [None] * len(self._acc)
        if not any(sum(r) for r in counts):
            return None
        self.history.append({"step": step, "counts": counts})
        return counts

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:  # training logs only (evaluation has its own)
            return
        counts = self._snapshot(args, state.global_step)
        if counts:
            ratios = [load_summary(r)["max_over_mean"] for r in counts if sum(r)]
            dead = sum(1 for r in counts for c in r if c == 0)  # experts no token reached in this interval
            add_to_logs(state, logs, {"expert_load/max_over_mean": round(sum(ratios) / len(ratios), 4),
                                      "expert_load/dead_experts": dead})

    def on_train_end(self, args, state, control, **kwargs):
        if any(t is not None for t in self._acc):
            self._snapshot(args, state.global_step)  # the tail after the last log
        for h in self._handles:
            h.remove()
        self._handles = []

    # --- results ---
    def totals(self) -> list[list[int]]:
        """Tokens per expert per layer over the whole run."""
        if not self.history:
            return []
        out = [[0] * len(r) for r in self.history[0]["counts"]]
        for row in self.history:
            for l, counts in enumerate(row["counts"]):
                for e, c in enumerate(counts):
                    out[l][e] += c
        return out

    def summary(self) -> dict:
        """Per-layer balance over the run and in the last logging interval (what the card and metrics show)."""
        if not self.history:
            return {}
        totals = self.totals()
        last = self.history[-1]["counts"]
        return {
            "layers": [
                {"name": name, "run": load_summary(t), "last_interval": load_summary(lc)}
                for name, t, lc in zip(self.layer_names, totals, last)
            ],
            "logging_steps": [h["step"] for h in self.history],
        }


class OffloadTotalsCallback(TrainerCallback):
    """Sums the offload engine's counters over the whole run, evaluation included: `OffloadStats.start_run` /
    `end_run` (the stats keep the totals of the intervals `ExpertOptimizerCallback.on_log` resets, whatever the
    order of the callbacks)."""

    def __init__(self) -> None:
        self.totals = OffloadStats()
        self.tier: str | None = None
        self._stats: OffloadStats | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        engine = get_offload_engine(model) if model is not None else None
        if engine is None:
            return
        self.tier = getattr(engine, "tier", None)
        self._stats = engine.stats
        self._stats.start_run()
        self.totals = OffloadStats()

    def on_train_end(self, args, state, control, **kwargs):
        if self._stats is None:
            return
        self.totals = self._stats.end_run()
        self._stats = None

    def as_dict(self) -> dict[str, float]:
        """Totals in MB and seconds, plus the cache hit rate and the stall fraction."""
        t = self.totals
        d = {k: v for k, v in asdict(t).items() if k != "tokens_per_expert"}
        lookups = t.cache_hits + t.cache_misses
        return {
            "mode": self.tier,
            "disk_read_MB": round(t.disk_read_bytes / 2**20, 2),
            "disk_write_MB": round(t.disk_write_bytes / 2**20, 2),
            "disk_mapped_MB": round(t.disk_mapped_bytes / 2**20, 2),  # forwards computed from the mapped files
            "h2d_MB": round(t.h2d_bytes / 2**20, 2),
            "d2h_MB": round(t.d2h_bytes / 2**20, 2),
            "cache_hits": d["cache_hits"],
            "cache_misses": d["cache_misses"],
            "evictions": d["evictions"],
            "cache_hit_rate": round(t.cache_hits / lookups, 4) if lookups else None,
            "stall_s": round(t.stall_seconds, 3),
            "streamed_compute_s": round(t.compute_seconds, 3),
            "stall_fraction": round(t.stall_seconds / t.compute_seconds, 4) if t.compute_seconds else None,
        }

    def hit_rate(self) -> float | None:
        """The disk tier's cache hit rate over the run so far (None for the other tiers, or before training)."""
        if self.tier != "disk" or self._stats is None:
            return None
        totals = self._stats.run_totals()
        lookups = totals.cache_hits + totals.cache_misses
        return totals.cache_hits / lookups if lookups else None


# --- the terminal ---
_EVAL_BOOKKEEPING = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time")


class TrainingProgressCallback(ProgressCallback):
    """One progress bar: loss, throughput and the disk tier's cache hit rate in its postfix, refreshed at every log;
    each evaluation as one line above it. The Trainer's per-log dict (15+ fields with offload telemetry) is not
    printed; all of it is still in `state.log_history`, `metrics.json` and the `report_to` integrations.

    Throughput is tokens/s when the job knows its tokens per optimizer step, else examples/s; time spent evaluating
    is left out. Install with `use_progress_bar`.
    """

    def __init__(self, tokens_per_step: int | None = None, offload_totals: OffloadTotalsCallback | None = None):
        super().__init__()
        self.tokens_per_step = tokens_per_step
        self.offload_totals = offload_totals
        self._mark: tuple[float, int] | None = None  # (time, global step) of the last log or evaluation

    def on_train_begin(self, args, state, control, **kwargs):
        super().on_train_begin(args, state, control, **kwargs)
        self._mark = (time.perf_counter(), state.global_step)

    def on_evaluate(self, args, state, control, **kwargs):
        super().on_evaluate(args, state, control, **kwargs)
        self._mark = (time.perf_counter(), state.global_step)  # the next rate leaves the evaluation out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or self.training_bar is None or not logs:
            return
        if "loss" in logs:
            post = {"loss": f"{float(logs['loss']):.3f}"}
            now, step = time.perf_counter(), state.global_step
            if self._mark is not None and step > self._mark[1] and now > self._mark[0]:
                steps_per_s = (step - self._mark[1]) / (now - self._mark[0])
                if self.tokens_per_step:
                    post["tok/s"] = f"{self.tokens_per_step * steps_per_s:,.0f}"
                else:
                    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
                    post["ex/s"] = f"{per_step * steps_per_s:,.1f}"
            self._mark = (now, step)
            hit = self.offload_totals.hit_rate() if self.offload_totals is not None else None
            if hit is not None:
                post["hit"] = f"{hit:.2f}"
            self.training_bar.set_postfix(post, refresh=True)
        elif any(k.startswith("eval_") for k in logs):
            shown = [f"{k[len('eval_'):]} {v:.4g}" for k, v in logs.items()
                     if k.startswith("eval_") and k not in _EVAL_BOOKKEEPING and isinstance(v, (int, float))]
            self.training_bar.write(f"step {state.global_step}: eval " + ", ".join(shown))


def use_progress_bar(trainer, tokens_per_step: int | None = None,
                     offload_totals: OffloadTotalsCallback | None = None) -> TrainingProgressCallback | None:
    """Replace the Trainer's default progress bar (which prints every log as a dict) by `TrainingProgressCallback`.
    Leaves a Trainer with `disable_tqdm=True` as it is (its printer is what such a user asked for)."""
    if trainer.args.disable_tqdm:
        return None
    for cb in list(trainer.callback_handler.callbacks):
        if type(cb) is ProgressCallback:  # exactly the default: `remove_callback(cls)` would match subclasses too
            trainer.callback_handler.remove_callback(cb)
    bar = TrainingProgressCallback(tokens_per_step, offload_totals)
    trainer.add_callback(bar)
    return bar


# --- plots ---
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; works without a display
    import matplotlib.pyplot as plt

    return plt


def plot_expert_load(history: list[dict], layer_names: Sequence[str], path: str, title: str = "Expert load") -> str:
    """One heatmap per MoE layer: expert (rows) x logging step (columns), colour = tokens / mean tokens per expert
    (1 = perfectly balanced), plus each layer's max/mean over training. Returns `path`."""
    if not history:
        raise ValueError("no expert load was recorded (did the run log at least once? set logging_steps)")
    plt = _pyplot()
    import numpy as np

    steps = [h["step"] for h in history]
    n_layers = len(history[0]["counts"])
    fig, axes = plt.subplots(n_layers + 1, 1, figsize=(8, 2.2 * n_layers + 2.4), squeeze=False)
    axes = axes[:, 0]
    vmax = 1.0
    rel_all = []
    for l in range(n_layers):
        m = np.array([h["counts"][l] for h in history], dtype=float).T  # (E, steps)
        mean = m.mean(axis=0, keepdims=True)
        rel = np.divide(m, mean, out=np.zeros_like(m), where=mean > 0)
        rel_all.append(rel)
        vmax = max(vmax, float(rel.max()))
    for l, rel in enumerate(rel_all):
        ax = axes[l]
        im = ax.imshow(rel, aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest",
                       extent=(-0.5, len(steps) - 0.5, rel.shape[0] - 0.5, -0.5))
        ax.set_ylabel("expert")
        name = layer_names[l] if l < len(layer_names) else f"layer {l}"
        ax.set_title(f"{name}: tokens per expert / mean", fontsize=9)
        ticks = list(range(0, len(steps), max(1, len(steps) // 8)))
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(steps[i]) for i in ticks], fontsize=7)
        fig.colorbar(im, ax=ax, fraction=0.025, pad=0.01)
    ax = axes[-1]
    for l, rel in enumerate(rel_all):
        ax.plot(steps, rel.max(axis=0), marker=".", label=layer_names[l] if l < len(layer_names) else f"layer {l}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training step")
    ax.set_ylabel("max / mean")
    ax.set_title("load imbalance (1 = balanced)", fontsize=9)
    ax.legend(fontsize=6, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_training_curves(log_history: list[dict], path: str, title: str = "Training") -> str:
    """Training loss per logging step and evaluation perplexity (or accuracy) per evaluation. Returns `path`."""
    plt = _pyplot()
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h) for h in log_history if "eval_loss" in h and "step" in h]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue")
    ax.set_xlabel("training step")
    ax.set_ylabel("loss")
    key = next((k for k in ("eval_perplexity", "eval_accuracy") if any(k in h for _, h in evals)), None)
    if key is not None:
        ax2 = ax.twinx()
        pts = [(s, h[key]) for s, h in evals if key in h]
        ax2.plot(*zip(*pts), marker="o", color="tab:orange", label=key.replace("eval_", "eval "))
        ax2.set_ylabel(key.replace("eval_", "eval "))
        if key == "eval_perplexity":
            ax2.set_yscale("log")
        ax2.legend(loc="upper center", fontsize=8)
    elif evals:
        ax.plot([s for s, _ in evals], [h["eval_loss"] for _, h in evals], marker="o", color="tab:orange",
                label="eval loss")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = [
    "ExpertLoadCallback",
    "OffloadTotalsCallback",
    "routed_counts",
    "load_summary",
    "plot_expert_load",
    "plot_training_curves",
]
