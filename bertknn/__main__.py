"""``python -m bertknn``: the same as the ``bert-knn`` command."""

import sys

from bertknn.cli import main

if __name__ == "__main__":
    sys.exit(main())
