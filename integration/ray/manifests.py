"""The KubeRay RayService manifests: one template (rayservice.yaml, the CPU variant, whose serveConfigV2
is serve_pd_cpu.yaml) and the GPU overlay (rayservice_gpu_overlay.yaml) applied to it.

    python -m kvconnectors.integration.ray.manifests cpu|gpu > rayservice-VARIANT.yaml
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SERVE_CONFIG = HERE / "serve_pd_cpu.yaml"
TEMPLATE = HERE / "rayservice.yaml"
GPU_OVERLAY = HERE / "rayservice_gpu_overlay.yaml"
LLM_CONFIGS = ("prefill_config", "decode_config")
VARIANTS = ("cpu", "gpu")
OVERLAY_KEYS = {"image", "gpus_per_replica", "llm_config"}


def load(path: Path) -> Any:
    import yaml  # noqa: PLC0415 - PyYAML comes with Ray and vLLM, not with kvconnectors' core

    return yaml.safe_load(path.read_text(encoding="utf-8"))


def dump(data: Any) -> str:
    """YAML text; multi-line strings (serveConfigV2) as literal blocks, as kubectl users write them."""
    import yaml  # noqa: PLC0415

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, default_flow_style=False)


def serve_config(manifest: dict[str, Any]) -> dict[str, Any]:
    """The Serve config inside a RayService (KubeRay keeps it as a YAML string)."""
    import yaml  # noqa: PLC0415

    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def containers(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    spec = manifest["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`base` with `patch` deep-merged in; a None in `patch` deletes the key (neither is modified)."""
    out = dict(base)
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def apply_gpu_overlay(manifest: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """The GPU variant: every container's image, the worker groups' GPUs, and each engine's config
    (its bundle gets the GPUs; `llm_config` is merged into both the prefill and the decode config)."""
    unknown = set(overlay) - OVERLAY_KEYS
    if unknown:
        raise ValueError(f"GPU overlay keys {sorted(unknown)}: unknown; known: {sorted(OVERLAY_KEYS)}")
    gpus = overlay["gpus_per_replica"]
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise ValueError(f"GPU overlay gpus_per_replica={gpus!r}: must be an integer >= 1")
    out = copy.deepcopy(manifest)
    for c in containers(out):
        c["image"] = overlay["image"]
    for group in out["spec"]["rayClusterConfig"].get("workerGroupSpecs", []):
        group.setdefault("rayStartParams", {})["num-gpus"] = str(gpus)
        for c in group["template"]["spec"]["containers"]:
            for kind in ("limits", "requests"):
                c.setdefault("resources", {}).setdefault(kind, {})["nvidia.com/gpu"] = gpus
    serve = serve_config(out)
    for app in serve["applications"]:
        for name in LLM_CONFIGS:
            cfg = merge(app["args"][name], overlay.get("llm_config") or {})
            cfg["placement_group_config"]["bundles"] = [{"CPU": 1, "GPU": gpus}]
            env = cfg.get("runtime_env", {}).get("env_vars")
            if env == {}:  # the overlay removed the last CPU-only variable
                del cfg["runtime_env"]["env_vars"]
            if cfg.get("runtime_env") == {}:
                del cfg["runtime_env"]
            app["args"][name] = cfg
    out["spec"]["serveConfigV2"] = dump(serve)
    return out


def render(variant: str) -> dict[str, Any]:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: must be one of {', '.join(VARIANTS)}")
    manifest = load(TEMPLATE)
    return manifest if variant == "cpu" else apply_gpu_overlay(manifest, load(GPU_OVERLAY))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", choices=VARIANTS)
    print(dump(render(parser.parse_args(argv).variant)), end="")


if __name__ == "__main__":
    main()
