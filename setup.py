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

# The optional stack is pinned exactly, one set that resolves at once and imports together
# (tests/test_extras.py installs nothing; it imports every extra in one process). Open ranges made
# pip backtrack for 20+ minutes (s3fs wants the newest fsspec, datasets caps it) and let `[eval]`
# after `[hf]` upgrade huggingface-hub past what transformers accepts. Move these together:
# `pip install --dry-run --report` on `.[test]` shows the set pip picks, then pin it here.
HUB = ["huggingface-hub==0.36.2"]  # transformers 4.57 needs <1.0; datasets would take 1.x
HF = ["transformers==4.57.6", "tokenizers==0.22.2", "safetensors==0.8.0", *HUB]
EVAL = ["lm_eval==0.4.13", "datasets==5.0.1", "evaluate==0.4.5", "tqdm>=4.60", *HUB]
S3 = ["s3fs==2026.6.0", "aiobotocore==3.10.0"]  # s3fs pins fsspec (datasets caps it at 2026.6.0)
WANDB = ["wandb==0.31.0"]
RUFF = "ruff==0.8.6"  # the linter and formatter ruff.toml is written for
PLOT = ["matplotlib==3.11.2"]

EXTRAS = {
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "pytest-xdist==3.8.0",  # `pytest -n 2`: files spread over two workers (tests/conftest.py)
        "moto[server]==5.2.5",
        "boto3==1.43.117",  # moto's client; its botocore must fit aiobotocore's range
        "botocore==1.43.117",
        "sentencepiece==0.2.3",
        "tiktoken==0.14.0",
        RUFF,  # tests/meta/test_lint.py: CI holds the code to ruff.toml
        *S3,
        *WANDB,
        *PLOT,
        *EVAL,  # the harness adapter's tests run a real lm_eval evaluation
        *HF,  # CI runs the interop tests
    ],
    # Hugging Face interop (export-hf / import-hf, safetensors): transformers 4.57 has
    # BltForCausalLM and is the release the adapter is tested against (tests/interop).
    "hf": HF,
    "dev": [],  # everything a contributor runs: the test extra (ruff included), added below
    "gpu": ["xformers"],
    "eval": EVAL,
    "s3": S3,
    "wandb": WANDB,
    "plot": PLOT,  # python -m apps.plot
    "progress": ["tqdm>=4.60"],  # progress bars (preprocessing, consolidation) when on a terminal
}
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
