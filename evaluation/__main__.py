"""``python -m evaluation``: kept for existing scripts; the code is ``bertknn.evaluation.__main__``."""

import sys

from bertknn.evaluation.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
