"""The router's two group kinds, for tests that run on both."""

from __future__ import annotations

import pytest

from kvledger.serving.router import store as store_module
from tests.helpers.pure_router.group import PureGroup

KINDS = ["compiled", "pure"]


def use_group_kind(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the router's stores build groups of ``kind`` ("compiled": the core's, skipped
    where it is not in use; "pure": PureGroup) for the rest of the test."""
    if kind == "pure":
        monkeypatch.setattr(store_module, "Group", PureGroup)
