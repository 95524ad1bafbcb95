from setuptools import find_packages, setup

# torch is pinned exactly: a bare or open-ended requirement makes pip fetch a multi-GB CUDA build
# on machines without a local CPU wheel. GPU users install their own torch first (pip keeps it).
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "numpy>=1.26",
    "pydantic>=2.7,<3",
    "omegaconf>=2.3",
    "pyyaml>=6",
    "pyarrow>=15",
    "fsspec>=2024.1",
    "zstandard==0.23.0",  # .jsonl.zst shards (DCLM)
]

EXTRAS = {
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "moto[server]>=5",
        "s3fs[boto3]>=2024.1",
        "wandb>=0.18",
        "sentencepiece>=0.2",
        "tiktoken>=0.7",
        "tqdm>=4.60",
        "matplotlib>=3.8",
        "lm_eval==0.4.*",  # the harness adapter's tests run a real lm_eval evaluation
    ],
    # Hugging Face interop (export-hf / import-hf, safetensors): transformers 4.57 has
    # BltForCausalLM and is the release the adapter is tested against (tests/interop).
    "hf": ["transformers==4.57.*", "safetensors>=0.4", "tokenizers>=0.21"],
    "dev": ["ruff>=0.6"],
    "gpu": ["xformers"],
    "eval": ["lm_eval==0.4.*", "tqdm>=4.60"],
    "s3": ["s3fs[boto3]>=2024.1"],
    "wandb": ["wandb>=0.18"],
    "plot": ["matplotlib>=3.8"],  # python -m apps.plot
    "progress": ["tqdm>=4.60"],  # progress bars (preprocessing, consolidation) when on a terminal
}
EXTRAS["test"] += EXTRAS["hf"]  # CI runs the interop tests
EXTRAS["dev"] += EXTRAS["test"]

setup(
    name="bytelatent",
    version="0.1.0",
    description="PyTorch-native pretraining for byte-level language models (BLT and its entropy model)",
    packages=find_packages(include=["bytelatent", "bytelatent.*", "apps", "apps.*"]),
    package_data={"bytelatent": ["configs/*.yaml"]},
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
