"""laminar_mcore: trajectory-level asynchronous RL post-training on Megatron-Core + SGLang."""

from setuptools import find_packages, setup

packages = find_packages(include=["laminar_mcore", "laminar_mcore.*"])
packages += ["laminar_mcore.kernels", "laminar_mcore.conf"]

setup(
    name="laminar_mcore",
    version="0.1.0",
    description="Laminar-style trajectory-level asynchronous RL with AReaL's decoupled PPO on "
                "Megatron-Core trainers and SGLang rollouts",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=packages,
    # Top-level kernels/ and conf/ are installed as laminar_mcore.kernels / laminar_mcore.conf.
    package_dir={"laminar_mcore.kernels": "kernels", "laminar_mcore.conf": "conf"},
    package_data={"laminar_mcore.conf": ["*.yaml", "*/*.yaml"], "laminar_mcore.bench": ["*.json"],
                  "laminar_mcore.sim": ["*.json"]},
    install_requires=[
        "torch==2.13.0",
        "triton==3.7.1",
        "hydra-core==1.3.8",
        "omegaconf>=2.3,<2.4",
        "transformers==5.23.0",
        "safetensors>=0.8",
        "psutil>=7",
        "numpy>=2",
        "einops>=0.8",
        "aiohttp>=3.14",
        "tensorboard>=2.21",
        "matplotlib>=3.11",
        "tqdm>=4.70",
        "math-verify>=0.9",
        "prometheus-client>=0.26",
        "zstandard>=0.25",
        "xxhash>=4.1",
        # On Python 3.11 install it with: pip install --no-deps --ignore-requires-python
        # megatron-core==0.19.2 (the Makefile does).
        "megatron-core==0.19.2; python_version >= '3.12'",
    ],
    extras_require={
        # GPU clusters. NVIDIA apex is not on PyPI: build it from source if wanted (README).
        "gpu": [
            "sglang==0.5.23",
            "transformer-engine[pytorch]==2.20.2",
            "nvidia-nccl-cu12==2.32.3",
        ],
        # Cross-node relay pulls through Mooncake's transfer engine (RDMA); on CPU machines
        # use mooncake-transfer-engine-non-cuda (TCP). Both need the system's libibverbs1.
        "rdma": ["mooncake-transfer-engine==0.3.13.post1"],
        "dev": ["pytest==9.2.0", "pytest-timeout==2.4.0",
                "mooncake-transfer-engine-non-cuda==0.3.13.post1"],
    },
    entry_points={"console_scripts": ["laminar-launch=laminar_mcore.launch.__main__:cli"]},
)
