"""The chunked causal-LM loss for every transformers MoE family (hf_moe_offload/families/lm_loss.py; issue 14, item 5).

Against the family's own `model(input_ids, labels=...).loss` on fresh random tokens (some labels ignored, the
load-balancing term on where the family has one): fp32 loss within 2e-6 and every parameter gradient within 2e-6
(only the summation order of the cross-entropy differs; measured <= 5e-7). Through the Trainer: `ChunkedLossTrainer`
against the stock `Trainer` (gradient accumulation 2, so `num_items_in_batch` is used), offloaded or not, logged
losses within 1e-6 relative and weights within lr / 10 after 3 steps (Adam eps 1e-6, as tests/test_families.py);
under bf16 mixed precision losses within 2e-5 relative and weights within 1e-3 after 2 steps (see that test).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import hf_moe_offload  # noqa: F401
from hf_moe_offload import ExpertOptimizerCallback, OffloadConfig, enable_expert_offload
from hf_moe_offload.families import lm_loss
from hf_moe_offload.errors import UserError
from hf_moe_offload.families.lm_loss import ChunkedLossTrainer, chunked_causal_lm_loss, why_not_chunked
from hf_moe_offload.families.routing import keep_load_balancing_loss

from moe_families import VOCAB, Unshrinkable, experts_families, tiny_config, tiny_model
from numerics import BOTH_KERNELS, assert_within_adam_drift, kernels

TOL = dict(atol=2e-6, rtol=0)
CHUNK = 5  # 2 x 11 tokens -> 20 predicted: chunks of 5 (and one short chunk with 3 x 11)


def family_model(family: str, seed: int = 0):
    try:
        tiny_config(family)
    except Unshrinkable as err:
        pytest.skip(str(err))
    model = tiny_model(family, seed=seed)
    if getattr(model.config, "router_aux_loss_coef", None) is not None:
        model.config.router_aux_loss_coef = 0.01  # a term large enough to matter in the comparison
    keep_load_balancing_loss(model)
    return model


def random_batch(shape=(2, 11), seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, shape, generator=g)
    labels = x.clone()
    labels[0, 2:5] = -100  # ignored positions
    return x, labels


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("family", experts_families())
def test_every_family_chunked_loss_equals_its_own(family):
    """Same loss and gradients as the family's own head and loss, load-balancing term included; families whose
    logits are more than lm_head(hidden) are named by `why_not_chunked` and keep their own loss."""
    model = family_model(family)
    reason = why_not_chunked(model)
    if reason is not None:
        # A logit scale or cap, or a head of its own (ergo's computes its logits in fp32 under autocast).
        assert "transforms its logits" in reason or "not a plain nn.Linear" in reason, reason
        with pytest.raises(UserError, match="loss_chunk_tokens=0"):
            chunked_causal_lm_loss(model, {"input_ids": random_batch()[0], "labels": random_batch()[1]}, CHUNK)
        return
    x, labels = random_batch()
    own = model(input_ids=x, labels=labels)
    own.loss.backward()
    own_grads = grads(model)
    out = chunked_causal_lm_loss(model, {"input_ids": x, "labels": labels}, CHUNK)
    out.loss.backward()
    ours = grads(model)
    torch.testing.assert_close(out.loss, own.loss, **TOL)
    if getattr(own, "aux_loss", None) is not None:
        torch.testing.assert_close(out.aux_loss, own.aux_loss, rtol=0, atol=1e-7)
    assert ours.keys() == own_grads.keys()
    for name, g in own_grads.items():
        torch.testing.assert_close(ours[name], g, **TOL, msg=lambda m: f"{family} {name}: {m}")
    assert out.logits.shape == (2, 1, VOCAB)  # the checked last position only
    assert out.hidden_states is None  # not asked for


def test_covers_the_core_families():
    chunked = [f for f in ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3", "glm4_moe", "granitemoe")
               if why_not_chunked(family_model(f)) is None]
    assert len(chunked) == 7, chunked


def _saved_shapes(fn) -> list[tuple[int, ...]]:
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return shapes


def test_no_tokens_by_vocabulary_tensor_is_kept_for_backward():
    """The point of it: the stock head saves (tokens, vocab) logits for backward; the chunked loss saves no
    vocabulary-wide tensor larger than the head's weight or the checked last position's logits."""
    model = family_model("qwen3_moe")
    x, labels = random_batch((4, 16))  # 64 tokens: more than the hidden size, so logits outsize the weight
    stock = _saved_shapes(lambda: model(input_ids=x, labels=labels).loss.backward())
    chunked = _saved_shapes(lambda: chunked_causal_lm_loss(model, {"input_ids": x, "labels": labels}, CHUNK)
                            .loss.backward())
    allowed = max(model.lm_head.weight.numel(), x.shape[0] * VOCAB)
    assert max(math.prod(s) for s in stock if VOCAB in s) >= x.numel() * VOCAB > allowed
    assert max(math.prod(s) for s in chunked if VOCAB in s) <= allowed


def test_num_items_in_batch_and_shift_labels_as_transformers():
    """`num_items_in_batch` divides the summed loss (gradient accumulation); `shift_labels` (already shifted)
    replaces `labels`; all labels ignored gives NaN as the stock mean does, 0 with num_items_in_batch."""
    model = family_model("mixtral")
    x, labels = random_batch()
    own = model(input_ids=x, labels=labels, num_items_in_batch=torch.tensor(37)).loss
    ours = chunked_causal_lm_loss(model, {"input_ids": x, "labels": labels}, CHUNK, num_items_in_batch=torch.tensor(37))
    torch.testing.assert_close(ours.loss, own, **TOL)
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    ours = chunked_causal_lm_loss(model, {"input_ids": x, "shift_labels": shifted}, CHUNK)
    torch.testing.assert_close(ours.loss, model(input_ids=x, labels=labels).loss, **TOL)
    ignored = torch.full_like(x, -100)
    assert torch.isnan(chunked_causal_lm_loss(model, {"input_ids": x, "labels": ignored}, CHUNK).loss)
    zero = chunked_causal_lm_loss(model, {"input_ids": x, "labels": ignored}, CHUNK, num_items_in_batch=5).loss
    torch.testing.assert_close(zero, model(input_ids=x, labels=ignored, num_items_in_batch=5).loss, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_within_the_gemm_dtype(dtype):
    """CPU autocast runs the head's GEMM in bf16 / fp16 on both paths: the loss within 1e-2 relative, gradients
    within 2e-2 of the largest entry (the two paths round the logit gradient at different points)."""
    model = family_model("qwen3_moe")
    x, labels = random_batch()
    with torch.autocast("cpu", dtype=dtype):
        own = model(input_ids=x, labels=labels).loss
    own.backward()
    own_grads = grads(model)
    with torch.autocast("cpu", dtype=dtype):
        ours = chunked_causal_lm_loss(model, {"input_ids": x, "labels": labels}, CHUNK).loss
    ours.backward()
    our_grads = grads(model)
    assert float(ours.detach()) == pytest.approx(float(own.detach()), rel=1e-2)
    scale = max(float(g.abs().max()) for g in own_grads.values())
    for name, g in own_grads.items():
        assert (our_grads[name] - g).abs().max() <= 2e-2 * scale, name


def test_an_unknown_logit_transform_fails_loudly(monkeypatch):
    """A family whose logits are not lm_head(hidden) and whose config does not say so (here: Cohere's logit scale
    with the config check switched off) is caught by the per-call check of the projected position."""
    model = family_model("cohere2_moe")
    monkeypatch.setattr(lm_loss, "_LOGIT_TRANSFORMS", ())
    assert why_not_chunked(model) is None
    x, labels = random_batch()
    with pytest.raises(UserError, match="logits are not lm_head"):
        chunked_causal_lm_loss(model, {"input_ids": x, "labels": labels}, CHUNK)


def test_trainer_checks_the_head_on_its_first_step(monkeypatch, tmp_path):
    """ChunkedLossTrainer checks the projected position once, on its first chunked step (not on every step): the
    same unknown transform stops training there with the clear error."""
    from transformers import TrainerCallback

    model = family_model("cohere2_moe")
    monkeypatch.setattr(lm_loss, "_LOGIT_TRANSFORMS", ())
    checks = []
    monkeypatch.setattr(lm_loss, "_check_head", lambda *a: checks.append(1))

    class Count(TrainerCallback):
        steps = 0

        def on_step_end(self, *a, **k):
            Count.steps += 1

    _trainer_run(model, ChunkedLossTrainer, tmp_path / "a", steps=2, loss_chunk_tokens=CHUNK, callbacks=[Count()])
    assert Count.steps == 2 and checks == [1]  # 4 chunked micro-steps, one check
    monkeypatch.undo()
    monkeypatch.setattr(lm_loss, "_LOGIT_TRANSFORMS", ())
    with pytest.raises(UserError, match="logits are not lm_head"):
        _trainer_run(family_model("cohere2_moe"), ChunkedLossTrainer, tmp_path / "b", steps=1,
                     loss_chunk_tokens=CHUNK)


def test_bad_arguments_are_clear_errors():
    model = family_model("qwen3_moe")
    x, labels = random_batch()
    for chunk in (0, -3, 2.5, True):
        with pytest.raises(UserError, match="chunk_tokens must be a positive integer"):
            chunked_causal_lm_loss(model, {"input_ids": x, "labels": labels}, chunk)
    with pytest.raises(UserError, match="no labels"):
        chunked_causal_lm_loss(model, {"input_ids": x}, CHUNK)
    with pytest.raises(UserError, match="loss_chunk_tokens must be an integer >= 0"):
        ChunkedLossTrainer(model=model, loss_chunk_tokens=-1)
    moe_gpt = hf_moe_offload.MoEGPTForCausalLM(hf_moe_offload.MoEGPTConfig(
        vocab_size=16, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        num_experts=2))
    assert "chunks its own loss" in why_not_chunked(moe_gpt)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
    assert why_not_chunked(model) == "its output head has a bias"


def _trainer_run(model, trainer_class, tmp_path, bf16=False, steps=3, **kwargs):
    from datasets import Dataset
    from transformers import TrainingArguments

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (4 * steps, 11), generator=g)
    labels = ids.clone()
    labels[::3, :4] = -100  # uneven label counts across micro-batches: num_items_in_batch matters
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=1e-3, adam_epsilon=1e-6, bf16=bf16,
                             use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", max_grad_norm=1.0,
                             seed=0, data_seed=0, lr_scheduler_type="constant")
    trainer = trainer_class(model=model, args=args, train_dataset=data, **kwargs)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("tier", ["device", "disk"])
def test_trainer_equals_the_stock_trainer(tier, tmp_path):
    """ChunkedLossTrainer (on the resident model, or offloaded to the disk tier with the expert-wise optimizer)
    against transformers' Trainer on the resident model: logged losses and weights after 3 accumulated steps."""
    reference = family_model("qwen3_moe", seed=3)
    model = copy.deepcopy(reference)
    callbacks = []
    if tier == "disk":
        enable_expert_offload(model, OffloadConfig(mode="disk", offload_dir=str(tmp_path / "experts"),
                                                   host_cache_experts=4))
        callbacks = [ExpertOptimizerCallback()]
    from transformers import Trainer

    own = _trainer_run(reference, Trainer, tmp_path / "stock")
    ours = _trainer_run(model, ChunkedLossTrainer, tmp_path / "chunked", loss_chunk_tokens=CHUNK, callbacks=callbacks)
    assert ours == pytest.approx(own, rel=1e-6)
    if tier == "disk":
        hf_moe_offload.get_offload_engine(model).synchronize()
    theirs = reference.state_dict()
    for name, w in model.state_dict().items():
        torch.testing.assert_close(w, theirs[name], rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")


@BOTH_KERNELS
def test_trainer_bf16_mixed_precision(onednn, tmp_path):
    """Under the Trainer's bf16 mixed precision (accelerate's autocast around the model's forward) the head's GEMMs
    run in bf16 on both paths, because the chunked loss enters `accelerator.autocast`: logged losses within 2e-5
    relative (measured 3e-7; with the head left in fp32 the second step's loss is 3e-4 off). Weights after 2 steps:
    the chunked head's GEMMs round differently from the whole head's, which Adam turns into up to +-lr per step in
    elements whose gradient is rounding noise (measured 6e-4 here, 1.46e-3 in 1 of 3,072 elements on a CPU with AMX),
    so they are held to what Adam can move an element (tests/numerics.py) and at most 1% of them more than lr/10
    apart (measured 0.009-0.012%, with and without oneDNN; with the head in fp32, 0.7-2.5%)."""
    from transformers import Trainer

    reference = family_model("qwen3_moe", seed=4)
    model = copy.deepcopy(reference)
    with kernels(onednn):
        own = _trainer_run(reference, Trainer, tmp_path / "stock", bf16=True, steps=2)
        ours = _trainer_run(model, ChunkedLossTrainer, tmp_path / "chunked", bf16=True, steps=2,
                            loss_chunk_tokens=CHUNK)
    assert ours == pytest.approx(own, rel=2e-5)
    assert_within_adam_drift(model, reference, lr=1e-3, steps=2)


def test_trainer_keeps_the_stock_loss_where_it_does_not_apply(tmp_path):
    """A family that transforms its logits trains with its own loss under ChunkedLossTrainer, exactly as Trainer."""
    from transformers import Trainer

    reference = family_model("cohere2_moe", seed=5)
    model = copy.deepcopy(reference)
    own = _trainer_run(reference, Trainer, tmp_path / "stock", steps=2)
    ours = _trainer_run(model, ChunkedLossTrainer, tmp_path / "chunked", steps=2, loss_chunk_tokens=CHUNK)
    assert ours == own
    assert all(torch.equal(w, reference.state_dict()[n]) for n, w in model.state_dict().items())
    assert math.isfinite(ours[-1])


def test_through_peft_lora():
    """A PEFT model (LoRA on the attention; the head stays a plain nn.Linear): the chunked loss through the
    PeftModel's forward equals its own loss, LoRA gradients included; LoRA on the head itself keeps the stock loss."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(family_model("qwen3_moe", seed=6),
                                LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    x, labels = random_batch()
    own = peft_model(input_ids=x, labels=labels).loss
    own.backward()
    own_grads = grads(peft_model)
    ours = chunked_causal_lm_loss(peft_model, {"input_ids": x, "labels": labels}, CHUNK).loss
    ours.backward()
    our_grads = grads(peft_model)
    torch.testing.assert_close(ours, own, **TOL)
    assert own_grads.keys() == our_grads.keys() and any("lora_" in n for n in own_grads)
    for name, g in own_grads.items():
        torch.testing.assert_close(our_grads[name], g, **TOL)
    on_head = get_peft_model(family_model("qwen3_moe", seed=6), LoraConfig(r=4, target_modules=["lm_head"]))
    assert "not a plain nn.Linear" in why_not_chunked(on_head)
