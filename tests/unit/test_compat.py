import pytest

from kvconnectors.compat import check_vllm_version


@pytest.mark.parametrize("version", ["0.32.0", "0.32.5+cpu", "0.33.0", "0.33.1rc1"])
def test_supported_versions_pass(version: str) -> None:
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.31.9", "0.34.0", "1.0.0"])
def test_unsupported_versions_name_the_range(version: str) -> None:
    with pytest.raises(ImportError, match=r"supports vLLM >=0.32,<0.34.*found vLLM " + version):
        check_vllm_version(version)


def test_installed_vllm_is_supported() -> None:
    assert check_vllm_version().startswith(("0.32", "0.33"))
