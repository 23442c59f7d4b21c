"""Loads the conformance plugin's hooks for `pytest --pyargs kvconnectors.conformance`."""

from kvconnectors.conformance.plugin import (pytest_collection_modifyitems, pytest_configure,  # noqa: F401
                                             pytest_runtest_logreport, pytest_sessionfinish)
