"""`OffloadTrainer`: the stock `transformers.Trainer`, saving models with offloaded experts expert by expert.

The Trainer saves a model (checkpoints, `save_model`) with `model.save_pretrained(output_dir)`, which takes
`model.state_dict()`: for a model whose experts are offloaded that assembles every expert tensor of every layer in
host memory at once, the whole expert width of the model (more than the host holds when the disk tier was chosen
for that reason). `OffloadTrainer` saves such a model through the package's streaming save instead
(`save_offloaded_pretrained`: one expert at a time, the same transformers checkpoint layout, written atomically), and
a PEFT model's adapters from a state dict that leaves the offloaded experts out (peft keeps only the adapters of it).
Everything else is the stock Trainer's: models without offloaded experts, and FSDP / DeepSpeed saves (they hand
`_save` a gathered state dict), take the Trainer's own path.

Frozen offloaded experts leave stand-in parameters on their modules for peft's LoRA (offload/lora/stand_ins.py);
`OffloadTrainer` keeps them out of DDP (`_set_params_and_buffers_to_ignore_for_model`, DDP's own way to leave
parameters alone), which would otherwise broadcast them at its start as if they held the experts' values.

With `OffloadConfig.dense_optimizer_on_host` (decided by `plan.dense_on_host` where left None), `create_optimizer`
builds `HostDenseAdamW` (optim/dense_host.py) with the Trainer's AdamW settings and parameter groups: the non-expert
parameters' fp32 masters and Adam moments on the host, their weights on the device in bf16 under `bf16=True`.

It is an ordinary subclass, so it combines with other Trainer subclasses by inheritance (`ChunkedLossTrainer` is one;
for TRL: `class MySFTTrainer(OffloadTrainer, SFTTrainer)`). The expert-wise optimizer is still the
`ExpertOptimizerCallback` in `callbacks`.
"""

from __future__ import annotations

import logging
import os

import torch
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

from .offload.api import get_offload_engine
from .offload.plan import dense_on_host_at
from .optim.dense_host import HostDenseAdamW
from .runtime import runtime_for

logger = logging.getLogger(__name__)
from .offload.saving import save_offloaded_pretrained
from .offload.lora.stand_ins import keep_stand_ins_out_of_ddp


class OffloadTrainer(Trainer):
    """`transformers.Trainer` whose saves stream offloaded experts from their store (see the module docstring).

        trainer = OffloadTrainer(model=model, args=args, train_dataset=ds, callbacks=[ExpertOptimizerCallback()])
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        keep_stand_ins_out_of_ddp(self.model)

    def create_optimizer(self, model=None):
        opt_model = self.model if model is None else model
        if self.optimizer is not None or not self._dense_on_host(opt_model):
            return super().create_optimizer(model)
        args = self.args
        if args.fp16:
            raise ValueError("the dense optimizer on the host (OffloadConfig.dense_optimizer_on_host) does not take "
                             "fp16 loss scaling: train in bf16 or fp32")
        if "adamw" not in getattr(args.optim, "value", str(args.optim)):
            raise ValueError(f"the dense optimizer on the host is AdamW; the Trainer asks for optim={args.optim}")
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        self.optimizer = HostDenseAdamW([g for g in groups if g["params"]], lr=args.learning_rate,
                                        betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                        device_dtype=torch.bfloat16 if args.bf16 else None,
                                        max_grad_norm=args.max_grad_norm or None)
        numel = sum(p.numel() for g in groups for p in g["params"])
        logger.info("the dense optimizer on the host: %.1fM parameters' fp32 masters and Adam moments in host memory, "
                    "%s weights and gradients on the device", numel / 1e6, "bf16" if args.bf16 else "fp32")
        return self.optimizer

    def _dense_on_host(self, model) -> bool:
        """`OffloadConfig.dense_optimizer_on_host` of the model's offload engine, decided (`plan.dense_on_host`)."""
        engine = get_offload_engine(self.accelerator.unwrap_model(model, keep_torch_compile=False))
        config = getattr(engine, "config", None)
        if config is None:
            return False
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return dense_on_host_at(config, runtime_for(self.args.device), numel,
                                torch.bfloat16 if self.args.bf16 else torch.float32)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        engine = get_offload_engine(model)
        if state_dict is not None or engine is None or engine.store is None:
            return super()._save(output_dir, state_dict=state_dict)
        if hasattr(model, "get_base_model"):  # PEFT (as hub/cards.py and families/lm_loss.py tell it)
            # peft saves the adapters only: give it the state dict without the experts it would drop anyway.
            with engine.experts_left_out_of_state_dict():
                state_dict = self.model.state_dict()
            return super()._save(output_dir, state_dict=state_dict)
        if not self.args.should_save:
            return None
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        save_offloaded_pretrained(model, output_dir)
        # What the Trainer's `_save` writes beside the model.
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        elif getattr(self.data_collator, "tokenizer", None) is not None:
            self.data_collator.tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        return None


__all__ = ["OffloadTrainer"]
