"""The suite against one backend: TieredConnector unless KVCONNECTORS_CONFORMANCE_BACKEND names
another (a built-in name such as "ExampleConnector", or "module:Class" for a ConnectorBackend
subclass or a KVConnectorBase_V1 subclass).

    pytest --pyargs kvconnectors.conformance -m "not engine"
"""

from __future__ import annotations

import os

from kvconnectors.conformance.backends import load_backend
from kvconnectors.conformance.suites import ALL_AREAS

ENV_BACKEND = "KVCONNECTORS_CONFORMANCE_BACKEND"
_backend = load_backend(os.environ.get(ENV_BACKEND) or "TieredConnector")


class TestConformance(_backend, *ALL_AREAS):  # type: ignore[misc,valid-type]
    __doc__ = f"Every conformance area against {_backend.name}."
