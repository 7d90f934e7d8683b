"""The causal-LM loss taken a chunk of tokens at a time, for every family.

transformers' causal LMs compute `logits = lm_head(hidden)` for every token and then the cross-entropy: a
(tokens, vocabulary) tensor, its fp32 copy and its gradient live through the step. With a 151k vocabulary and 8k
tokens that is ~5 GB in fp32 per copy. MoE-GPT chunks its loss inside its own forward (`loss_chunk_tokens`); the Hub
families keep transformers' forward, so here the loss is taken from outside it, through arguments every v5 causal
LM accepts:

- the model runs with `logits_to_keep=1` (its head projects the last position only) and `output_hidden_states=True`
  (whose last entry is the final norm's output, the head's input: transformers ties it to `last_hidden_state`);
- the cross-entropy of `hidden @ lm_head.weight.T` is taken `chunk` tokens at a time with the gradient of each chunk
  formed in the same pass (`chunked_lm_loss`, shared with MoE-GPT), so no logits tensor outlives its chunk;
- the family's load-balancing term is added as its own forward adds it (`router_aux_loss_coef * aux_loss`).

It is the same loss and gradients as the family's own head up to summation order (tests/test_lm_loss.py, every
family that builds tiny). Where a family's logits are more than `lm_head(hidden)` (a logit scale or soft-capping in
its config, a head with a bias or an adapter) the stock path runs; and the one projected position is checked against
`lm_head(hidden)` (by `chunked_causal_lm_loss` on every call, by `ChunkedLossTrainer` on its first training step: a
family's head does not change between steps, and the check costs a device sync), so a transform this module does not
know of fails loudly instead of training on a different loss.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable

import torch
from torch import nn

from ..errors import UserError
from ..models.moe_gpt.moe_ops import chunked_lm_loss
from ..trainer import OffloadTrainer

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100
# Config fields with which a family changes its logits after the head in transformers 5.23 (Granite's
# `logits / logits_scaling`, Cohere's `logits * logit_scale`, Gemma's tanh soft-capping, Muse's `output_multiplier`).
# A soft cap of 30 on logits of ~0.1 changes them by ~1e-6, below what the head check can tell from rounding, so
# these are read from the config instead.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logits_scaling", "logit_scale", "output_multiplier")


def _core_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / accelerate / PEFT wrappers (the module whose head and config count)."""
    while True:
        if hasattr(model, "get_base_model"):  # PEFT
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):  # DDP, accelerate's wrappers
            model = model.module
        else:
            return model


def why_not_chunked(model: nn.Module) -> str | None:
    """None where `chunked_causal_lm_loss` applies to this model; else the reason the stock loss is used."""
    core = _core_model(model)
    config = getattr(core, "config", None)
    if config is None or not hasattr(core, "get_output_embeddings"):
        return "not a transformers model"
    if hasattr(config, "loss_chunk_tokens"):
        return "the model chunks its own loss (MoE-GPT: config.loss_chunk_tokens)"
    head = core.get_output_embeddings()
    if type(head) is not nn.Linear:
        return f"its output head is a {type(head).__name__}, not a plain nn.Linear"
    if head.bias is not None:
        return "its output head has a bias"
    for field in _LOGIT_TRANSFORMS:
        value = getattr(config, field, None)
        if value not in (None, 1, 1.0):
            return f"{config.model_type} transforms its logits ({field}={value})"
    if "logits_to_keep" not in inspect.signature(core.forward).parameters:
        return f"{type(core).__name__}.forward takes no logits_to_keep"
    return None


def chunked_causal_lm_loss(model: nn.Module, inputs: dict, chunk_tokens: int,
                           num_items_in_batch: torch.Tensor | int | None = None,
                           autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
    """The model's output for `inputs` (with `labels`, or `shift_labels` already shifted) with `loss` equal to the
    family's own causal-LM loss, computed `chunk_tokens` tokens at a time; `logits` holds the last position only.

    `num_items_in_batch`: divide the summed token losses by it (transformers' gradient-accumulation-exact loss)
    instead of taking the mean over this batch's labelled tokens. `autocast`: the autocast the model's forward runs
    under when it is not the caller's (accelerate's prepared models: `accelerator.autocast`), so that the head's GEMMs
    run in the same dtype as the family's own head. Raises `UserError` where `why_not_chunked(model)` gives a reason,
    or where the projected position shows that the family's logits are not `lm_head(hidden)`.
    """
    reason = why_not_chunked(model)
    if reason is not None:
        raise UserError(f"chunked LM loss: {reason}; train with loss_chunk_tokens=0 (the stock loss)")
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens <= 0:
        raise UserError(f"chunked LM loss: chunk_tokens must be a positive integer, got {chunk_tokens!r}")
    return _chunked_loss(model, inputs, chunk_tokens, num_items_in_batch, autocast, check_head=True)


def _chunked_loss(model: nn.Module, inputs: dict, chunk_tokens: int, num_items_in_batch, autocast,
                  check_head: bool):
    """`chunked_causal_lm_loss` once the model and chunk size are known to qualify."""
    inputs = dict(inputs)
    labels, shift_labels = inputs.pop("labels", None), inputs.pop("shift_labels", None)
    inputs.pop("num_items_in_batch", None)
    inputs.pop("return_dict", None)  # the outputs are read by name
    if labels is None and shift_labels is None:
        raise UserError("chunked LM loss: the inputs have no labels")
    want_hidden = bool(inputs.pop("output_hidden_states", False))
    core = _core_model(model)
    out = model(**inputs, logits_to_keep=1, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    head = core.get_output_embeddings()
    with autocast():
        if check_head:
            _check_head(core, head, hidden, out.logits)
        if shift_labels is None:
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        loss = chunked_lm_loss(hidden.reshape(-1, hidden.shape[-1]), head.weight,
                               targets.reshape(-1).to(hidden.device), chunk_tokens, divisor=num_items_in_batch)
    aux = getattr(out, "aux_loss", None)
    if aux is not None:
        loss = loss + _aux_coefficient(core) * aux.to(loss.device)
    fields = {k: v for k, v in out.items() if k != "loss"}
    if not want_hidden:
        fields.pop("hidden_states", None)
    return type(out)(loss=loss, **fields)


def _check_head(core: nn.Module, head: nn.Linear, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """The family's logits of the projected (last) position must be `head(hidden)` of it, up to the GEMM's rounding."""
    if logits is None or logits.shape[:2] != (hidden.shape[0], 1) or hidden.dim() != 3:
        raise UserError(f"chunked LM loss: {type(core).__name__} did not return one position's logits and the "
                        "(batch, tokens, hidden) final hidden states; train with loss_chunk_tokens=0")
    with torch.no_grad():
        theirs = logits.float()
        err, scale = torch.stack([(head(hidden[:, -1:]).float() - theirs).abs().max(), theirs.abs().max()]).tolist()
    # Relative 1e-2: above a bf16 GEMM's rounding (the model's head may run in bf16 and ours in fp32 or the reverse),
    # far below any logit scale a family applies (Granite divides by 4-8).
    if not err <= 1e-2 * scale + 1e-6:
        raise UserError(f"chunked LM loss: {core.config.model_type}'s logits are not lm_head(last hidden state) "
                        f"(max difference {err:.3g} at logits of size {scale:.3g}): the family transforms them; "
                        "train with loss_chunk_tokens=0 (the stock loss)")


def _aux_coefficient(core: nn.Module) -> float:
    for owner in (core, core.config):
        coef = getattr(owner, "router_aux_loss_coef", None)
        if coef is not None:
            return coef
    raise UserError(f"chunked LM loss: {type(core).__name__} returned a load-balancing loss but has no "
                    "router_aux_loss_coef; train with loss_chunk_tokens=0 (the stock loss)")


class ChunkedLossTrainer(OffloadTrainer):
    """`OffloadTrainer` (a `transformers.Trainer` that saves offloaded experts one at a time) whose training loss
    for causal LMs is taken `loss_chunk_tokens` tokens at a time (`chunked_causal_lm_loss`): the same loss,
    gradients and logged figures, without the (tokens, vocabulary) logits. Evaluation, models that are not causal
    LMs, label smoothing and `compute_loss_func` keep the Trainer's own path, as do families whose head is more than
    a linear map (`why_not_chunked`, logged once).

        trainer = ChunkedLossTrainer(model=model, args=args, train_dataset=ds, loss_chunk_tokens=1024)
    """

    def __init__(self, *args, loss_chunk_tokens: int = 1024, **kwargs):
        if not isinstance(loss_chunk_tokens, int) or isinstance(loss_chunk_tokens, bool) or loss_chunk_tokens < 0:
            raise UserError(f"loss_chunk_tokens must be an integer >= 0 (0: the stock loss), got {loss_chunk_tokens!r}")
        super().__init__(*args, **kwargs)
        self.loss_chunk_tokens = loss_chunk_tokens
        self._why_not: str | None = None  # checked once: why_not_chunked
        self._head_checked = False  # _check_head on the first chunked step only

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._chunks(model, inputs):
            model = _ChunkedLossCall(model, self.loss_chunk_tokens, self.accelerator.autocast,
                                     check_head=not self._head_checked)
            self._head_checked = True
        # The Trainer's own path from here: num_items_in_batch, the scaling across processes, return_outputs.
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def lm_loss_path(self) -> str:
        """How the training loss is taken, for run records and model cards."""
        own = getattr(getattr(_core_model(self.model), "config", None), "loss_chunk_tokens", None)
        if own is not None:  # MoE-GPT
            return f"LM loss chunked, {own} tokens at a time" if own else "LM loss from the full logits"
        if not self.loss_chunk_tokens:
            return "LM loss from the full logits (loss_chunk_tokens=0)"
        reason = why_not_chunked(self.model)
        if reason is None:
            return f"LM loss chunked, {self.loss_chunk_tokens} tokens at a time"
        return f"LM loss from the full logits ({reason})"

    def _chunks(self, model: nn.Module, inputs: dict) -> bool:
        if not (self.loss_chunk_tokens and model.training and ("labels" in inputs or "shift_labels" in inputs)
                and self.label_smoother is None and self.compute_loss_func is None):
            return False
        if self._why_not is None:
            self._why_not = why_not_chunked(model) or ""
            if self._why_not:
                logger.info("loss_chunk_tokens=%d not used: %s", self.loss_chunk_tokens, self._why_not)
        return not self._why_not


class _ChunkedLossCall:
    """What `Trainer.compute_loss` calls as the model: the model, with the loss taken chunk by chunk."""

    def __init__(self, model: nn.Module, chunk_tokens: int, autocast, check_head: bool):
        self.model, self.chunk_tokens, self.autocast, self.check_head = model, chunk_tokens, autocast, check_head

    def __call__(self, **inputs):
        # The trainer checked the model (why_not_chunked) and the chunk size once already.
        return _chunked_loss(self.model, inputs, self.chunk_tokens, inputs.get("num_items_in_batch"), self.autocast,
                             check_head=self.check_head)


__all__ = ["ChunkedLossTrainer", "chunked_causal_lm_loss", "why_not_chunked"]
