"""Trainer checkpoints that hold the offloaded experts: complete or invisible, and resumable from any path.

Offloaded experts are not `nn.Parameter`s, so the Trainer's own checkpoint files (model, optimizer, scheduler, RNG,
`trainer_state.json`) miss their fp32 master weights, Adam moments and step counts. `ExpertOptimizerCallback` writes
them to `expert_state.safetensors` (atomically, a CRC32 per expert) in the checkpoint folder *before* the Trainer
writes its files, when the Trainer is about to save (`on_step_end` / `on_epoch_end` with `control.should_save`).
The Trainer writes `trainer_state.json` after its other files. Hence:

- a checkpoint is **complete** when `trainer_state.json` parses and, for a model with offloaded experts, the expert
  state is there and whole (`checkpoint_problems` says what is missing otherwise);
- the Trainer's checkpoint rotation (`save_total_limit`) runs after `trainer_state.json` is written, so it only
  ever deletes older checkpoints once the new one is complete;
- what an interrupted save leaves (a folder without `trainer_state.json`, temporary files) is removed by
  `clean_interrupted_saves` (the callback runs it when the Trainer is created), so that the Trainer's own
  `get_last_checkpoint` / `resume_from_checkpoint=True` never picks it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys

from ..errors import CheckpointError
from ..offload.checkpoint import EXPERT_STATE_FILE, read_expert_state_header
from ..offload.stores.safetensors_io import missing_shards, read_weight_map

logger = logging.getLogger(__name__)

TRAINER_STATE_FILE = "trainer_state.json"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_TEMPORARY = re.compile(r"(\.tmp\d+$)|(^\.tmp-save-)")  # write_safetensors_streaming / save_offloaded_pretrained


def checkpoint_problems(folder: str, experts: bool = True) -> list[str]:
    """What keeps `folder` from being a complete, resumable Trainer checkpoint (empty when it is one).
    `experts`: the model being resumed has offloaded experts, so their state must be there too."""
    if not os.path.isdir(folder):
        return [f"{folder} does not exist"]
    problems = []
    trainer_state = _trainer_state_problem(folder)
    if trainer_state:
        problems.append(trainer_state)
    try:
        weight_map = read_weight_map(folder)
        missing = missing_shards(folder, weight_map) if weight_map is not None else []
        if missing:
            problems.append(f"model shard(s) missing: {', '.join(missing)}")
    except CheckpointError as err:
        problems.append(str(err))
    if experts:
        if not os.path.exists(os.path.join(folder, EXPERT_STATE_FILE)):
            problems.append(f"{EXPERT_STATE_FILE} is missing (the offloaded experts' weights and Adam state; it is "
                            "written by ExpertOptimizerCallback)")
        else:
            try:
                read_expert_state_header(folder)
            except CheckpointError as err:
                problems.append(str(err))
    return problems


def _trainer_state_problem(folder: str) -> str | None:
    """Why the Trainer's save of `folder` did not finish (None when `trainer_state.json`, its last file, parses)."""
    try:
        with open(os.path.join(folder, TRAINER_STATE_FILE)) as f:
            json.load(f)
    except FileNotFoundError:
        return f"{TRAINER_STATE_FILE} is missing (the Trainer's save did not finish)"
    except ValueError:
        return f"{TRAINER_STATE_FILE} is truncated (the Trainer's save did not finish)"
    return None


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every `checkpoint-<step>` folder in `output_dir`, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_DIR.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return sorted(found)


def latest_complete_checkpoint(output_dir: str, experts: bool = True) -> str | None:
    """The newest complete checkpoint in `output_dir` (None when there is none)."""
    for _step, path in reversed(list_checkpoints(output_dir)):
        if not checkpoint_problems(path, experts):
            return path
    return None


def describe_checkpoints(output_dir: str, experts: bool = True) -> str:
    """One line per checkpoint folder and what it lacks (for error messages)."""
    lines = []
    for _step, path in list_checkpoints(output_dir):
        problems = checkpoint_problems(path, experts)
        lines.append(f"{os.path.basename(path)}: " + ("complete" if not problems else "; ".join(problems)))
    return "; ".join(lines) if lines else "no checkpoint-<step> folders"


def clean_interrupted_saves(output_dir: str) -> list[str]:
    """Remove what interrupted saves left in `output_dir`: checkpoint folders without a readable
    `trainer_state.json` (a save that never finished, or a rotation that was cut short) and temporary files inside
    the others. A checkpoint that only lacks expert state is left alone (it may come from a run without offload).
    Returns what was removed."""
    removed = []
    for _step, path in list_checkpoints(output_dir):
        if _trainer_state_problem(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        for name in os.listdir(path):
            if _TEMPORARY.search(name):
                target = os.path.join(path, name)
                if os.path.isdir(target):
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    os.remove(target)
                removed.append(target)
    if removed:
        logger.warning("removed what interrupted checkpoint saves left in %s: %s", output_dir,
                       ", ".join(os.path.relpath(p, output_dir) for p in removed))
    return removed


NOT_FOUND = object()  # trainer_resume_argument outside of Trainer.train


def trainer_resume_argument():
    """The checkpoint the running `Trainer.train` resumes from (its resolved `resume_from_checkpoint`; None for a
    fresh start), read from the Trainer's training-loop frame on the call stack; `NOT_FOUND` outside of it.

    NOTE: callbacks are not told this path, and a checkpoint copied or moved elsewhere cannot be found from the
    output directory, so the Trainer's own argument is the only reliable source. The test suite runs the real Trainer
    (resume from a moved checkpoint), so a transformers release that renames it fails there, not silently."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_inner_training_loop" and isinstance(frame.f_locals.get("self"), Trainer):
            return frame.f_locals.get("resume_from_checkpoint")
        frame = frame.f_back
    return NOT_FOUND


__all__ = [
    "TRAINER_STATE_FILE",
    "checkpoint_problems",
    "list_checkpoints",
    "latest_complete_checkpoint",
    "describe_checkpoints",
    "clean_interrupted_saves",
    "trainer_resume_argument",
]
