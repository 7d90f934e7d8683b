"""Convert fairseq MoE language-model checkpoints (a `model-shared.pt` plus `model-rank-*.pt` files) to MoE-GPT.

Format and math: `shared/specs/fairseq-moe-checkpoints.md` (cited below as spec §n).

Streaming with bounded memory: the shared file (non-expert weights) is loaded once and written as one shard; the
expert shards (one per MoE layer, holding the layer's (E, ...) tensors) are laid out up front — every shape is known
from the config and the first rank file — and each rank file is then loaded once and its experts written with
positioned writes straight into their slots (`g = r*L + j`, spec §1). Peak host memory is about the shared file plus
one rank file. Everything is written into a temporary folder next to the destination and renamed at the end: an
error leaves no partial output.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
import shutil
import struct

import torch
from tqdm.auto import tqdm

from ..errors import FairseqConversionError
from ..models.moe_gpt import MoEGPTConfig

logger = logging.getLogger(__name__)

_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_WRAPPERS = ("_fsdp_wrapped_module.", "_fpw_module.", "_checkpoint_wrapped_module.")  # spec §2, stripped defensively
_EXPERT_KEY = re.compile(r"^decoder\.layers\.(\d+)\.moe_layer\.experts\.(\d+)\.(fc1|fc2)\.(weight|bias)$")
_ACTIVATIONS = {"gelu": "gelu", "gelu_accurate": "gelu_new", "relu": "relu"}


# --- locating and loading files (spec §1) ---
def find_checkpoint_files(src: str) -> tuple[str, list[str]]:
    """(shared file, rank files sorted by rank) from `.../model.pt`, the shared file or their directory."""
    src = os.path.abspath(src)
    if os.path.isdir(src):
        shared = sorted(glob.glob(os.path.join(src, "*-shared.pt")))
        if len(shared) != 1:
            raise FairseqConversionError(
                f"{src} must contain exactly one '*-shared.pt' file (found {len(shared)}); pass the file itself")
        shared_path = shared[0]
    elif src.endswith("-shared.pt"):
        shared_path = src
    elif src.endswith(".pt"):
        shared_path = src[: -len(".pt")] + "-shared.pt"  # fairseq: model.pt -> model-shared.pt (+ model-rank-N.pt)
    else:
        raise FairseqConversionError(f"{src}: expected a directory, model.pt or model-shared.pt")
    if not os.path.exists(shared_path):
        raise FairseqConversionError(f"{shared_path} not found: an MoE checkpoint has a shared file and rank files")
    prefix = shared_path[: -len("-shared.pt")]
    ranks = {}
    for path in glob.glob(f"{glob.escape(prefix)}-rank-*.pt"):
        m = re.search(r"-rank-(\d+)\.pt$", path)
        if m:
            ranks[int(m.group(1))] = path
    if not ranks:
        raise FairseqConversionError(f"no rank files '{os.path.basename(prefix)}-rank-N.pt' next to {shared_path}")
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if missing:
        raise FairseqConversionError(
            f"rank files {missing} are missing next to {shared_path} (found {len(ranks)} of {max(ranks) + 1}); "
            "download the complete checkpoint")
    return shared_path, [ranks[r] for r in range(len(ranks))]


def load_fairseq_file(path: str, allow_unsafe_pickle: bool = False) -> dict:
    """`torch.load` with `weights_only=True`; a file that needs arbitrary unpickling is refused unless trusted."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - classify below
        if allow_unsafe_pickle and "weights_only" in str(err).lower():
            logger.warning("loading %s with weights_only=False (trusted by --trust-pickle)", path)
            return torch.load(path, map_location="cpu", weights_only=False)
        if "weights_only" in str(err).lower() or "unsupported global" in str(err).lower():
            raise FairseqConversionError(
                f"{path} needs full unpickling, which can run arbitrary code. If you trust this file, pass "
                "--trust-pickle (Python: allow_unsafe_pickle=True)") from err
        raise FairseqConversionError(f"{path} is truncated or not a torch checkpoint ({err})") from err


def _model_state(ckpt: dict, path: str) -> dict[str, torch.Tensor]:
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise FairseqConversionError(f"{path} has no 'model' entry: not a fairseq checkpoint")
    out = {}
    for key, value in ckpt["model"].items():
        for w in _WRAPPERS:
            key = key.replace(w, "")
        out[key] = value
    return out


def _model_cfg(ckpt: dict, path: str) -> dict:
    cfg = ckpt.get("cfg")
    model_cfg = cfg.get("model") if isinstance(cfg, dict) else None
    if model_cfg is None and ckpt.get("args") is not None:  # legacy argparse Namespace
        model_cfg = vars(ckpt["args"])
    if model_cfg is None:
        raise FairseqConversionError(f"{path} carries no model config (cfg['model'] or args)")
    return dict(model_cfg)


# --- config (spec §3) ---
def config_from_fairseq(cfg: dict, shared: dict[str, torch.Tensor], num_experts: int, top1: bool | None = None,
                        fairseq_capacity: bool = False) -> MoEGPTConfig:
    def get(name, default=None):
        return cfg.get(name, default)

    if not get("decoder_normalize_before", True):
        raise FairseqConversionError("post-norm fairseq models (decoder_normalize_before=False) are not supported")
    policy = get("moe_second_expert_policy", "all")
    if policy != "all":
        raise FairseqConversionError(
            f"moe_second_expert_policy={policy!r} is random in fairseq; only 'all' converts to a deterministic model")
    act = get("activation_fn", "gelu")
    if act not in _ACTIVATIONS:
        raise FairseqConversionError(f"activation_fn={act!r} is not supported (gelu, gelu_accurate, relu)")
    vocab, dim = shared["decoder.embed_tokens.weight"].shape
    version = shared.get("decoder.version")
    learned = bool(get("decoder_learned_pos", False))
    offset = 2  # padding_idx (1) + 1: the t-th non-pad token uses row t + 1 (spec §4)
    if learned:
        max_pos = shared["decoder.embed_positions.weight"].shape[0] - offset
    else:
        max_pos = int(get("max_target_positions", get("tokens_per_sample", 2048)))
    return MoEGPTConfig(
        vocab_size=vocab,
        max_position_embeddings=max_pos,
        hidden_size=dim,
        num_hidden_layers=int(get("decoder_layers")),
        num_attention_heads=int(get("decoder_attention_heads")),
        intermediate_size=int(get("decoder_ffn_embed_dim")),
        num_experts=num_experts,
        num_experts_per_tok=1 if (top1 if top1 is not None else get("moe_top1_expert", False)) else 2,
        moe_layer_frequency=int(get("moe_freq", 0)),
        activation_function=_ACTIVATIONS[act],
        hidden_dropout=float(get("dropout", 0.1)),
        attention_dropout=float(get("attention_dropout", 0.0)),
        activation_dropout=float(get("activation_dropout", 0.0) or 0.0),
        layer_norm_eps=1e-5,
        router_aux_loss_coef=float(get("moe_gate_loss_wt", 0.01)),
        normalize_top2_weights=True,
        normalize_top2_before_dropping=bool(get("moe_normalize_gate_prob_before_dropping", False)),
        drop_tokens=fairseq_capacity,
        eval_capacity_token_fraction=float(get("moe_eval_capacity_token_fraction", -1.0) or -1.0),
        position_embedding_type="learned" if learned else "sinusoidal",
        position_offset=offset,
        scale_embedding=not get("no_scale_embedding", False),
        layernorm_embedding=bool(get("layernorm_embedding", False)),
        # spec gotcha 8: without decoder.version > 2 fairseq drops the final LayerNorm
        final_layer_norm=(not get("no_decoder_final_norm", False)) and version is not None and float(version.reshape(-1)[0]) > 2,
        tie_word_embeddings=bool(get("share_decoder_input_output_embed", True)),
        pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )


# --- key mapping (spec §2) ---
def map_shared_key(key: str) -> str | None:
    """Our state-dict name for a shared-file key; None for keys that are dropped (checked elsewhere)."""
    if key in ("decoder.version", "decoder.embed_positions._float_tensor", "decoder.output_projection.weight"):
        return None
    rules = [
        (r"^decoder\.embed_tokens\.weight$", "model.embed_tokens.weight"),
        (r"^decoder\.embed_positions\.weight$", "model.embed_positions.weight"),
        (r"^decoder\.layernorm_embedding\.(weight|bias)$", r"model.layernorm_embedding.\1"),
        (r"^decoder\.layer_norm\.(weight|bias)$", r"model.layer_norm.\1"),
        (r"^decoder\.layers\.(\d+)\.self_attn\.(q|k|v|out)_proj\.(weight|bias)$", r"model.layers.\1.self_attn.\2_proj.\3"),
        (r"^decoder\.layers\.(\d+)\.(self_attn_layer_norm|final_layer_norm)\.(weight|bias)$", r"model.layers.\1.\2.\3"),
        (r"^decoder\.layers\.(\d+)\.(fc1|fc2)\.(weight|bias)$", r"model.layers.\1.mlp.\2.\3"),
        (r"^decoder\.layers\.(\d+)\.moe_layer\.gate\.wg\.weight$", r"model.layers.\1.moe.router.weight"),
    ]
    for pattern, repl in rules:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key)
    raise FairseqConversionError(f"unexpected key {key!r} in the shared file; is this a fairseq transformer_lm?")


# --- safetensors layout written in place ---
def _layout(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, int], int]:
    """Header bytes, absolute file offset of each tensor, and the file size of a safetensors file."""
    header, offsets, offset = {}, {}, 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets[name] = offset
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    head = struct.pack("<Q", len(blob)) + blob
    return head, {k: v + len(head) for k, v in offsets.items()}, offset + len(head)


def convert_fairseq_checkpoint(
    src: str,
    dst: str,
    dtype: torch.dtype | None = None,
    dict_path: str | None = None,
    allow_unsafe_pickle: bool = False,
    fairseq_capacity: bool = False,
) -> str:
    """Convert a fairseq MoE LM checkpoint at `src` into a MoE-GPT folder `dst` (sharded safetensors + index +
    config + remote code, and a tokenizer when `dict_path` is given). Returns `dst`.

    Steps: 1. read the shared file and check the expert split (`_read_shared`); 2. write the non-expert shard
    (`_write_shared_shard`); 3. lay out the expert shards and fill them rank file by rank file
    (`_write_expert_shards`); 4. check the weights against the model, write the index, config, remote code and
    tokenizer (`_write_index_and_code`); all in a temporary folder renamed to `dst` at the end."""
    import hf_moe_offload  # noqa: F401  (registers auto classes for the remote-code files)

    dst = os.path.abspath(dst)
    if os.path.exists(dst):
        raise FairseqConversionError(f"{dst} exists; choose a new output directory")
    shared_path, rank_paths = find_checkpoint_files(src)
    shared, config, E, W, L = _read_shared(shared_path, rank_paths, allow_unsafe_pickle, fairseq_capacity)
    moe_layers = config.moe_layer_indices

    tmp = dst + ".tmp-convert"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        total = 1 + len(moe_layers)
        weight_map = _write_shared_shard(shared, config, dtype, tmp, total)
        store_dtype = _write_expert_shards(rank_paths, config, E, W, L, dtype, allow_unsafe_pickle, tmp, total,
                                           weight_map)
        _write_index_and_code(config, shared_path, weight_map, dtype, store_dtype, dict_path, tmp)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s (%d rank files, %d experts x %d MoE layers) to %s", shared_path, W, E,
                len(moe_layers), dst)
    return dst


def _read_shared(shared_path: str, rank_paths: list[str], allow_unsafe_pickle: bool, fairseq_capacity: bool):
    """Step 1: the shared file's weights, the MoE-GPT config, and the expert split (E experts, W rank files, L
    experts per rank file; spec §1), checked."""
    shared_ckpt = load_fairseq_file(shared_path, allow_unsafe_pickle)
    shared = _model_state(shared_ckpt, shared_path)
    cfg = _model_cfg(shared_ckpt, shared_path)
    del shared_ckpt
    W = len(rank_paths)
    E = int(cfg.get("moe_expert_count", 0))
    if E <= 0:
        raise FairseqConversionError(f"{shared_path}: cfg['model']['moe_expert_count'] is missing: not an MoE model")
    if E % W and W % E:
        raise FairseqConversionError(f"{E} experts cannot be split over {W} rank files (neither divides the other)")
    L = max(1, E // W)  # experts per rank file (spec §1); W > E: file r holds expert r % E
    config = config_from_fairseq(cfg, shared, E, fairseq_capacity=fairseq_capacity)
    if "decoder.output_projection.weight" in shared and config.tie_word_embeddings:
        if not torch.equal(shared["decoder.output_projection.weight"], shared["decoder.embed_tokens.weight"]):
            raise FairseqConversionError(f"{shared_path}: output_projection differs from embed_tokens though tied")
    return shared, config, E, W, L


def _write_shared_shard(shared: dict[str, torch.Tensor], config, dtype: torch.dtype | None, tmp: str,
                        total: int) -> dict[str, str]:
    """Step 2: the non-expert weights as the first shard; returns the weight map so far."""
    from safetensors.torch import save_file

    base = {}
    for key, value in shared.items():
        name = map_shared_key(key)
        if name is not None:
            base[name] = value.to(dtype) if dtype is not None else value
    if not config.tie_word_embeddings:
        base["lm_head.weight"] = shared["decoder.output_projection.weight"].to(dtype or shared["decoder.output_projection.weight"].dtype)
    shard0 = f"model-00001-of-{total:05d}.safetensors"
    save_file({k: v.contiguous() for k, v in base.items()}, os.path.join(tmp, shard0), metadata={"format": "pt"})
    return {k: shard0 for k in base}


def _write_expert_shards(rank_paths, config, E, W, L, dtype, allow_unsafe_pickle, tmp, total,
                         weight_map: dict[str, str]) -> torch.dtype:
    """Step 3: one shard per MoE layer, laid out up front, then filled rank file by rank file (one rank file in
    memory at a time), checked complete and fsynced. Adds the shards to `weight_map`; returns the stored dtype."""
    moe_layers = config.moe_layer_indices
    first = _model_state(load_fairseq_file(rank_paths[0], allow_unsafe_pickle), rank_paths[0])
    probe = next((k for k in first if _EXPERT_KEY.match(k)), None)
    if probe is None:
        raise FairseqConversionError(f"{rank_paths[0]} holds no expert weights")
    store_dtype = dtype or first[probe].dtype
    I, H = config.intermediate_size, config.hidden_size
    shapes = {"fc1_weight": (E, I, H), "fc1_bias": (E, I), "fc2_weight": (E, H, I), "fc2_bias": (E, H)}
    files, offsets = _lay_out_expert_shards(moe_layers, shapes, store_dtype, tmp, total, weight_map)
    written: set[tuple[int, int, str]] = set()
    for r, path in enumerate(tqdm(rank_paths, desc="converting rank files", unit="file")):
        state = first if r == 0 else _model_state(load_fairseq_file(path, allow_unsafe_pickle), path)
        first = None
        _write_rank_experts(state, r, L, E, W, moe_layers, shapes, store_dtype, files, offsets, written, path)
        del state
    need = {(i, g, t) for i in moe_layers for g in range(E) for t in shapes}
    if written != need:
        missing = sorted(need - written)[:3]
        raise FairseqConversionError(f"experts missing after reading every rank file, e.g. {missing}")
    for path in files.values():
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
    return store_dtype


def _lay_out_expert_shards(moe_layers, shapes, store_dtype, tmp, total, weight_map: dict[str, str]):
    """The expert shards' headers written and their files sized; returns (file of each MoE layer, absolute offset
    of each tensor) and adds the shards to `weight_map`."""
    files, offsets = {}, {}
    for n, i in enumerate(moe_layers):
        shard = f"model-{n + 2:05d}-of-{total:05d}.safetensors"
        specs = [(f"model.layers.{i}.moe.experts.{t}", store_dtype, s) for t, s in shapes.items()]
        head, offs, size = _layout(specs)
        path = os.path.join(tmp, shard)
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(size)
        files[i] = path
        offsets.update(offs)
        weight_map.update({name: shard for name, _, _ in specs})
    return files, offsets


def _write_index_and_code(config, shared_path, weight_map, dtype, store_dtype, dict_path, tmp) -> None:
    """Step 4: the weights checked against the model's, then the index, the config, the remote code (as
    save_pretrained writes it, so the folder loads where this package is absent) and the tokenizer."""
    from transformers.dynamic_module_utils import custom_object_save

    from ..models.moe_gpt import MoEGPTForCausalLM

    with torch.device("meta"):
        shell = MoEGPTForCausalLM(config)
    expected = {k for k in shell.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    if set(weight_map) != expected:
        raise FairseqConversionError(
            f"{shared_path}: missing weights {sorted(expected - set(weight_map))[:5]}, unexpected "
            f"{sorted(set(weight_map) - expected)[:5]}; the files do not match cfg['model']")
    with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"format": "pt"}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    if dtype is not None or store_dtype != torch.float32:
        config.dtype = str(store_dtype).replace("torch.", "")
    config.architectures = ["MoEGPTForCausalLM"]
    custom_object_save(shell, tmp, config=config)
    config.save_pretrained(tmp)
    if dict_path is not None:
        from .tokenizer import fairseq_gpt2_tokenizer

        fairseq_gpt2_tokenizer(dict_path, vocab_size=config.vocab_size).save_pretrained(tmp)
    else:
        logger.warning(
            "no --dict given: no tokenizer was written. fairseq ids differ from GPT-2 ids; convert again with "
            "--dict path/to/dict.txt (shipped with the checkpoint) to get a matching tokenizer")


def _write_rank_experts(state, r, L, E, W, moe_layers, shapes, store_dtype, files, offsets, written, path):
    """Positioned writes of one rank file's experts into the layer shards (g = r*L + j, spec §1)."""
    for key, value in state.items():
        m = _EXPERT_KEY.match(key)
        if m is None:
            if "expert" in key and "expert_centroids" not in key:
                raise FairseqConversionError(f"{path}: unexpected expert key {key!r}")
            continue
        i, j, fc, kind = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        if i not in moe_layers:
            raise FairseqConversionError(f"{path}: layer {i} holds experts but moe_freq makes it dense")
        if j >= L:
            raise FairseqConversionError(f"{path}: local expert {j} but {E} experts over {W} files give {L} per file")
        g = r * L + j if E >= W else r % E
        tensor_name = f"{fc}_{kind}"
        want = shapes[tensor_name][1:]
        if tuple(value.shape) != want:
            raise FairseqConversionError(
                f"{path}: {key} has shape {tuple(value.shape)}, expected {want} (rank files from another model?)")
        name = f"model.layers.{i}.moe.experts.{tensor_name}"
        data = value.to(store_dtype).contiguous()
        nbytes = data.numel() * data.element_size()
        fd = os.open(files[i], os.O_WRONLY)
        try:
            os.pwrite(fd, data.view(torch.uint8).numpy().tobytes(), offsets[name] + g * nbytes)
        finally:
            os.close(fd)
        written.add((i, g, tensor_name))


def add_cli(sub) -> None:
    p = sub.add_parser("convert-fairseq", help="convert a fairseq MoE LM checkpoint (shared + rank files) to MoE-GPT")
    p.add_argument("src", help=".../model.pt, .../model-shared.pt, or their directory")
    p.add_argument("dst", help="new output directory")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="store weights in this dtype (default: as stored, usually float16)")
    p.add_argument("--dict", dest="dict_path", default=None, help="fairseq dict.txt: also write a matching tokenizer")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow full unpickling for files that need it (only for files you trust)")
    p.add_argument("--fairseq-capacity", action="store_true",
                   help="reproduce fairseq's capacity/drop semantics (evaluation parity); default is dropless")

    def run(args) -> None:
        dst = convert_fairseq_checkpoint(args.src, args.dst, dtype=getattr(torch, args.dtype) if args.dtype else None,
                                         dict_path=args.dict_path, allow_unsafe_pickle=args.trust_pickle,
                                         fairseq_capacity=args.fairseq_capacity)
        print(f"converted to {dst}")

    p.set_defaults(func=run)


__all__ = [
    "convert_fairseq_checkpoint",
    "config_from_fairseq",
    "find_checkpoint_files",
    "load_fairseq_file",
    "map_shared_key",
    "FairseqConversionError",
]
