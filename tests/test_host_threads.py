"""One thread budget for the host's CPU work during a step (hf_moe_offload/host_threads.py): the expert optimizer's
workers size their own OpenMP teams, inside their own threads, to an even share of `OffloadConfig.optimizer_threads`;
nothing else's team changes."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from hf_moe_offload import ExpertOptimizer, OffloadConfig, enable_expert_offload
from hf_moe_offload.host_threads import (DEVICE_THREADS, available_cores, optimizer_threads, set_thread_team,
                                         team_size)
from hf_moe_offload.offload.plan import Machine, StoreFacts, compute_threads, resolve_plan

from test_offload import small_model


def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_a_thread_sizes_its_own_team_and_no_other():
    """`set_thread_team` on one thread: its torch ops run that many threads; the main thread's team and the team a
    thread started afterwards begins with stay what they were (`torch.set_num_threads` would change the latter)."""
    main, fresh = torch.get_num_threads(), _in_thread(torch.get_num_threads)

    def sized():
        set_thread_team(1)
        torch.ones(1 << 16).mul_(2)  # a parallel op runs with the team: it stays sized
        return torch.get_num_threads()

    assert _in_thread(sized) == 1
    assert torch.get_num_threads() == main
    assert _in_thread(torch.get_num_threads) == fresh


@pytest.mark.parametrize("budget, workers, team", [(1, 2, 1), (3, 2, 1), (4, 2, 2), (14, 2, 7), (16, 1, 16),
                                                   (2, 4, 1)])
def test_teams_are_an_even_share_never_more(budget, workers, team):
    assert team_size(budget, workers) == team
    assert team * workers <= max(budget, workers)  # more workers than threads: teams of one


def test_the_default_budget_leaves_the_step_its_cores():
    """None: the cores this process may run on, less the launching and autograd threads on a device, less the
    experts' compute threads on the CPU; at least 1. A setting stands as given."""
    cores = available_cores()
    assert optimizer_threads(None, DEVICE_THREADS) == max(1, cores - DEVICE_THREADS)
    assert optimizer_threads(5, DEVICE_THREADS) == 5
    facts = StoreFacts("host", experts=8, numel=64, compute_dtype=torch.float32, row_dtype=torch.float32)
    on_cpu = resolve_plan(OffloadConfig(), Machine("inline", False, None), facts, [4], 2)
    assert on_cpu.optimizer_threads == max(1, cores - compute_threads(OffloadConfig()))
    on_device = resolve_plan(OffloadConfig(), Machine("cuda", True, 80 << 30), facts, [4], 2)
    assert on_device.optimizer_threads == max(1, cores - DEVICE_THREADS)
    assert dataclasses.replace(on_device, optimizer_threads=3).optimizer_threads == 3
    with pytest.raises(ValueError, match="optimizer_threads must be >= 1"):
        OffloadConfig(optimizer_threads=0)


@pytest.mark.parametrize("budget", [1, 3, 4])
def test_no_worker_runs_a_team_larger_than_its_share(budget):
    """Two workers stepping the experts during backward, each step's team read inside the step: every worker's team
    is `team_size(budget, 2)`, the teams together within the budget (or one each), and the main thread's team is
    untouched."""
    model = small_model(seed=1)
    engine = enable_expert_offload(model, OffloadConfig(mode="host", optimizer_threads=budget))
    experts = ExpertOptimizer(engine, lr=1e-2, workers=2)
    teams, lock = {}, threading.Lock()
    step = experts._adam_many

    def recording(*args, **kwargs):
        with lock:
            teams[threading.current_thread().name] = torch.get_num_threads()
        return step(*args, **kwargs)

    experts._adam_many = recording
    main = torch.get_num_threads()
    x = torch.randint(0, 101, (4, 9), generator=torch.Generator().manual_seed(0))
    model(x, labels=x).loss.backward()  # eager: the experts are stepped on the workers during this backward
    experts.step()
    engine.synchronize()
    experts.close()
    assert teams and all(name.startswith("expert-adam") for name in teams), teams
    share = team_size(budget, 2)
    assert set(teams.values()) == {share}, teams
    assert share * len(teams) <= max(budget, len(teams))
    assert torch.get_num_threads() == main
