"""kvledger's compiled core (``kvledger._core``, built from rust/), or one clear sentence
where this install lacks it."""

from __future__ import annotations


class MissingCoreError(ImportError):
    """This install has no compiled core (kvledger._core): it was built without a Rust
    toolchain."""


def missing_core(what: str) -> MissingCoreError:
    """The error to raise where ``what`` (e.g. "the router index") cannot import the core."""
    return MissingCoreError(
        f"{what} needs kvledger's compiled core (kvledger._core), which this install lacks: "
        "install kvledger again with a Rust toolchain (cargo) on the PATH (`make venv` "
        "does), or from a wheel built with one"
    )
