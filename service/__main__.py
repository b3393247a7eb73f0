"""``python -m service``: kept for existing scripts; the code is ``bertknn.service.__main__``."""

import sys

from bertknn.service.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
