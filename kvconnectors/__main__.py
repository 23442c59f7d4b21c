"""`python -m kvconnectors`: the same as the `kvconnectors` command."""

import sys

from kvconnectors.cli import main

if __name__ == "__main__":
    sys.exit(main())
