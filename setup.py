import re

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "(.+)"', open("eprt/__init__.py").read()).group(1)

setup(
    name="eprt",
    version=VERSION,
    description="Expert-parallel runtime for post-training quantization of Mixture-of-Experts LLMs",
    packages=find_packages(include=["eprt", "eprt.*"]),
    package_data={"eprt": ["assets/*.txt"]},
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
        # bench/modelopt.py: the transformers + ModelOpt baseline eprt is measured against
        "bench": ["nvidia-modelopt>=0.47", "transformers>=5.0"],
        # transformers is only an oracle for the tests; eprt never imports it.
        "test": [
            "pytest>=8",
            "pytest-timeout",
            "transformers>=5.0",
            "compressed-tensors>=0.20",
            "triton>=3.0",
            # mlx-lm's kimi_k3 is the outside implementation Kimi-K3's logits are checked against
            "mlx[cpu]>=0.32",
            "mlx-lm>=0.32",
        ],
    },
)
