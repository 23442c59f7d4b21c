"""Conformance runs of the wired-in backends: load the suite plugin's hooks (markers, area filter,
results file)."""

from kvconnectors.conformance.plugin import (pytest_collection_modifyitems, pytest_configure,  # noqa: F401
                                             pytest_runtest_logreport, pytest_sessionfinish)
