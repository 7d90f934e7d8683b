"""Choosing the pipeline granularity n and the restore strategy S at run time (MPMoE §4, MPipeMoE Eq. 10).

Two pieces, usable together or apart:

- `GranularitySearch`: Algorithm 1 (§4.1). For one strategy, maps a token batch size B to the best n with a cache C
  and a sorted table G of B-ranges per n, profiling only when B falls outside every known range, and then only the
  granularities between the neighbouring ranges, stopping at the turning point of the parabola-like cost curve.
- `PerformanceModel`: §4.2. Per-partition times of the three stage kinds (C: expert compute, S/R: dispatch/combine
  communication, M: host copies) from micro-benchmarked speeds W_comp, W_comm, W_mem (piecewise linear in the data
  volume, Fig. 9) and slowdown factors alpha(y, x) of y while x runs (§2.3, Fig. 3), composed by the pipeline
  paradigms of Fig. 8: paradigm 1 (no M: S4, keep), paradigm 2 (M after S and C: forward of S1-S3), paradigm 3
  (C after M: backward of S1-S3). The steady phase P2 of each paradigm is MPipeMoE's Eq. 10,
  C = max(q1 v_comp / (sigma W_comp), q2 v_comm / (mu W_comm), q3 v_mem / (eta W_mem)).

`PipelineConfigurator` joins them: for each candidate S, Algorithm 1 finds n (the cost function is the model's
estimate, or a real profile of the layer with method="profile"); the (n, S) with the lowest cost wins (§4.1, last
paragraph). Timings are all-reduced (MAX) over the default process group when torch.distributed is initialized, and
so is B, so every rank makes the same choice.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

INF = math.inf


# ----------------------------------------------------------------------------------------------------------------
# Algorithm 1: adaptive pipeline granularity search (§4.1)
# ----------------------------------------------------------------------------------------------------------------
class GranularitySearch:
    """Algorithm 1 for one restore strategy. `cost(B, n)` returns seconds (a profile or a model estimate).

    G maps n -> (B_floor, B_ceil), the B range whose best granularity is n; it starts as {n_min: (0, 1),
    n_max: (inf, inf)} (line 1; the paper bounds n to [2, 8], n_min=1 here lets "no pipelining" win at small B).
    """

    def __init__(self, cost: Callable[[int, int], float], n_min: int = 1, n_max: int = 8):
        if not 1 <= n_min < n_max:
            raise ValueError(f"need 1 <= n_min < n_max, got n_min={n_min}, n_max={n_max}")
        self.cost = cost
        self.n_min, self.n_max = n_min, n_max
        self.G: dict[int, tuple[float, float]] = {n_min: (0, 1), n_max: (INF, INF)}
        self.C: dict[int, int] = {}
        self.cache_hits = 0
        self.profiled: list[tuple[int, int]] = []  # every (B, n) whose cost was evaluated, in order

    def __call__(self, B: int) -> int:
        if B in self.C:  # lines 3-5
            self.cache_hits += 1
            return self.C[B]
        ranges = sorted(self.G.items())
        for n_i, (lo, hi) in ranges:  # line 6: B inside a known range
            if lo <= B <= hi:
                self.C[B] = n_i
                return n_i
        # lines 7-18: the closest range below B and the closest above bound the search
        below = [n_i for n_i, (lo, hi) in ranges if hi < B]
        above = [n_i for n_i, (lo, hi) in ranges if lo > B]
        n_floor = max(below) if below else self.n_min
        n_ceil = min(above) if above else self.n_max
        if n_floor > n_ceil:  # non-monotone history: fall back to the whole span
            n_floor, n_ceil = self.n_min, self.n_max
        n = self.search_best_granularity(B, n_floor, n_ceil)
        # lines 19-23: a new n gets the point range (B, B); a bound extends its range
        if n not in (n_floor, n_ceil) or n not in self.G:
            self.G[n] = (B, B)
        else:
            lo, hi = self.G[n]
            self.G[n] = (min(B, lo), max(B, hi))
        self.C[B] = n  # line 24
        return n

    def search_best_granularity(self, B: int, n_floor: int, n_ceil: int) -> int:
        """Scan n = n_floor..n_ceil; the cost is parabola-like in n (§4.1), so stop once it rises."""
        best_n, best_t, prev_t = n_floor, INF, INF
        for n in range(n_floor, n_ceil + 1):
            t = self.cost(B, n)
            self.profiled.append((B, n))
            if t < best_t:
                best_n, best_t = n, t
            if t > prev_t:  # turning point passed
                break
            prev_t = t
        return best_n


# ----------------------------------------------------------------------------------------------------------------
# Micro-benchmarked speeds (§4.2, Fig. 9) and slowdown factors (§2.3, Fig. 3)
# ----------------------------------------------------------------------------------------------------------------
KINDS = ("comp", "comm", "mem")


@dataclass
class Speeds:
    """W_comp (flop/s), W_comm (bytes/s), W_mem (bytes/s) as piecewise-linear functions of the volume of one op, and
    alpha[(y, x)] in (0, 1]: the fraction of y's speed left while x runs beside it (x in comp, comm, mem, all)."""

    points: dict[str, list[tuple[float, float]]]  # kind -> sorted (volume, speed)
    alpha: dict[tuple[str, str], float] = field(default_factory=dict)

    def speed(self, kind: str, volume: float) -> float:
        pts = self.points[kind]
        xs = [math.log(v) for v, _ in pts]
        x = math.log(max(volume, 1.0))
        if x <= xs[0]:  # below the smallest benchmark: the op costs at least its latency (constant time)
            return pts[0][1] * max(volume, 1.0) / pts[0][0]
        if x >= xs[-1]:
            return pts[-1][1]
        i = bisect.bisect_right(xs, x)
        f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return pts[i - 1][1] + f * (pts[i][1] - pts[i - 1][1])

    def slowdown(self, y: str, others: Sequence[str]) -> float:
        others = [o for o in others if o != y]
        if not others:
            return 1.0
        key = (y, others[0]) if len(others) == 1 else (y, "all")
        return self.alpha.get(key, 1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_best(fn: Callable[[], object], device: torch.device, reps: int = 3) -> float:
    """Best of `reps` timed calls after one warm-up (CUDA: synchronised around each)."""
    fn()  # warm-up
    _sync(device)
    best = INF
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _ops(hidden: int, intermediate: int, rows: int, dtype: torch.dtype, device: torch.device, comm_fn=None):
    """The three op kinds on `rows` dispatched rows: one expert GEMM, one dispatch, one host copy."""
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    w = torch.randn(intermediate, hidden, dtype=dtype, device=device)
    idx = torch.randperm(rows, device=device)
    host = torch.empty(rows, hidden, dtype=dtype, pin_memory=device.type == "cuda")
    ops = {
        "comp": (lambda: F.linear(x, w), 2.0 * rows * hidden * intermediate),
        "comm": ((lambda: comm_fn(x)) if comm_fn is not None else (lambda: x.index_select(0, idx)),
                 float(rows * hidden * x.element_size())),
        "mem": ((lambda: host.copy_(x, non_blocking=True)) if device.type == "cuda" else (lambda: x.clone()),
                float(rows * hidden * x.element_size())),
    }
    return ops


def _concurrent_time(target: Callable[[], object], others: list[Callable[[], object]], device: torch.device) -> float:
    """Time `target` while each of `others` loops beside it (threads on CPU; side streams on CUDA)."""
    stop = threading.Event()

    def loop(fn, stream):
        ctx = torch.cuda.stream(stream) if stream is not None else _null()
        with ctx:
            while not stop.is_set():
                fn()
                if stream is not None:
                    stream.synchronize()

    streams = [torch.cuda.Stream(device) if device.type == "cuda" else None for _ in others]
    threads = [threading.Thread(target=loop, args=(fn, s), daemon=True) for fn, s in zip(others, streams)]
    for t in threads:
        t.start()
    try:
        return time_best(target, device)
    finally:
        stop.set()
        for t in threads:
            t.join()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def measure_speeds(
    hidden: int,
    intermediate: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    rows: Sequence[int] = (16, 64, 256, 1024),
    comm_fn: Callable[[torch.Tensor], object] | None = None,
    measure_alpha: bool = True,
) -> Speeds:
    """Micro-benchmarks of §4.2: each op kind alone at several volumes, then the slowdowns at the largest one.

    `comm_fn(x)` times the real communication stage (e.g. an all-to-all of x); default: the local dispatch
    (index_select), the "communication" of a single process. Raw timings are MAX-reduced across ranks.
    NOTE: a `comm_fn` is a collective, and the slowdown measurements loop the *other* ops in background threads for
    as long as the timed op runs, a number of iterations that differs per rank; there the looping communication is
    the local dispatch instead (a collective is only ever run a fixed number of times, in the same order everywhere).
    """
    device = torch.device(device)
    times: list[float] = []
    vols: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in rows:
        ops = _ops(hidden, intermediate, r, dtype, device, comm_fn)
        for k in KINDS:
            fn, vol = ops[k]
            times.append(time_best(fn, device))
            vols[k].append(vol)
    pairs: list[tuple[str, str]] = []
    if measure_alpha:
        ops = _ops(hidden, intermediate, rows[-1], dtype, device, comm_fn)
        looped = _ops(hidden, intermediate, rows[-1], dtype, device) if comm_fn is not None else ops
        for y in KINDS:
            for x in KINDS + ("all",):
                if x == y:
                    continue
                others = [looped[o][0] for o in KINDS if o != y] if x == "all" else [looped[x][0]]
                pairs.append((y, x))
                times.append(_concurrent_time(ops[y][0], others, device))
    times = all_reduce_max(times, device)
    points, i = {k: [] for k in KINDS}, 0
    alone_last = {}
    for j, _ in enumerate(rows):
        for k in KINDS:
            points[k].append((vols[k][j], vols[k][j] / max(times[i], 1e-9)))
            alone_last[k] = times[i]
            i += 1
    alpha = {}
    for (y, x) in pairs:
        alpha[(y, x)] = min(1.0, alone_last[y] / max(times[i], 1e-9))
        i += 1
    return Speeds(points={k: sorted(v) for k, v in points.items()}, alpha=alpha)


def all_reduce_max(values: list[float], device: torch.device | str = "cpu", group=None) -> list[float]:
    """MAX over the ranks of `group` (identity when torch.distributed is not initialized), so every rank decides
    alike."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not values:
        return list(values)
    backend_device = torch.device(device) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=backend_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


# ----------------------------------------------------------------------------------------------------------------
# Performance model (§4.2, Fig. 8; MPipeMoE Table 2 / Eq. 10)
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpCounts:
    """Per-partition operation counts Q = [q_comp (GEMMs), q_comm (exchanges), q_mem (copies, in units of T_DI)]."""

    comp: float
    comm: float
    mem: float


def op_counts(strategy: str, hidden: int, intermediate: int) -> tuple[OpCounts, OpCounts]:
    """(forward, backward) Q of a strategy (MPipeMoE Table 2, with T_M copies counted as H/M T_DI units, Eq. 7-9).

    NOTE: recomputation here re-runs both expert GEMMs (T_M and T_DO: the router-weight gradient needs T_DO), so S3/S4
    add 2 GEMMs to backward, where the paper counts 1.
    """
    h = intermediate / hidden
    mem = {"keep": 0.0, "S1": 1.0 + h, "S2": h, "S3": 1.0, "S4": 0.0}[strategy]
    recompute = 2.0 if strategy in ("S3", "S4") else 0.0
    redispatch = 1.0 if strategy in ("S2", "S4") else 0.0
    return OpCounts(2.0, 2.0, mem), OpCounts(4.0 + recompute, 2.0 + redispatch, mem)


class PerformanceModel:
    """Estimated forward + backward time of one MoE layer with B dispatched rows, n partitions and strategy S."""

    def __init__(self, speeds: Speeds, hidden: int, intermediate: int, element_size: int = 4):
        self.speeds = speeds
        self.hidden, self.intermediate, self.element_size = hidden, intermediate, element_size

    def stage_times(self, rows: float, q: OpCounts) -> tuple[float, float, float]:
        """(t_C, t_comm, t_M) of one partition of `rows` rows (Eq. 7-9 volumes over piecewise speeds)."""
        sp = self.speeds
        gemm = 2.0 * rows * self.hidden * self.intermediate
        moved = rows * self.hidden * self.element_size
        t_c = q.comp * gemm / sp.speed("comp", gemm)
        t_comm = q.comm * moved / sp.speed("comm", moved)
        t_m = q.mem * moved / sp.speed("mem", moved) if q.mem else 0.0
        return t_c, t_comm, t_m

    def paradigm_time(self, n: int, t_c: float, t_comm: float, t_m: float, backward: bool) -> float:
        """Fig. 8: P0 (first stage alone) + (n-1) steady phases P1-P3 (bottleneck stream, with alpha) + P4 (drain)."""
        sp = self.speeds
        t_s = t_r = t_comm / 2  # dispatch and combine halves of the exchanges
        if t_m == 0.0:  # paradigm 1: S+R on one stream, C on the other
            steady = max((t_s + t_r) / sp.slowdown("comm", ["comp"]), t_c / sp.slowdown("comp", ["comm"]))
            return t_s + (n - 1) * steady + t_c + t_r
        steady = max(
            (t_s + t_r) / sp.slowdown("comm", ["comp", "mem"]),
            t_c / sp.slowdown("comp", ["comm", "mem"]),
            t_m / sp.slowdown("mem", ["comp", "comm"]),
        )  # Eq. 10 for one partition
        # the last combine and the last copy (forward), or the first combine and the first fetch (backward), overlap
        r_and_m = max(t_r / sp.slowdown("comm", ["mem"]), t_m / sp.slowdown("mem", ["comm"]))
        if not backward:  # paradigm 2: M follows S and C
            return t_s + (n - 1) * steady + t_c + r_and_m
        return r_and_m + (n - 1) * steady + t_c + t_s  # paradigm 3: C waits for M

    def time(self, B: int, n: int, strategy: str) -> float:
        rows = B / n
        fwd, bwd = op_counts(strategy, self.hidden, self.intermediate)
        return (self.paradigm_time(n, *self.stage_times(rows, fwd), backward=False)
                + self.paradigm_time(n, *self.stage_times(rows, bwd), backward=True))

    def eq10_cost(self, B: int, strategy: str) -> float:
        """MPipeMoE Eq. 10 for the whole layer (no pipeline phases): max over streams of work / slowed speed."""
        fwd, bwd = op_counts(strategy, self.hidden, self.intermediate)
        q = OpCounts(fwd.comp + bwd.comp, fwd.comm + bwd.comm, fwd.mem + bwd.mem)
        t_c, t_comm, t_m = self.stage_times(B, q)
        sp = self.speeds
        active = [k for k, t in zip(KINDS, (t_c, t_comm, t_m)) if t > 0]
        return max(t / sp.slowdown(k, active) for k, t in zip(KINDS, (t_c, t_comm, t_m)) if t > 0)


# ----------------------------------------------------------------------------------------------------------------
# The configurator used by `enable_micro_batch_pipelining(..., n="auto", strategy="auto")`
# ----------------------------------------------------------------------------------------------------------------
class PipelineConfigurator:
    """Chooses (n, S) per token batch size B; one instance is shared by all MoE layers of a model.

    method="model": Algorithm 1 over the performance model's estimates (micro-benchmarks run once, lazily).
    method="profile": Algorithm 1 over real forward+backward timings of the layer on random tokens (resident experts
    only: profiling a streamed layer would touch the offload engine's gradient rows).
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        n: int | str = "auto",
        strategy: str = "auto",
        strategies: Sequence[str] = ("S1", "S2", "S3", "S4"),
        method: str = "model",
        n_max: int = 8,
        speeds: Speeds | None = None,
        profile_fn: Callable[[int, int, str], float] | None = None,
        comm_fn: Callable[[torch.Tensor], object] | None = None,
    ):
        if method not in ("model", "profile"):
            raise ValueError(f"method must be 'model' or 'profile', got {method!r}")
        if n != "auto" and (not isinstance(n, int) or n < 1):
            raise ValueError(f"n must be 'auto' or a positive int, got {n!r}")
        self.hidden, self.intermediate = hidden, intermediate
        self.n, self.method, self.n_max = n, method, n_max
        self.strategies = list(strategies) if strategy == "auto" else [strategy]
        self.speeds = speeds
        self.profile_fn = profile_fn
        self.comm_fn = comm_fn
        self.model: PerformanceModel | None = None
        self.searches: dict[str, GranularitySearch] = {}
        self.choices: dict[int, tuple[int, str]] = {}
        self.device = torch.device("cpu")
        self.collective = False  # set by the executor: every rank must choose alike (expert-parallel stages)

    def _cost_fn(self, strategy: str) -> Callable[[int, int], float]:
        if self.method == "profile":
            def cost(B: int, n: int) -> float:
                t = self.profile_fn(B, n, strategy)
                # A collective stage needs the same choice on every rank (NCCL: the reduction runs on the device).
                return all_reduce_max([t], self.device)[0] if self.collective else t
            return cost
        return lambda B, n: self.model.time(B, n, strategy)

    def prepare(self, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        if self.method == "model" and self.model is None:
            if self.speeds is None:
                self.speeds = measure_speeds(self.hidden, self.intermediate, dtype, device, comm_fn=self.comm_fn)
            self.model = PerformanceModel(self.speeds, self.hidden, self.intermediate,
                                          torch.empty(0, dtype=dtype).element_size())
        for s in self.strategies:
            if s not in self.searches:
                self.searches[s] = GranularitySearch(self._cost_fn(s), n_min=1, n_max=self.n_max)

    def choose_for(
        self, B: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> tuple[int, str]:
        if B in self.choices:
            return self.choices[B]
        self.prepare(dtype, torch.device(device))
        estimates = {}
        for s in self.strategies:
            n = self.n if isinstance(self.n, int) else self.searches[s](B)
            estimates[s] = (self._cost_fn(s)(B, n), n)
        best = min(estimates, key=lambda s: estimates[s][0])
        choice = (estimates[best][1], best)
        self.choices[B] = choice
        logger.info(
            "MPMoE configurator (%s): B=%d rows -> n=%d, strategy=%s (estimates: %s)", self.method, B, choice[0],
            choice[1], ", ".join(f"{s}: n={n} {t * 1e3:.3f} ms" for s, (t, n) in estimates.items()),
        )
        return choice

    def choose(self, x: torch.Tensor, plan, experts, collective: bool = False) -> tuple[int, str]:
        """(n, strategy) for this layer call. A collective stage (expert parallelism: every rank must run the same
        n) agrees on B with one all-reduce (on the device under NCCL); otherwise each rank decides alone, with no
        communication in the forward."""
        self.collective = collective
        B = plan.token_index.numel()
        if collective:
            B = int(all_reduce_max([float(B)], x.device)[0])
        return self.choose_for(B, x.dtype, x.device)


__all__ = [
    "GranularitySearch",
    "OpCounts",
    "PerformanceModel",
    "PipelineConfigurator",
    "Speeds",
    "all_reduce_max",
    "measure_speeds",
    "time_best",
    "op_counts",
]
