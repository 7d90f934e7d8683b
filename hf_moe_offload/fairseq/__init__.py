"""Fine-tuning fairseq MoE checkpoints: the converter (`hf-moe-offload convert-fairseq`) and a fairseq-id tokenizer.

May import: `data`, `errors`, `models`.
"""

from .convert import (
    FairseqConversionError,
    config_from_fairseq,
    convert_fairseq_checkpoint,
    find_checkpoint_files,
    load_fairseq_file,
)
from .tokenizer import fairseq_gpt2_tokenizer, read_fairseq_dict

__all__ = [
    "convert_fairseq_checkpoint",
    "config_from_fairseq",
    "find_checkpoint_files",
    "load_fairseq_file",
    "FairseqConversionError",
    "fairseq_gpt2_tokenizer",
    "read_fairseq_dict",
]
