"""Seeded hostile batches against a collector in this process, on a temporary embedded store
(rankscope/harness/ingest_fuzz.py): every call answered with a status, nothing untrue stored,
memory bounded. benchmarks/fuzz.py sends 10,000 of them and prints the figures."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rankscope.harness import ingest_fuzz

REQUESTS = 2_000
#: what the collector's process may grow by while it answers them (issue 30: within 200 MB of idle)
RSS_GROWTH = 200 * 2**20


@pytest.mark.timeout(120)
def test_fuzzed_batches_are_answered_with_a_status_and_store_nothing_untrue(tmp_path: Path) -> None:
    async def scenario() -> tuple[ingest_fuzz.Outcome, dict[str, int], int]:
        async with ingest_fuzz.in_process(tmp_path / "store") as collector:
            send = ingest_fuzz.InProcess(collector)
            try:
                outcome = await ingest_fuzz.fuzz(send, ingest_fuzz.rss_bytes, REQUESTS, seed=30)
            finally:
                await send.close()
            found = ingest_fuzz.violations(collector.store.query_arrow)
            stored = collector.store.query_arrow("SELECT count() AS n FROM spans").column("n")[0].as_py()
            return outcome, found, stored

    outcome, found, stored = asyncio.run(scenario())
    assert outcome.unknown == [], outcome.unknown[:5]
    assert sum(outcome.codes.values()) == REQUESTS and outcome.codes["UNKNOWN"] == 0
    assert set(outcome.codes) <= {"OK", "INVALID_ARGUMENT", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"}, outcome.codes
    assert outcome.codes["OK"] > REQUESTS // 10 and outcome.codes["INVALID_ARGUMENT"] > REQUESTS // 4, outcome.codes
    assert found == {}
    assert outcome.longest_details < 16_384  # a refusal's message fits the metadata a gRPC client takes
    assert stored > 0
    assert outcome.rss_peak - outcome.rss_idle < RSS_GROWTH, (outcome.rss_idle, outcome.rss_peak)
