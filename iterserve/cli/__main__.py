"""``python -m iterserve.cli``: the ``iterserve`` command."""

import sys

from iterserve.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
