"""Packaging for megatron-dualpipe."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="megatron-dualpipe",
    version="0.1.0",
    description="DualPipe and DualPipeV pipeline schedules for Megatron-Core",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_dualpipe", "megatron_dualpipe.*"]),
    include_package_data=True,
    install_requires=[
        "matplotlib>=3.7",
        "PyYAML>=6.0",
    ],
    extras_require={
        # Users bring their own (CUDA) torch; megatron-core needs torch >= 2.6.
        "torch": ["torch>=2.6"],
        # The planner's schedule optimiser: HiGHS (scipy.optimize.milp / linprog), lazily.
        "planner": ["scipy>=1.11"],
        # megatron-core: the releases megatron_dualpipe/megatron/compat/version.py supports (an
        # installed one in the range is kept); psutil: megatron-core's dist_checkpointing
        # writer needs it (checkpoints hang without).
        # pybind11: a Megatron-LM checkout compiles its dataset helpers at the first run.
        "megatron": ["torch>=2.6", "megatron-core>=0.16.1,<0.20", "psutil>=5.9", "pybind11>=2.11"],
        "te": ["transformer-engine[pytorch]>=2.7"],
        # Megatron-Core's HuggingFaceTokenizer / GPT2BPETokenizer (train with tokenizer_type,
        # preprocess) load through transformers; tokenizers is its fast backend. Ranges, so
        # that a container's own releases stay (tested: 4.57.6, 0.22.2, tensorboard 2.21.0).
        "data": ["transformers>=4.40", "tokenizers>=0.19"],
        # tensorboard_dir: torch.utils.tensorboard writes through it.
        "tensorboard": ["tensorboard>=2.14"],
        "test": [
            "torch>=2.6",
            "scipy>=1.11",
            "megatron-core>=0.16.1,<0.20",
            "psutil>=5.9",
            "transformers>=4.40",
            "tokenizers>=0.19",
            "tensorboard>=2.14",
            "pytest>=8",
            "pytest-timeout>=2.3",
            "ruff>=0.6",
            # DeepSeek's reference DualPipe: tests compare our compute order with it.
            "dualpipe==1.0.0",
        ],
    },
    entry_points={"console_scripts": ["megatron-dualpipe=megatron_dualpipe.cli:main"]},
)
