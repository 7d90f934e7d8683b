"""`hf-moe-offload generate`: text generation from a model whose experts stay on disk (or in host memory).

The model is loaded with its experts streamed straight into the offload store (`load_offloaded_pretrained`, weights
only: no gradient or Adam state), so host memory holds the non-expert weights and the store's cache. It runs on the
GPU when there is one (`--device`): the non-expert weights move there and the experts are uploaded as decoding needs
them, the ones it uses most kept in a device cache (`--device-cache-mb`; offload/inference/device_cache.py). Decoding runs the
engine's inference mode (hf_moe_offload/offload/inference/policies.py): the disk tier's cache keeps the experts decoding uses
most (decayed frequency, a budget per layer), and on a GPU (or with `--pregate on`) pre-gating starts reading the next
layer's likely experts while this layer computes. One prompt streams its tokens as they come; several prompts are
generated as one left-padded batch.

    hf-moe-offload train && hf-moe-offload generate                  # the main job's model, its default output
    hf-moe-offload generate --model-path DIR --prompt "The history of" --offload disk --host-cache-experts 8
    hf-moe-offload generate --model-path DIR --prompt "One" --prompt "Two words" --offload host
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, TextStreamer
from transformers.generation.streamers import BaseStreamer

from .. import jobs
from ..errors import UserError
from .flags import add_dataclass_arguments, dataclass_values
from ..offload.api import get_offload_engine
from ..offload.checkpoint import load_offloaded_pretrained
from ..offload.config import OffloadConfig, resolve_device
from .train import DEFAULT_OUTPUT_DIR

logger = logging.getLogger(__name__)

DEFAULT_PROMPT = "The history of"


class _Timer(BaseStreamer):
    """Times what `generate` emits (the prompt first, then each new token), passing it on to `inner`."""

    def __init__(self, inner: BaseStreamer | None):
        self.inner = inner
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())
        if self.inner is not None:
            self.inner.put(value)

    def end(self):
        if self.inner is not None:
            self.inner.end()


# OffloadConfig's fields that are flags of `generate`, generated from the fields (hf_moe_offload.cli.flags: name, type,
# unit, choices and help as `train`'s). `--offload` is the command's own: it adds `none` (an ordinary resident model)
# and has no `auto` or `device`, so it is not the `mode` field's flag.
FLAG_FIELDS = ("offload_dir", "host_cache_experts", "pregate", "mmap_weights", "device_cache_bytes")


def inference_config(offload: str, offload_dir: str | None, host_cache_experts: int | None,
                     pregate: bool | None = None, mmap: bool | None = None, device_cache_bytes: int | None = None,
                     compute_on_host: bool | None = None) -> OffloadConfig:
    """The OffloadConfig `load_for_inference` loads an offloaded (`offload`: "disk" or "host") model with: frozen
    experts (weights only); the directory, host cache and mapped files are the disk tier's only."""
    disk = offload == "disk"
    return OffloadConfig(mode=offload, offload_dir=offload_dir if disk else None,
                         host_cache_experts=host_cache_experts if disk else None,
                         train_experts=False, pregate=pregate, mmap_weights=mmap if disk else None,
                         device_cache_bytes=device_cache_bytes, compute_on_host=compute_on_host)


def load_for_inference(model_path: str, offload: str, offload_dir: str | None, host_cache_experts: int | None,
                       pregate: bool | None = None, dtype: torch.dtype | None = None, mmap: bool | None = None,
                       device: str | torch.device | None = None, device_cache_bytes: int | None = None,
                       compute_on_host: bool | None = None):
    """The model at `model_path` with its experts in the `offload` tier ("disk", "host") or resident ("none"), its
    non-expert weights on `device` (default: a GPU when there is one); `device_cache_bytes` and `compute_on_host`:
    the offloaded experts' device cache and the host-or-upload choice for a missed expert (`OffloadConfig`'s fields of
    those names)."""
    device = resolve_device(device)
    if offload == "none":
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    config = inference_config(offload, offload_dir, host_cache_experts, pregate=pregate, mmap=mmap,
                              device_cache_bytes=device_cache_bytes, compute_on_host=compute_on_host)
    # Weights only, in the model's dtype: a bf16 model's store holds bf16 experts and nothing else.
    return load_offloaded_pretrained(model_path, config, dtype=dtype, device=device).eval()


def offload_arguments(args: argparse.Namespace, offload_dir: str | None = None) -> dict:
    """`load_for_inference`'s (and `inference_config`'s) offload arguments from generate's parsed flags, read back
    through the flags module (MiB to bytes, auto/on/off to None/True/False); `offload_dir`: the directory to use
    where `--offload-dir` was not given."""
    values = dataclass_values(OffloadConfig, args, names=FLAG_FIELDS)
    return dict(offload=args.offload, offload_dir=values["offload_dir"] or offload_dir,
                host_cache_experts=values["host_cache_experts"], pregate=values["pregate"],
                mmap=values["mmap_weights"], device_cache_bytes=values["device_cache_bytes"])


def run(args: argparse.Namespace) -> dict:
    if not os.path.isdir(args.model_path) and os.path.exists(args.model_path):
        raise UserError(f"--model-path {args.model_path!r} is a file; give the folder of a saved model")
    if args.model_path == DEFAULT_OUTPUT_DIR and not os.path.isdir(args.model_path):
        raise UserError(f"no model at {DEFAULT_OUTPUT_DIR!r} (the main job's output): run `hf-moe-offload train` first "
                        "or pass --model-path")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    prompts = args.prompt or [DEFAULT_PROMPT]
    tokenizer = jobs.load_tokenizer(args.tokenizer, model_path=args.model_path)
    tokenizer.padding_side = "left"  # decoder-only batches pad on the left
    dtype = {"fp32": None, "bf16": torch.bfloat16}[args.precision]
    scratch = None
    if args.offload == "disk" and args.offload_dir is None:
        scratch = tempfile.mkdtemp(prefix="hf-moe-offload-generate-")
    try:
        device = resolve_device(args.device)
        model = load_for_inference(args.model_path, dtype=dtype, device=device,
                                   **offload_arguments(args, scratch))
        torch.manual_seed(args.seed)
        batch = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
        streamer = TextStreamer(tokenizer, skip_prompt=False) if len(prompts) == 1 and not args.quiet else None
        timer = _Timer(streamer)
        engine = get_offload_engine(model)
        if engine is not None and engine.store is not None:
            engine.stats.reset()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=args.do_sample,
                                 temperature=args.temperature if args.do_sample else None,
                                 top_p=args.top_p if args.do_sample else None,
                                 pad_token_id=tokenizer.pad_token_id, streamer=timer, use_cache=True)
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:].cpu(), skip_special_tokens=True)
        if streamer is None and not args.quiet:
            for prompt, text in zip(prompts, texts):
                print(f"{prompt}{text}\n")
        new = timer.times[1:]
        figures = {"device": str(device), "prompts": len(prompts), "new_tokens": len(new),
                   "time_to_first_token_s": new[0] - t0 if new else None,
                   "decode_tokens_per_s": (len(new) - 1) * len(prompts) / (new[-1] - new[0]) if len(new) > 1 else None,
                   "texts": texts}
        if engine is not None and engine.store is not None:
            logs = engine.stats.as_log_dict(prefix="")
            figures.update(offload=args.offload, cache_hit_rate=engine.stats.cache_hit_rate,
                           pregate_hit_rate=logs.get("pregate_hit_rate"),
                           device_cache_hit_rate=engine.stats.device_cache_hit_rate,
                           uploaded_MB_per_token=logs["h2d_MB"] / max(1, len(new)),
                           disk_read_MB_per_token=logs["disk_read_MB"] / max(1, len(new)),
                           disk_mapped_MB_per_token=logs.get("disk_mapped_MB", 0.0) / max(1, len(new)))
            engine.store.close()
        _print_figures(figures)
        return figures
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _print_figures(f: dict) -> None:
    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    line = (f"[generate] {f['new_tokens']} new tokens x {f['prompts']} prompt(s) on {f['device']}; time to first token "
            f"{fmt(f['time_to_first_token_s'], '.3f')} s; decoding {fmt(f['decode_tokens_per_s'], '.1f')} tokens/s")
    if "offload" in f:
        line += (f"; {f['offload']} tier: cache hit rate {fmt(f['cache_hit_rate'], '.2f')}, pre-gating hit rate "
                 f"{fmt(f['pregate_hit_rate'], '.2f')}, {fmt(f['disk_read_MB_per_token'], '.2f')} MB read into the "
                 f"cache and {fmt(f['disk_mapped_MB_per_token'], '.2f')} MB used from mapped files per token")
        if f["device_cache_hit_rate"] is not None or f["uploaded_MB_per_token"]:
            line += (f"; device cache hit rate {fmt(f['device_cache_hit_rate'], '.2f')}, "
                     f"{f['uploaded_MB_per_token']:.2f} MB uploaded per token")
    print(line)


def add_cli(sub) -> None:
    p = sub.add_parser("generate", help="generate text with the experts offloaded to disk or host memory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=DEFAULT_OUTPUT_DIR,
                   help=f"a saved model folder (default: the main job's output, {DEFAULT_OUTPUT_DIR})")
    p.add_argument("--tokenizer", default=None, help="tokenizer name or folder (default: the model folder's)")
    p.add_argument("--prompt", action="append", help=f"a prompt; repeat for a batch (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens generated per prompt")
    p.add_argument("--device", default=None, help="where the model computes (default: cuda when a GPU is there, else "
                   "cpu); the offloaded experts are uploaded to it as decoding needs them")
    g = p.add_argument_group("expert offload (OffloadConfig's fields, as `train` takes them; --offload is "
                             "generate's own)")
    g.add_argument("--offload", choices=("disk", "host", "none"), default="disk",
                   help="where the experts live while generating (none: an ordinary resident model)")
    add_dataclass_arguments(g, OffloadConfig, names=FLAG_FIELDS, notes={
        "offload_dir": "generate's default: a temporary one, removed after"})
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="the dtype the model is loaded and computes in")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --do-sample)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (with --do-sample)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    p.add_argument("--quiet", action="store_true", help="print only the figures")
    p.set_defaults(func=run)


__all__ = ["FLAG_FIELDS", "add_cli", "inference_config", "load_for_inference", "offload_arguments", "run"]
