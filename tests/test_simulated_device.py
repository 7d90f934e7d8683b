"""The GPU code paths, proven on CPU with the simulated asynchronous device (hf_moe_offload.runtime).

1. The simulation itself: a copy's destination reads NaN until the copy ran; a read, a reuse or an overwrite without
   a happens-before edge raises `HappensBeforeError`; device blocks used on another stream need `record_stream`.
2. Deleting one wait from the engine makes a test fail (the upload wait, the slot-reuse wait, the gradient-download
   wait): the simulation is not a test that cannot fail.
3. The defects the CUDA review found, each where the simulation can show it: versions that survive eviction, the
   device bound to the inputs, gradients downloaded in their own dtype, norms taken as gradients become final.
4. The offload, pipelining, expert-optimizer and expert-parallel suites, re-run with every CPU runtime simulated
   (`HF_MOE_OFFLOAD_RUNTIME=simulated`, seeded delays on every side stream): the tests that issue device work, on a
   cross of tiers and dtypes that reaches every runtime call site the whole files reach.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from hf_moe_offload import ExpertAwareOptimizer, ExpertOptimizer, OffloadConfig, enable_expert_offload
from hf_moe_offload.offload.streaming.transfers import DeviceStager, GradArrival
from hf_moe_offload.runtime import HOST, HappensBeforeError, use_runtime
from hf_moe_offload.runtime.simulated import SimulatedRuntime

from test_expert_optimizer import assert_same_weights
from test_offload import small_model, store_grads_vs_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- 1. the simulation ---
def test_copy_destination_is_nan_until_the_copy_ran_and_reading_it_needs_a_wait():
    rt = SimulatedRuntime(seed=0, max_delay=0.05)
    side = rt.new_stream()
    dst = rt.empty((8,), torch.float32, stream=side, persistent=True)
    src = rt.pinned_empty((8,), torch.float32)
    src.fill_(1.0)
    rt.copy_(dst, src, side)
    assert torch.isnan(dst).all()  # enqueued, not run: what a reader that does not wait sees
    with pytest.raises(HappensBeforeError, match="not ordered after its write"):
        rt.access(dst)  # compute reads without waiting for the copy
    rt.wait_event(rt.record(side))
    rt.access(dst)
    assert torch.equal(dst, torch.ones(8))


def test_an_empty_tensor_has_nothing_to_order():
    """A tensor without bytes (a partition without tokens, under expert parallelism over 3 processes) is read
    without waiting for its copy: there is nothing to wait for, and empty tensors share an address, so one must
    not meet another's history."""
    rt = SimulatedRuntime(seed=0, max_delay=0.05)
    side = rt.new_stream()
    empty = [rt.empty((0, 32), torch.float32, stream=side, persistent=True) for _ in range(2)]
    for dst in empty:
        rt.copy_(dst, rt.pinned_empty((0, 32), torch.float32), side)
        rt.access(dst)
    full = rt.empty((1, 32), torch.float32, stream=side, persistent=True)
    rt.copy_(full, rt.pinned_empty((1, 32), torch.float32), side)
    with pytest.raises(HappensBeforeError):
        rt.access(full)


def test_reusing_a_buffer_before_its_reader_is_done_raises():
    rt = SimulatedRuntime(seed=1)
    side = rt.new_stream()
    slot = rt.empty((4,), torch.float32, stream=side, persistent=True)
    src = rt.pinned_empty((4,), torch.float32)
    rt.copy_(slot, src, side)
    rt.wait_event(rt.record(side))
    rt.access(slot)  # compute reads the slot
    with pytest.raises(HappensBeforeError, match="reused while still in use"):
        rt.copy_(slot, src, side)  # the copy stream refills it without waiting for compute
    rt.wait_event(rt.record(), side)  # the fix: wait for an event recorded after the read
    rt.copy_(slot, src, side)


def test_a_conflict_names_the_code_on_both_sides():
    """The error names where the buffer was declared and where the unordered access is (file, line, function,
    thread): a rare conflict in a long suite can be traced from its message alone."""
    rt = SimulatedRuntime(seed=0)
    side = rt.new_stream()
    dst = rt.empty((4,), torch.float32, stream=side, persistent=True)
    rt.copy_(dst, rt.pinned_empty((4,), torch.float32), side)
    with pytest.raises(HappensBeforeError) as err:
        rt.access(dst)
    here = os.path.basename(__file__)
    assert f"declared at {here}:" in str(err.value) and "test_a_conflict_names_the_code_on_both_sides" in str(err.value)
    assert str(err.value).count(here) == 2 and "MainThread" in str(err.value)


def test_a_read_through_a_temporary_view_is_remembered():
    """`track_views`: an upload reads one row of a host block through a view made for the copy (a record's row):
    after that view is gone, a host write into the same bytes must still wait for the read (a disk-tier record reused
    for another expert), while the block's other rows are free to write."""
    rt = SimulatedRuntime(seed=2, max_delay=0.05, track_views=True)
    side = rt.new_stream()
    block = rt.pinned_empty((2, 4), torch.float32)
    dst = rt.empty((4,), torch.float32, stream=side, persistent=True)
    rt.copy_(dst, block[0].view(4), side)  # the view dies here
    rt.access(block[1], write=True, stream=HOST)  # other bytes: no conflict
    with pytest.raises(HappensBeforeError, match="reused while still in use"):
        rt.access(block[0], write=True, stream=HOST)
    rt.record(side).synchronize()
    rt.access(block[0], write=True, stream=HOST)


def test_a_write_to_some_rows_leaves_the_others_of_a_larger_record_alone():
    """`track_views`: an upload reads a run of rows at once (one record for the run, kept while the block lives); a
    later write on compute into one row, not yet ordered before the host, makes a host write into that row a
    conflict, but not a host write into another row of the run (the expert optimizer writing one expert while the
    device pins send another home)."""
    rt = SimulatedRuntime(seed=1, max_delay=0.05, track_views=True)
    side = rt.new_stream()
    block = rt.pinned_empty((3, 4), torch.float32)
    dst = rt.empty((2, 4), torch.float32, stream=side, persistent=True)
    rt.copy_(dst, block[0:2], side)  # one record for rows 0-1, beside the block's
    rt.record(side).synchronize()
    rt.copy_(block[0], rt.empty((4,), torch.float32, persistent=True))  # compute writes row 0
    rt.access(block[1], write=True, stream=HOST)  # another row of the run: no conflict
    with pytest.raises(HappensBeforeError, match="not ordered after its write on"):
        rt.access(block[0], write=True, stream=HOST)
    rt.record().synchronize()
    rt.access(block[0], write=True, stream=HOST)


def test_memory_a_live_tensor_moved_off_is_judged_afresh():
    """`track_views` follows a view's base; a base moved to other memory (`set_`) leaves its old bytes to whatever the
    allocator hands them to next, and that tensor's accesses are not judged by the moved base's past writes. (Skips
    where the allocator does not hand the same address back within 64 tries.)"""
    rt = SimulatedRuntime(seed=0, max_delay=0.05, track_views=True)
    side = rt.new_stream()
    n = 1 << 24  # 64 MiB: past glibc's largest mmap threshold, so freed at once and its address handed back
    base = torch.zeros(n)
    view = base[: n // 2]
    rt.access(view, write=True, stream=side)  # a write not yet ordered before the host
    old = base.untyped_storage().data_ptr()
    base.set_(torch.zeros(n).untyped_storage())  # the base is alive, over other memory
    del view  # the last holder of the old memory
    held = []
    for _ in range(64):
        fresh = torch.empty(n)
        if fresh.untyped_storage().data_ptr() == old:
            break
        held.append(fresh)
    else:
        pytest.skip("the allocator did not hand the freed address back")
    rt.access(fresh[:4], write=True, stream=HOST)  # new memory as far as anyone can tell: no conflict
    rt.access(base[:4], write=True, stream=side)  # the moved base is still checked, over its new memory
    with pytest.raises(HappensBeforeError, match="not ordered after its write on"):
        rt.access(base[:4], stream=HOST)


def test_freeing_a_persistent_buffer_needs_its_other_streams_uses_done():
    """A persistent buffer's owner declares its end (`free`): compute's read of it must be ordered before the host
    by then (the allocator may hand the memory to the copy stream's next allocation at once)."""
    rt = SimulatedRuntime(seed=3)
    side = rt.new_stream()
    slot = rt.empty((4,), torch.float32, stream=side, persistent=True)
    rt.copy_(slot, rt.pinned_empty((4,), torch.float32), side)
    rt.wait_event(rt.record(side))
    rt.access(slot)  # compute reads the slot
    with pytest.raises(HappensBeforeError, match="freed while its use on compute"):
        rt.free(slot)
    rt.record().synchronize()  # the fix: the host waits for compute
    rt.free(slot)


def test_block_used_on_another_stream_needs_record_stream():
    rt = SimulatedRuntime(seed=2)
    side = rt.new_stream()
    t = rt.empty((4,), torch.float32, stream=side)  # not persistent: the caching allocator's rule applies
    rt.copy_(t, rt.pinned_empty((4,), torch.float32), side)
    rt.wait_event(rt.record(side))
    with pytest.raises(HappensBeforeError, match="record_stream"):
        rt.access(t)
    rt.record_stream(t, rt.current_stream())
    rt.access(t)


def test_tensors_of_one_storage_conflict_only_where_their_bytes_overlap():
    """The host tier keeps a layer's records in one block: an upload reading one expert's weights does not order the
    host's update of another expert of the block, but does order an update of its own rows or of the whole block."""
    rt = SimulatedRuntime(seed=3)
    side = rt.new_stream()
    block = torch.zeros(3, 2, 8)
    rows = [block[e, 0] for e in range(3)]  # each expert's weights row
    slot = rt.empty((8,), torch.float32, stream=side, persistent=True)
    rt.copy_(slot, rows[1], side)  # the upload of expert 1 is enqueued, not waited for
    rt.access(rows[0], write=True, stream=HOST)  # expert 0's update: other bytes
    rt.access(block[1, 1], write=True, stream=HOST)  # expert 1's gradient row: other bytes
    for overlapping in (rows[1], block[1], block):
        with pytest.raises(HappensBeforeError, match="reused while still in use"):
            rt.access(overlapping, write=True, stream=HOST)
    rt.record(side).synchronize()
    rt.access(block, write=True, stream=HOST)


def test_host_reads_a_download_only_after_synchronize():
    rt = SimulatedRuntime(seed=3, max_delay=0.02)
    side = rt.new_stream()
    host = rt.pinned_empty((4,), torch.float32)
    dev = torch.full((4,), 2.0)
    rt.access(dev, write=True)
    rt.wait_stream(side, rt.current_stream())
    rt.copy_(host, dev, side)
    event = rt.record(side)
    with pytest.raises(HappensBeforeError):
        rt.access(host, stream=HOST)
    event.synchronize()
    rt.access(host, stream=HOST)
    assert torch.equal(host, dev)


# --- 2. deleting one wait makes a test fail ---
# (The slab's waits, which training calls use where it fits: tests/test_device_slab.py.)
def _offloaded_step(tier: str, tmp_path, pin_fraction: float = 0.0):
    """A training step expert by expert (the stager's slots: a host cache of 4 leaves no room for the slab)."""
    reference = small_model()
    model = copy.deepcopy(reference)
    engine = enable_expert_offload(model, OffloadConfig(mode=tier, offload_dir=str(tmp_path / "experts"),
                                                        host_cache_experts=4, prefetch_depth=2,
                                                        pin_fraction=pin_fraction))
    x = torch.randint(0, 101, (3, 11))
    model(x, labels=x).loss.backward()
    reference(x, labels=x).loss.backward()
    engine.synchronize()
    assert engine.slab is None
    return engine, reference


def _offloaded_inference(tmp_path):
    """An inference forward on the host tier, expert by expert through the stager's slots, against the resident
    model's logits."""
    reference = small_model()
    model = copy.deepcopy(reference)
    enable_expert_offload(model, OffloadConfig(mode="host", prefetch_depth=2, pin_fraction=0.0))
    x = torch.randint(0, 101, (3, 11))
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, reference(x).logits, atol=1e-5, rtol=0)


def test_the_engine_is_correct_on_the_simulated_device(tmp_path):
    with use_runtime(SimulatedRuntime(seed=4, max_delay=0.003)) as rt:
        engine, reference = _offloaded_step("disk", tmp_path, pin_fraction=0.5)
        assert engine.runtime is rt and rt.copies > 0 and rt.checks > 0
        assert store_grads_vs_reference(engine, reference) <= 1e-6


def test_deleting_the_upload_wait_fails(tmp_path, monkeypatch):
    def wait_without_event(self, ready, weights):  # DeviceStager.wait minus its `wait_event`
        self.rt.access(weights)

    monkeypatch.setattr(DeviceStager, "wait", wait_without_event)
    with use_runtime(SimulatedRuntime(seed=5, max_delay=0.003)):
        with pytest.raises(HappensBeforeError, match="not ordered after its write"):
            _offloaded_step("disk", tmp_path)
        with pytest.raises(HappensBeforeError, match="not ordered after its write"):
            _offloaded_inference(tmp_path)


def test_deleting_the_gradient_download_wait_fails(tmp_path, monkeypatch):
    def land_without_synchronize(self, record):  # GradArrival.land minus `event.synchronize()`
        self.rt.access(self.buffer, stream=HOST)
        record.grad.add_(self.buffer)
        self.release()

    monkeypatch.setattr(GradArrival, "land", land_without_synchronize)
    with use_runtime(SimulatedRuntime(seed=6, max_delay=0.003)):
        with pytest.raises(HappensBeforeError):
            _offloaded_step("disk", tmp_path)


class _DropsWaitsOf(SimulatedRuntime):
    """A simulated device whose copy streams skip every `wait_event`: the stager's wait for a slot's last use."""

    def wait_event(self, event, stream=None):
        if stream is not None and stream is not self.current_stream():
            return
        super().wait_event(event, stream)


def test_deleting_the_slot_reuse_wait_fails(tmp_path):
    with use_runtime(_DropsWaitsOf(seed=7, max_delay=0.003)):
        with pytest.raises(HappensBeforeError, match="reused while still in use"):
            _offloaded_inference(tmp_path)


# --- 3. defects of the CUDA review, shown on the simulated device ---
def test_pinned_device_copy_is_refreshed_after_eviction_and_update(tmp_path):
    """A pinned expert's device copy is reused while its version is unchanged. Versions live in the store: an
    evicted expert read back keeps its count (it used to restart at 0, so after one more update the stale copy of
    the same number was used for a whole window)."""
    with use_runtime(SimulatedRuntime(seed=8)):
        model = small_model()
        engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"),
                                                            host_cache_experts=3, prefetch_depth=1,
                                                            pin_fraction=0.0))
        x = torch.randint(0, 101, (2, 5))
        with torch.no_grad():
            model(x)  # binds the engine to the CPU (simulated device)
        store, key = engine.store, (0, 0)
        engine.stager.set_pinned({key})

        def upload_now() -> torch.Tensor:
            record = store.acquire(key)
            weights, ready, _ = engine.stager.upload(key, record)
            engine.stager.wait(ready, weights)
            engine.release_after(key, ready)
            engine.synchronize()
            return weights.clone()

        def update(value: float) -> None:
            store.write_param(key, torch.full((store.numel,), value), reset_state=False)

        update(1.0)
        assert torch.equal(upload_now(), torch.ones(store.numel))  # cached copy at this version
        for other in [(0, e) for e in range(1, 6)]:  # evict the expert (LRU; the store does not pin it)
            store.acquire(other)
            store.release(other)
        assert key not in store.resident_keys()
        update(2.0)  # read back from disk, updated once more
        assert torch.equal(upload_now(), torch.full((store.numel,), 2.0))


def test_engine_binds_to_the_inputs_device(tmp_path):
    model = small_model()
    engine = enable_expert_offload(model, OffloadConfig(mode="host"))
    assert engine.device is None  # nothing fixed at enable time (was cuda:current_device() whenever CUDA existed)
    x = torch.randint(0, 101, (2, 5))
    with torch.no_grad():
        model(x)
    assert engine.device == torch.device("cpu")
    other = small_model()
    enable_expert_offload(other, OffloadConfig(mode="host", device="cuda:0"))
    with pytest.raises(RuntimeError, match="OffloadConfig.device is cuda:0 but the inputs are on cpu"):
        with torch.no_grad():
            other(x)


def test_gradients_are_downloaded_in_their_own_dtype(tmp_path):
    """bf16 compute copies under bf16 autocast: the gradient goes to the host in bf16 (half the bytes of the old fp32
    upcast), through the ring of page-locked buffers, and accumulates in the fp32 store slot."""
    with use_runtime(SimulatedRuntime(seed=9)):
        torch.manual_seed(0)
        model = small_model()
        engine = enable_expert_offload(model, OffloadConfig(mode="host", compute_dtype=torch.bfloat16))
        x = torch.randint(0, 101, (3, 11))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=x).loss
        loss.backward()
        engine.synchronize()
        ring = engine.gradients.rings[torch.bfloat16]  # the slab's chunks: one block of gradients per chunk
        assert all(b.dtype == torch.bfloat16 for b in ring.buffers) and len(ring._free) == len(ring.buffers)
        experts_run = sum(1 for layer in engine.layers for n in layer.last_counts if n)
        assert engine.stats.d2h_bytes == experts_run * engine.store.numel * 2
        record = engine.store.acquire((0, 0))
        assert record.grad.dtype == torch.float32
        engine.store.release((0, 0))


def test_a_final_gradient_is_added_after_the_earlier_one_of_its_micro_step(tmp_path, monkeypatch):
    """MPMoE's two partitions call each layer twice per micro-step: the first call's expert gradients land on the
    engine's host worker once their download is done, the second call's (final) ones go to the expert optimizer.
    With that worker behind (here: each landing made 20 ms slow), the optimizer took the final gradient in place of
    a row the worker had not yet written (stale: counted as zero) and stepped on half the gradient. It waits for the
    landing first: the weights after one step equal plain AdamW's."""
    from hf_moe_offload.offload.streaming.gradients import HostGradients
    from hf_moe_offload.pipelining import enable_micro_batch_pipelining

    land = HostGradients.land

    def slow_land(self, key, record, arrival):
        time.sleep(0.02)
        land(self, key, record, arrival)

    monkeypatch.setattr(HostGradients, "land", slow_land)
    reference = small_model()
    model = copy.deepcopy(reference)
    with use_runtime(SimulatedRuntime(seed=0, max_delay=0.003)):
        engine = enable_expert_offload(model, OffloadConfig(mode="host", offload_dir=str(tmp_path / "e"),
                                                            compute_threads=torch.get_num_threads()))
        enable_micro_batch_pipelining(model, n=2, strategy="S1")
        expert_opt = ExpertOptimizer(engine, lr=1e-2)
        opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0), expert_opt)
        x = torch.randint(0, 101, (4, 11), generator=torch.Generator().manual_seed(0))
        model(x, labels=x).loss.backward()
        opt.step()
        engine.synchronize()
        expert_opt.close()
    reference(x, labels=x).loss.backward()
    torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0).step()
    assert_same_weights(model, reference, lr=1e-2, steps=1)


def test_global_clipping_takes_expert_norms_as_gradients_become_final(tmp_path):
    """Deferred mode (exact global clipping): each expert's norm is taken on the optimizer's workers when its
    gradient lands during backward; computing the global norm then re-reads no expert (the disk tier used to read
    every expert back, with an fp64 copy per tensor). The result equals torch's clip_grad_norm_."""
    reference = small_model()
    model = copy.deepcopy(reference)
    # At the reference's thread count (OffloadConfig.compute_threads): with one thread fewer the GEMMs round
    # differently and Adam's first step turns that into ~1e-5 where a gradient is near zero.
    engine = enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"),
                                                        host_cache_experts=4,
                                                        compute_threads=torch.get_num_threads()))
    expert_opt = ExpertOptimizer(engine, lr=1e-2, max_grad_norm=0.5)
    opt = ExpertAwareOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0), expert_opt)
    assert not expert_opt.eager
    x = torch.randint(0, 101, (3, 11))
    model(x, labels=x).loss.backward()
    misses = engine.stats.cache_misses
    sq = expert_opt.expert_grad_sq_norm()
    assert engine.stats.cache_misses == misses  # nothing read back from disk
    reference(x, labels=x).loss.backward()
    expert_sq = sum(float(torch.linalg.vector_norm(p.grad)) ** 2 for n, p in reference.named_parameters()
                    if "experts" in n)
    assert abs(sq - expert_sq) <= 1e-5 * expert_sq
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0)
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_opt.step()
    opt.step()
    engine.synchronize()
    assert_same_weights(model, reference, lr=1e-2, steps=1)
    expert_opt.close()


# --- 4. the suites, re-run on the simulated device ---
# The offload, pipelining, optimizer, autocast and family suites re-run only what the census shows checks stream
# waits (benchmarks/device_work_census.py, its log benchmarks/device_work_census.jsonl: per test, the device work
# and every runtime call site reached on the simulated device): for each test function that issues device work, the
# parametrizations reaching every call site its parametrizations reach; for each cell of tiers and dtypes, the tests
# reaching every call site the cell's tests reach. The rest run on the CPU, where their numerics are checked; a test
# that issues no device work runs that same code again on the simulated device.
CENSUS = os.path.join(ROOT, "benchmarks", "device_work_census.jsonl")


def _census_rows() -> list[dict]:
    with open(CENSUS, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _selection() -> list[str]:
    spec = importlib.util.spec_from_file_location("device_work_census", os.path.join(ROOT, "benchmarks",
                                                                                    "device_work_census.py"))
    census = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(census)
    return census.selection(_census_rows())


RERUN = _selection()
SUITES = {
    "offload": [t for t in RERUN if t.startswith("tests/test_offload.py")],
    "pipelining+optimizer": [t for t in RERUN if not t.startswith(("tests/test_offload.py", "tests/test_families.py"))],
    # Other families through the one entry: Qwen3-MoE offloaded and with MPMoE partitions, and gpt-oss offloaded on
    # both tiers: its experts are transposed and biased, behind a gate of its own, which the census's call sites
    # (the same engine lines for every family) cannot tell apart.
    "families": sorted({t for t in RERUN if t.startswith("tests/test_families.py")}
                       | {f"tests/test_families.py::test_family_offloaded_equals_stock[gpt_oss-{tier}]"
                          for tier in ("host", "disk")}),
    # Expert parallelism (launches of 2 processes): the call sites its ranks reach (benchmarks/rank_census, measured
    # 2026-12-04: 38) are all reached by the pipelined run of 2 processes, fp32, every tier and S1-S4; the autocast
    # run adds bf16 and fp16 on every tier and strategy (the same 38). The equivalence launches (27 of the 38) and
    # the pipelined run of 3 processes (the same 38) run on the CPU only.
    "expert-parallel": ["tests/test_distributed.py::test_micro_batch_pipelining_over_expert_parallelism[2]",
                        "tests/test_distributed.py::test_expert_parallel_under_autocast"],
}


def test_the_re_runs_keep_a_test_of_every_cell_and_name_tests_that_exist():
    """The census names test functions of their files (a renamed test would otherwise leave the re-run, or fail it
    with 'not found'), every census test is in a suite's files, and the selection keeps tests of both tiers, every
    compute dtype and every file: the cross the census covers."""
    rows = _census_rows()
    for row in rows:
        path, _, name = row["id"].partition("::")
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            assert f"def {name.split('[')[0]}(" in f.read(), row["id"]
    assert set(RERUN) <= {t for suite in ("offload", "pipelining+optimizer", "families") for t in SUITES[suite]}
    kept = " ".join(RERUN)
    for part in ("[", "host", "disk", "bf16", "fp16", "test_offload.py", "test_pipelining.py",
                 "test_expert_optimizer.py", "test_mixed_precision.py", "test_families.py"):
        assert part in kept, part
    with_work = {row["id"].split("[")[0] for row in rows if row["sites"]}
    assert with_work == {t.split("[")[0] for t in RERUN}, "a test function with device work left the re-run"


@pytest.mark.slow
@pytest.mark.parametrize("suite", list(SUITES))
def test_suite_passes_on_the_simulated_device(suite, tmp_path):
    env = dict(os.environ, HF_MOE_OFFLOAD_RUNTIME="simulated", HF_MOE_OFFLOAD_RUNTIME_MAX_DELAY="0.001",
               HF_MOE_OFFLOAD_RUNTIME_REPORT=str(tmp_path / "sim"))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SUITES[suite]],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    reports = [json.loads(open(p).read()) for p in glob.glob(str(tmp_path / "sim*.json"))]
    # The simulation really ran: copies on side streams, and every declared access checked.
    assert sum(r["copies"] for r in reports) > 0 and sum(r["checks"] for r in reports) > 0, reports
