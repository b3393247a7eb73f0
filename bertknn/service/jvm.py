"""Options for the JVM that Lucene (BM25) runs in: set once, before the first retriever opens."""

from __future__ import annotations

from collections.abc import Sequence


def reduce_jvm_signals() -> None:
    """Start the JVM with -Xrs so that it leaves SIGTERM/SIGINT to Python (graceful shutdown needs them)."""
    try:
        import jnius_config
    except ImportError:
        return
    if not jnius_config.vm_running and "-Xrs" not in jnius_config.get_options():
        jnius_config.add_options("-Xrs")


def configure_jvm(options: Sequence[str]) -> bool:
    """Add options for the JVM that Lucene runs in; False (nothing done) when it is already running.

    Must run before the first retriever opens: the JVM starts once per process and keeps its options.
    """
    try:
        import jnius_config
    except ImportError:
        return False
    if jnius_config.vm_running:
        return False
    have = set(jnius_config.get_options())
    jnius_config.add_options(*[o for o in options if o not in have])
    return True
