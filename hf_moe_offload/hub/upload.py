"""A run folder to the Hub: `push_to_hub(folder, repo_id)` uploads model, tokenizer, card, plots and the remote code with
`huggingface_hub.HfApi` (`create_repo` + `upload_folder`), leaving out the expert store and Trainer checkpoints. The
card is re-rendered first so that its loading snippets name the repository.
"""

from __future__ import annotations

import json
import logging
import os

from .cards import CARD_FILE, RECORD_FILE, REMOTE_CODE_FILES, write_model_card

logger = logging.getLogger(__name__)

# Never uploaded: the disk tier's working files, Trainer checkpoints (with their optimizer state) and temp files.
UPLOAD_IGNORE = ["expert_store/**", "checkpoint-*/**", "runs/**", ".tmp*", "**/.tmp*", "*.tmp*", ".cache/**"]


def _check_folder(folder: str) -> None:
    names = set(os.listdir(folder))
    problems = []
    if "config.json" not in names and "adapter_config.json" not in names:
        problems.append("no config.json (save the model first)")
    if not any(n.endswith(".safetensors") or n.endswith(".bin") for n in names):
        problems.append("no weights (*.safetensors)")
    if CARD_FILE not in names:
        problems.append(f"no {CARD_FILE} (the model card)")
    if not any(n.startswith("tokenizer") for n in names):
        problems.append("no tokenizer files (tokenizer.save_pretrained(folder))")
    if "config.json" in names:
        with open(os.path.join(folder, "config.json")) as f:
            auto_map = json.load(f).get("auto_map", {})
        absent = [n for n in REMOTE_CODE_FILES if auto_map and n not in names]
        if absent:
            problems.append(f"auto_map is set but the remote code {absent} is missing")
    if problems:
        raise FileNotFoundError(f"{folder} is not ready to push: " + "; ".join(problems))


def push_to_hub(folder: str, repo_id: str, private: bool = False, token: str | None = None,
                commit_message: str = "Upload MoE model trained with hf_moe_offload") -> str:
    """Upload a run folder (model, tokenizer, card, plots, metrics, remote code) to the Hub model repo `repo_id`.

    The card is re-rendered from `metrics.json` with `repo_id` so that its snippets load from the Hub. The expert
    store, Trainer checkpoints and temporary files are not uploaded (`UPLOAD_IGNORE`). Authentication is
    huggingface_hub's own (`token`, `HF_TOKEN` or `huggingface-cli login`). Returns the repository URL.
    """
    from huggingface_hub import HfApi

    record_path = os.path.join(folder, RECORD_FILE)
    if os.path.exists(record_path):
        with open(record_path, encoding="utf-8") as f:
            record = json.load(f)
        record["hub_model_id"] = repo_id
        write_model_card(folder, record)
        with open(record_path, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    _check_folder(folder)
    api = HfApi(token=token)
    try:
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        repo_id = getattr(url, "repo_id", None) or repo_id
        api.upload_folder(folder_path=folder, repo_id=repo_id, repo_type="model", commit_message=commit_message,
                          ignore_patterns=UPLOAD_IGNORE)
    except Exception as err:
        raise RuntimeError(
            f"uploading {folder} to the Hub repo {repo_id!r} failed: {err}. The run is saved locally; log in "
            f"(`hf auth login` or HF_TOKEN) and retry with `hf-moe-offload push {folder} {repo_id}`"
        ) from err
    logger.info("pushed %s to https://huggingface.co/%s", folder, repo_id)
    return f"https://huggingface.co/{repo_id}"


def add_cli(sub) -> None:
    """`hf-moe-offload push FOLDER REPO_ID`: upload a saved run (e.g. after a run without --push-to-hub)."""
    p = sub.add_parser("push", help="upload a saved run folder (model, tokenizer, card, plots) to the Hub")
    p.add_argument("folder", help="output dir of a run (holds config.json, weights, README.md, metrics.json)")
    p.add_argument("repo_id", help="Hub model repo, e.g. your-name/moe-gpt-small")
    p.add_argument("--private", action="store_true", help="create the Hub repo private")
    p.set_defaults(func=lambda args: print(push_to_hub(args.folder, args.repo_id, private=args.private)))


__all__ = ["push_to_hub", "UPLOAD_IGNORE"]
