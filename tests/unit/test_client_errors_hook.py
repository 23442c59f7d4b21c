"""The vLLM patch for client-visible causes, against a faked hook: present (patched once), absent (a
later vLLM moved it: a warning, nothing breaks), already patched (not wrapped twice)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from kvconnectors.tiered import client_errors

HOOK_MODULE = "kvc_fake_vllm_serving"


class FakeGenerationError(Exception):
    pass


def _fake_hook() -> types.ModuleType:
    """A stand-in for vllm/entrypoints/generate/base/serving.py with vLLM's behaviour."""
    mod = types.ModuleType(HOOK_MODULE)

    class Serving:
        def _raise_if_error(self, finish_reason, request_id):  # noqa: ANN001 - vLLM's signature
            if finish_reason == "error":
                raise FakeGenerationError("Internal server error")

    mod.Serving, mod.GenerationError = Serving, FakeGenerationError
    return mod


@pytest.fixture
def hook(monkeypatch):
    mod = _fake_hook()
    monkeypatch.setitem(sys.modules, HOOK_MODULE, mod)
    monkeypatch.setattr(client_errors, "HOOK", client_errors.Hook(HOOK_MODULE, "Serving", "_raise_if_error",
                                                                  HOOK_MODULE, "GenerationError"))
    return mod


def test_present_the_hook_is_patched_and_names_the_cause(hook) -> None:
    """Seen to fail: with the wrapper raising vLLM's error unchanged, the message read
    "Internal server error"."""
    original = hook.Serving._raise_if_error
    assert client_errors.install()
    assert hook.Serving._raise_if_error is not original
    assert hook.Serving._raise_if_error.__wrapped__ is original
    client_errors.remember({"cmpl-fake-0-1": ["timeout", "no answer in 30 s"]})
    with pytest.raises(FakeGenerationError, match=r"^KV transfer failed \[timeout\]: no answer in 30 s$"):
        hook.Serving()._raise_if_error("error", "cmpl-fake")
    with pytest.raises(FakeGenerationError, match="^Internal server error$"):  # taken once
        hook.Serving()._raise_if_error("error", "cmpl-fake")
    hook.Serving()._raise_if_error("stop", "cmpl-fake")


def test_already_patched_is_not_wrapped_twice(hook) -> None:
    """Also across a second copy of the module state (the mark is on the hook, not in a module flag).

    Seen to fail: without the mark check, the second install wrapped the first wrapper
    (`__wrapped__` was the first wrapper, not vLLM's method)."""
    original = hook.Serving._raise_if_error
    assert client_errors.install()
    first = hook.Serving._raise_if_error
    assert client_errors.install()
    assert hook.Serving._raise_if_error is first and first.__wrapped__ is original


@pytest.mark.parametrize("missing", ["module", "method"])
def test_absent_a_warning_and_nothing_changes(hook, monkeypatch, caplog, missing) -> None:
    """A vLLM that moved the hook: install() says so and returns False; vLLM's own method stays.

    Seen to fail: with the `original is None` check removed, install() returned True (it wrapped
    a method that is not there)."""
    if missing == "module":
        monkeypatch.delitem(sys.modules, HOOK_MODULE)  # and nothing of that name can be imported
    else:
        monkeypatch.delattr(hook.Serving, "_raise_if_error")
    with caplog.at_level(logging.WARNING, logger=client_errors.__name__):
        assert client_errors.install() is False
    warned = [r.getMessage() for r in caplog.records if r.name == client_errors.__name__]
    assert len(warned) == 1 and "will not reach HTTP clients" in warned[0] and HOOK_MODULE in warned[0], warned
    assert not hasattr(hook.Serving, "_raise_if_error") or not hasattr(hook.Serving._raise_if_error, "__wrapped__")
