import re

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "(.+)"', open("eprt/__init__.py").read()).group(1)

setup(
    name="eprt",
    version=VERSION,
    description="Expert-parallel runtime for post-training quantization of Mixture-of-Experts LLMs",
    # docs/ ships inside the package as eprt.docs, so that `eprt-docs` reads the pages of any install
    packages=find_packages(include=["eprt", "eprt.*"]) + ["eprt.docs"],
    package_dir={"eprt.docs": "docs"},
    # the built-in calibration text, the PTQ recipes and the tiny models' configs and tokenizer
    package_data={"eprt": ["assets/*.txt", "configs/ptq/*.yaml", "configs/tiny/*.json"], "eprt.docs": ["*.md"]},
    entry_points={
        "console_scripts": [
            "eprt-convert = eprt.commands.convert:main",
            "eprt-ptq = eprt.commands.ptq:main",
            "eprt-export = eprt.commands.export:main",
            "eprt-check = eprt.commands.check:main",
            "eprt-make-tiny = eprt.commands.make_tiny:main",
            "eprt-report = eprt.commands.report:main",
            "eprt-docs = eprt.commands.docs:main",
            "eprt-quantize = eprt.commands.quantize:main",
        ],
    },
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "numpy",
        "pyyaml",
        "tqdm",
    ],
    extras_require={
        # Triton kernels run on CUDA, and under TRITON_INTERPRET=1 in the tests.
        "triton": ["triton>=3.0"],
        "compressed": ["compressed-tensors>=0.20"],
        # the quality page's charts (eprt-report, and the page PTQ writes); without it, tables only
        "report": ["matplotlib>=3.7"],
        # calibration data as tables: .parquet files, datasets saved with save_to_disk
        "data": ["pyarrow>=14", "datasets>=2.14"],
        # bench/modelopt_baseline.py: the transformers + ModelOpt baseline eprt is measured against
        "bench": ["nvidia-modelopt>=0.47", "transformers>=5.0"],
        # transformers is only an oracle for the tests; eprt never imports it.
        "test": [
            "pytest>=8",
            "pytest-timeout",
            # `make test` runs the suite's files on one worker per core (most tests use one)
            "pytest-xdist>=3.5",
            # `make lint`: the formatting and import order .ci/run checks
            "ruff>=0.8",
            "transformers>=5.0",
            "compressed-tensors>=0.20",
            # ModelOpt's own export is the oracle for the quantized export's bytes; its import needs
            # requests, which it does not declare
            "nvidia-modelopt==0.47.0",
            "requests",
            "triton>=3.0",
            # mlx-lm's kimi_k3 is the outside implementation Kimi-K3's logits are checked against
            "mlx[cpu]>=0.32",
            "mlx-lm>=0.32",
            # the quality page's charts and the table data sources are tested, not skipped
            "matplotlib>=3.7",
            "pyarrow>=14",
            "datasets>=2.14",
        ],
    },
)
