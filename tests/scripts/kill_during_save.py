"""Runs `hf-moe-offload` and SIGKILLs itself at a chosen moment of the checkpoint save of step STEP.

python tests/scripts/kill_during_save.py PHASE STEP -- train ARGS...

PHASE (the process dies with SIGKILL, nothing cleans up):
- expert_state:  half-way through writing expert_state.safetensors (before the Trainer's own files);
- model_save:    after the first model shard of the checkpoint has been moved into place;
- trainer_state: half-way through writing trainer_state.json (the Trainer's last file);
- rotate:        while the Trainer deletes the previous checkpoint (save_total_limit), after it removed some of it;
- none:          no kill (the uninterrupted reference).
Fault injection only: everything else is the real CLI, Trainer and disk tier.
"""

import os
import shutil
import signal
import sys

phase, step = sys.argv[1], int(sys.argv[2])
argv = sys.argv[sys.argv.index("--") + 1 :]
target = f"checkpoint-{step}"


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if phase == "expert_state":
    from hf_moe_offload.offload import checkpoint

    original = checkpoint.write_safetensors_streaming

    def write(path, specs, chunks, metadata=None):
        if target in path and path.endswith(checkpoint.EXPERT_STATE_FILE):
            def dying(name, _first=specs[0][0]):
                yield from chunks(name)
                if name != _first:
                    die()
            return original(path, specs, dying, metadata)
        return original(path, specs, chunks, metadata)

    checkpoint.write_safetensors_streaming = write
elif phase == "model_save":
    original_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        original_replace(src, dst, *args, **kwargs)
        if target in str(dst) and str(dst).endswith(".safetensors") and "expert_state" not in str(dst):
            die()

    os.replace = replace
elif phase == "trainer_state":
    from transformers.trainer_callback import TrainerState

    original_save = TrainerState.save_to_json

    def save_to_json(self, json_path):
        if target in json_path:
            original_save(self, json_path)
            with open(json_path, "r+") as f:  # as if the write stopped half-way
                f.truncate(os.path.getsize(json_path) // 2)
            die()
        original_save(self, json_path)

    TrainerState.save_to_json = save_to_json
elif phase == "rotate":
    original_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if os.path.basename(os.path.normpath(str(path))).startswith("checkpoint-") and os.path.exists(
                os.path.join(os.path.dirname(os.path.normpath(str(path))), target, "trainer_state.json")):
            names = sorted(os.listdir(path))  # delete part of the old checkpoint: its weights go first
            for name in names:
                if name.endswith(".safetensors"):
                    os.remove(os.path.join(path, name))
            die()
        return original_rmtree(path, *args, **kwargs)

    shutil.rmtree = rmtree
elif phase != "none":
    raise SystemExit(f"unknown phase {phase}")

from hf_moe_offload.cli.main import main  # noqa: E402

sys.exit(main(argv))
