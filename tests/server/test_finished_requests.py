"""FinishedRequests: the bounded record of finished requests behind GET /v1/requests/{id}."""

from __future__ import annotations

import pytest

from cosystream.server.state import FinishedRequests, ServerSettings


def test_the_oldest_record_goes_first_and_a_re_added_id_counts_as_new() -> None:
    kept = FinishedRequests(capacity=2)
    kept.add("a", 1)
    kept.add("b", 2)
    kept.add("a", 3)  # the same id again (a client-chosen id reused): newest now
    kept.add("c", 4)
    assert len(kept) == 2
    assert kept.get("b") is None and kept.get("a") == 3 and kept.get("c") == 4


def test_keeping_no_requests_is_refused() -> None:
    with pytest.raises(ValueError, match="requests_kept"):
        ServerSettings(requests_kept=0)
