"""`python -m kvconnectors.integration.proxy`: the proxy's own entry point (what `serve-pd --proxy
subprocess` and PDCluster's subprocess proxy run)."""

import sys

from .cli import main

sys.exit(main())
