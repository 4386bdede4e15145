"""The lookup client's failures are its own error type, with nothing listening too."""

from __future__ import annotations

import pytest

from kvledger.client import LookupClient, LookupServiceError
from tests.helpers.procs import free_port


def test_nothing_listening_is_a_lookup_service_error() -> None:
    with (
        LookupClient(f"http://127.0.0.1:{free_port()}", timeout=2) as client,
        pytest.raises(LookupServiceError) as refused,
    ):
        client.match("m", token_ids=[1, 2])
    assert refused.value.status == 0 and "no answer from the lookup service" in str(refused.value)
