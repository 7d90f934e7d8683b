"""Reliability (issue 11): no fault loses or silently corrupts training.

- integrity: a checksum per expert record, on the disk tier (XXH3-64 per row) and in checkpoints (CRC32), checked
  on every read;
- the offload directory is locked while in use, and a killed run's files are detected;
- re-saving a model is atomic (old or new, never a mix), and an incomplete checkpoint names every missing shard;
- Trainer checkpoints are complete or invisible, resume restores the experts from any path (or says what is
  missing), and a SIGKILL at several moments around a checkpoint save followed by `--resume` gives bit-for-bit the
  weights of an uninterrupted run;
- user errors of the CLI are one line with exit code 2.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

import hf_moe_offload  # noqa: F401  (registers the Auto classes)
from hf_moe_offload import MoEGPTConfig, MoEGPTForCausalLM, OffloadConfig, enable_expert_offload
from hf_moe_offload.offload import CorruptExpertFileError, DiskExpertStore, ExpertStoreError, OffloadStats
from hf_moe_offload.errors import CheckpointError
from hf_moe_offload.offload.checkpoint import (
    EXPERT_STATE_FILE,
    load_expert_state,
    load_offloaded_pretrained,
    save_expert_state,
)
from hf_moe_offload.offload.stores.safetensors_io import SafetensorsReader
from hf_moe_offload.offload.saving import save_offloaded_pretrained
from hf_moe_offload.optim.checkpoints import (
    checkpoint_problems,
    clean_interrupted_saves,
    latest_complete_checkpoint,
)

from fork_runs import ForkRuns
from small_corpus import write_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILL_SCRIPT = os.path.join(ROOT, "tests", "scripts", "kill_during_save.py")
TRAINER_SCRIPT = os.path.join(ROOT, "tests", "scripts", "trainer_offload.py")


def small_model(seed: int = 0) -> MoEGPTForCausalLM:
    torch.manual_seed(seed)
    return MoEGPTForCausalLM(MoEGPTConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
        num_experts=4, moe_layer_frequency=1, hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=16))


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def disk_store(directory, keys, cache=1) -> DiskExpertStore:
    return DiskExpertStore(keys, 10, torch.float32, OffloadStats(), str(directory), cache_experts=cache)


# --- the disk tier: checksums, lock, reused directory ---
def test_flipped_byte_in_an_expert_file_is_an_error_not_a_weight(tmp_path):
    store = disk_store(tmp_path / "d", [(0, 0), (0, 1)])
    store.write_param((0, 0), torch.arange(10.0))
    store.write_param((0, 1), torch.ones(10))  # evicts (0, 0): written back to its file
    flip_byte(store.path((0, 0)), 13)  # inside the fp32 weights
    with pytest.raises(CorruptExpertFileError, match=r"layer000_expert00000\.bin is corrupt: its checksum"):
        store.acquire((0, 0))
    # The other expert, and the corrupt one once its file is whole again, still read fine.
    flip_byte(store.path((0, 0)), 13)
    assert torch.equal(store.read_param((0, 0)), torch.arange(10.0))
    store.close()


def test_expert_file_of_another_expert_or_truncated_is_an_error(tmp_path):
    store = disk_store(tmp_path / "d", [(0, 0), (0, 1), (0, 2)])
    for e in range(3):
        store.write_param((0, e), torch.full((10,), float(e)))
    store.flush()
    store.acquire((0, 2))  # the cache holds one expert: (0, 0) and (0, 1) are on disk only now
    store.release((0, 2))
    shutil.copy(store.path((0, 1)), store.path((0, 0)))
    with pytest.raises(CorruptExpertFileError, match="holds expert \\(0, 1\\)"):
        store.acquire((0, 0))
    with open(store.path((0, 1)), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptExpertFileError, match="truncated"):
        store.acquire((0, 1))
    store.close()


def test_training_on_a_corrupted_disk_tier_stops_with_the_file_named(tmp_path):
    model = small_model()
    enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"), host_cache_experts=3,
                                               prefetch_depth=1, pin_fraction=0.0))
    x = torch.randint(0, 64, (2, 8))
    model(x, labels=x).loss.backward()  # runs fine
    engine = hf_moe_offload.get_offload_engine(model)
    engine.store.flush()
    on_disk = [k for k in engine.store.keys() if k not in engine.store.resident_keys()]
    flip_byte(engine.store.path(on_disk[0]), 40)
    with pytest.raises(CorruptExpertFileError, match=os.path.basename(engine.store.path(on_disk[0]))):
        for _ in range(3):
            model(x, labels=x).loss.backward()
    engine.store.close()


def test_offload_dir_in_use_by_a_live_process_is_refused(tmp_path):
    directory = tmp_path / "shared"
    store = disk_store(directory, [(0, 0)])
    with pytest.raises(ExpertStoreError, match="in use by this process"):
        disk_store(directory, [(0, 0)])
    # Another live process holding it: refused, naming that process.
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch; from hf_moe_offload.offload import DiskExpertStore, OffloadStats;"
         f"s = DiskExpertStore([(0, 0)], 10, torch.float32, OffloadStats(), {str(tmp_path / 'other')!r}, 1);"
         "print('ready', flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(ExpertStoreError, match=f"in use by process {holder.pid}"):
            disk_store(tmp_path / "other", [(0, 0)])
    finally:
        holder.kill()
        holder.wait()
    disk_store(tmp_path / "other", [(0, 0)]).close()  # the dead holder's lock went with it
    store.close()
    disk_store(directory, [(0, 0)]).close()  # free again once closed


def test_reused_offload_dir_of_a_killed_run_is_detected_and_its_files_discarded(tmp_path, caplog):
    directory = tmp_path / "d"
    directory.mkdir()
    (directory / "layer000_expert00000.bin").write_bytes(b"stale bytes of a killed run")
    (directory / "layer007_expert00003.bin").write_bytes(b"an expert this model does not have")
    with caplog.at_level(logging.WARNING):
        store = disk_store(directory, [(0, 0)])
    assert "2 expert files of an earlier run" in caplog.text
    assert sorted(p for p in os.listdir(directory) if p.endswith(".bin")) == []
    store.write_param((0, 0), torch.ones(10))
    store.flush()
    assert torch.equal(store.read_param((0, 0)), torch.ones(10))
    store.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a store that was closed properly: replaced without a warning
        disk_store(directory, [(0, 0)]).close()
    assert "earlier run" not in caplog.text


# --- saved models and expert state ---
def test_expert_state_checksum_is_checked_before_anything_is_restored(tmp_path):
    model = small_model()
    engine = enable_expert_offload(model, OffloadConfig(mode="host"))
    save_expert_state(engine, str(tmp_path), global_step=3)
    path = str(tmp_path / EXPERT_STATE_FILE)
    reader = SafetensorsReader(path)
    assert set(reader.crc32s) == set(reader.keys()) and reader.metadata["global_step"] == "3"
    last = reader.keys()[-1]
    flip_byte(path, reader.base + reader.header[last]["data_offsets"][0] + 5)
    before = engine.store.read_param((0, 0)).clone()
    engine.store.write_param((0, 0), before + 1.0, reset_state=False)
    with pytest.raises(CheckpointError, match=f"tensor {last} is corrupt"):
        load_expert_state(engine, str(tmp_path))
    assert torch.equal(engine.store.read_param((0, 0)), before + 1.0)  # nothing restored from a corrupt file


def test_incomplete_checkpoint_names_every_missing_shard(tmp_path):
    model = small_model()
    enable_expert_offload(model, OffloadConfig(mode="host"))
    save_offloaded_pretrained(model, str(tmp_path / "m"))
    shards = sorted(p for p in os.listdir(tmp_path / "m") if p.startswith("model-"))
    assert len(shards) == 3
    for name in shards[1:]:
        os.remove(tmp_path / "m" / name)
    cfg = OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e"))
    with pytest.raises(CheckpointError, match=f"2 shard file\\(s\\) that are missing: {shards[1]}, {shards[2]}"):
        load_offloaded_pretrained(str(tmp_path / "m"), cfg)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_offloaded_pretrained(str(tmp_path / "nowhere"), cfg)


def test_corrupt_expert_shard_is_detected_when_loading(tmp_path):
    model = small_model()
    enable_expert_offload(model, OffloadConfig(mode="host"))
    save_offloaded_pretrained(model, str(tmp_path / "m"))
    shard = sorted(p for p in os.listdir(tmp_path / "m") if p.startswith("model-"))[1]  # an expert shard
    reader = SafetensorsReader(str(tmp_path / "m" / shard))
    flip_byte(reader.path, reader.base + 7)
    with pytest.raises(CheckpointError, match="is corrupt"):
        load_offloaded_pretrained(str(tmp_path / "m"), OffloadConfig(mode="host"))


def _weights(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(folder).state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Killed(BaseException):
    """Stands for the process dying (BaseException: no `except Exception` in the save path catches it)."""


def test_resave_over_a_save_gives_the_old_or_the_new_weights_at_every_interruption(tmp_path, monkeypatch):
    folder = str(tmp_path / "m")
    old_model, new_model = small_model(0), small_model(1)
    enable_expert_offload(old_model, OffloadConfig(mode="host"))
    enable_expert_offload(new_model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "e")))
    save_offloaded_pretrained(old_model, folder)
    old = _weights(folder)
    save_offloaded_pretrained(new_model, folder)
    new = _weights(folder)
    assert not _same(old, new)
    real_replace = os.replace
    moves = 0
    seen = set()
    for interrupt_at in range(1, 20):  # die right after the k-th file moves in, for every k
        save_offloaded_pretrained(old_model, folder)
        count = 0

        def replace(src, dst, *a, **k):
            nonlocal count
            real_replace(src, dst, *a, **k)
            if os.path.dirname(os.path.abspath(dst)) == os.path.abspath(folder):
                count += 1
                if count == interrupt_at:
                    raise _Killed

        monkeypatch.setattr(os, "replace", replace)
        try:
            save_offloaded_pretrained(new_model, folder)
            finished = True
        except _Killed:
            finished = False
        monkeypatch.setattr(os, "replace", real_replace)
        got = _weights(folder)
        assert _same(got, old) or _same(got, new), f"mixed weights after move {interrupt_at}"
        seen.add("new" if _same(got, new) else "old")
        if finished:
            moves = interrupt_at - 1
            break
    assert moves >= 5 and seen == {"old", "new"}
    # No shard of a superseded save is left, nor the temporary folder of an interrupted one.
    index = json.loads(open(os.path.join(folder, "model.safetensors.index.json")).read())
    on_disk = {p for p in os.listdir(folder) if p.endswith(".safetensors")}
    assert on_disk == set(index["weight_map"].values())
    assert not [p for p in os.listdir(folder) if p.startswith(".tmp")]


# --- Trainer checkpoints ---
def _fake_checkpoint(folder, trainer_state: str | None = "{}", experts: bool = True):
    os.makedirs(folder)
    if trainer_state is not None:
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            f.write(trainer_state)
    if experts:
        model = small_model()
        engine = enable_expert_offload(model, OffloadConfig(mode="host"))
        save_expert_state(engine, folder)


def test_latest_complete_checkpoint_and_cleaning_of_interrupted_saves(tmp_path):
    out = str(tmp_path)
    _fake_checkpoint(os.path.join(out, "checkpoint-2"))
    _fake_checkpoint(os.path.join(out, "checkpoint-4"), trainer_state='{"global_st')  # killed mid-write
    _fake_checkpoint(os.path.join(out, "checkpoint-6"), trainer_state=None)  # killed before the Trainer's files
    _fake_checkpoint(os.path.join(out, "checkpoint-8"), experts=False)  # trainer files but no expert state
    open(os.path.join(out, "checkpoint-2", "expert_state.safetensors.tmp123"), "w").close()
    assert latest_complete_checkpoint(out) == os.path.join(out, "checkpoint-2")
    assert latest_complete_checkpoint(out, experts=False) == os.path.join(out, "checkpoint-8")
    assert any("expert_state.safetensors is missing" in p for p in checkpoint_problems(os.path.join(out, "checkpoint-8")))
    removed = clean_interrupted_saves(out)
    assert sorted(os.path.relpath(p, out) for p in removed) == [
        os.path.join("checkpoint-2", "expert_state.safetensors.tmp123"), "checkpoint-4", "checkpoint-6"]
    assert sorted(os.listdir(out)) == ["checkpoint-2", "checkpoint-8"]  # a checkpoint without experts is kept


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors") and name.startswith("model"):
            reader = SafetensorsReader(os.path.join(folder, name))
            out.update({k: reader.get(k) for k in reader.keys()})
    return out


@pytest.mark.slow
def test_trainer_resume_from_a_moved_checkpoint_restores_the_experts(tmp_path):
    full = tmp_path / "full"
    # The three runs are forked children of one process that imported the Trainer once (tests/fork_runs.py): each a
    # process of its own, as the script run by `python`, without paying the ~10 s import three times.
    runs = ForkRuns(["transformers.trainer", "datasets", "hf_moe_offload"])
    try:
        runs.run([TRAINER_SCRIPT, full, "--max-steps", "4", "--save-steps", "2"], tmp_path / "full.log")
        # The checkpoint moved out of any output_dir: Trainer.train(resume_from_checkpoint=...) is all the callback
        # gets.
        moved = tmp_path / "elsewhere" / "my-checkpoint"
        shutil.copytree(full / "checkpoint-2", moved)
        resumed = tmp_path / "resumed"
        runs.run([TRAINER_SCRIPT, resumed, "--max-steps", "4", "--save-steps", "2", "--resume", moved],
                 tmp_path / "resumed.log")
        a, b = _tensors(full / "final"), _tensors(resumed / "final")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-exact on CPU
        # Without its expert state the same resume stops and says what is missing (no silent restart of the experts).
        os.remove(moved / EXPERT_STATE_FILE)
        code, err = runs.run([TRAINER_SCRIPT, tmp_path / "again", "--max-steps", "4", "--save-steps", "2",
                              "--resume", moved], tmp_path / "again.log", check=False)
    finally:
        runs.close()
    assert code != 0
    assert f"cannot resume the offloaded experts from {moved}: expert_state.safetensors is missing" in err


def _cli(out, corpus, phase="none", step=0, resume=False):
    args = [KILL_SCRIPT, phase, str(step), "--", "--log-level", "WARNING", "train",
            "--train-file", str(corpus), "--output-dir", str(out), "--num-experts", "4", "--host-cache-experts", "3",
            "--block-size", "32", "--batch-size", "2", "--steps", "9", "--save-steps", "3", "--save-total-limit", "1",
            "--logging-steps", "3", "--eval-steps", "100", "--max-eval-blocks", "2"]
    return args + (["--resume"] if resume else [])


@pytest.mark.slow
def test_sigkill_around_a_checkpoint_save_then_resume_is_bit_exact(tmp_path):
    corpus = tmp_path / "corpus.txt"
    write_corpus(corpus)
    # Every run is a forked child of one process that imported the CLI once (tests/scripts/fork_server.py): a
    # process of its own (the kill is a real SIGKILL; the resume shares no state with the killed run), and the nine
    # runs pay the ~10 s import once.
    server = ForkRuns(["transformers.trainer", "hf_moe_offload.cli.main"])
    try:
        server.run(_cli(tmp_path / "reference", corpus), tmp_path / "reference.log")
        reference = _tensors(tmp_path / "reference")
        assert reference
        # (phase, the checkpoint `--resume` must pick): killed during the save of step 6, with save_total_limit=1.
        for phase, latest in (("expert_state", 3), ("model_save", 3), ("trainer_state", 3), ("rotate", 6)):
            out = tmp_path / phase
            code, log = server.run(_cli(out, corpus, phase, 6), tmp_path / f"{phase}-killed.log", check=False)
            assert code == -9, (phase, log[-3000:])
            assert latest_complete_checkpoint(str(out)) == str(out / f"checkpoint-{latest}"), phase
            assert not (out / "model.safetensors.index.json").exists()  # it really died before the end
            server.run(_cli(out, corpus, resume=True), tmp_path / f"{phase}-resumed.log")
            got = _tensors(out)
            assert got.keys() == reference.keys(), phase
            assert all(torch.equal(got[k], reference[k]) for k in got), phase
            assert [p for p in os.listdir(out) if p.startswith("checkpoint-")] == ["checkpoint-9"], phase
    finally:
        server.close()


@pytest.mark.slow
def test_a_lora_run_on_frozen_offloaded_experts_resumes(tmp_path):
    """LoRA on frozen offloaded experts: no expert optimizer, so its checkpoints hold no expert state, and `--resume`
    takes them as complete (it asked for expert_state.safetensors); the resumed run reaches the planned step."""
    from hf_moe_offload.cli.main import main

    corpus = tmp_path / "corpus.txt"
    write_corpus(corpus)
    out = tmp_path / "out"
    args = ["--log-level", "ERROR", "train", "--method", "lora", "--train-file", str(corpus), "--output-dir", str(out),
            "--num-experts", "4", "--block-size", "32", "--batch-size", "2", "--save-steps", "2", "--eval-steps",
            "100", "--max-eval-blocks", "2"]
    assert main(args + ["--steps", "2"]) == 0
    assert not (out / "checkpoint-2" / "expert_state.safetensors").exists()
    assert latest_complete_checkpoint(str(out), experts=False) == str(out / "checkpoint-2")
    assert main(args + ["--steps", "4", "--resume"]) == 0
    with open(out / "checkpoint-4" / "trainer_state.json") as f:
        assert json.load(f)["global_step"] == 4


@pytest.mark.slow
def test_cli_user_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    from hf_moe_offload.cli.main import main

    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    cases = [
        (["--train-file", str(empty)], "hold no text"),
        (["--train-file", str(tmp_path / "absent.txt")], "not found"),
        (["--model-path", str(tmp_path / "no-model")], "no such folder"),
        (["--resume", "--output-dir", str(tmp_path / "out")], "no checkpoint in"),
        (["--resume", str(tmp_path / "nope")], "no such checkpoint folder"),
    ]
    for extra, message in cases:
        assert main(["--log-level", "ERROR", "train", "--short", "--output-dir", str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("hf-moe-offload: error:")]
        assert len(errors) == 1 and message in errors[0], (extra, err[-2000:])
        assert "Traceback" not in err, extra
    # A real process (a forked child of one that imported the CLI once, tests/fork_runs.py: the two runs pay the
    # import once): exit code 2 and one line; --debug shows the traceback instead.
    runs = ForkRuns(["hf_moe_offload.cli.main", "hf_moe_offload.cli.train"])
    try:
        code, err = runs.run(["-m", "hf_moe_offload.cli.main", "train", "--short", "--train-file", empty],
                             tmp_path / "plain.log", check=False)
        assert code == 2 and "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("hf-moe-offload: error: data file(s) hold no text")
        code, err = runs.run(["-m", "hf_moe_offload.cli.main", "train", "--short", "--train-file", empty, "--debug"],
                             tmp_path / "debug.log", check=False)
        assert code == 1 and "Traceback" in err and "UserError" in err
    finally:
        runs.close()
