"""Container health check: exit 0 when the service answers 200 on /healthz (or the path given), else 1.

Used by the images' HEALTHCHECK and by docker-compose; needs no curl in the image.  The port comes from BERTKNN_PORT,
the same variable the service listens on.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else "/healthz"
    port = os.environ.get("BERTKNN_PORT", "8000")
    url = f"http://127.0.0.1:{port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=4) as resp:  # noqa: S310 (fixed local URL)
            ok = resp.status == 200
    except (urllib.error.URLError, OSError) as exc:
        sys.stderr.write(f"healthcheck: {url}: {exc}\n")
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
