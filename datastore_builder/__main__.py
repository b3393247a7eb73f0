"""``python -m datastore_builder``: kept for existing scripts; the code is ``bertknn.builder.__main__``."""

import sys

from bertknn.builder.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
