"""benchmarks.kv_release's own parts: the prompts it sends and the metrics it reads from a real scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from benchmarks.kv_release import _metric, prompt


def test_prompts_are_distinct_from_their_first_words() -> None:
    """Each request's prompt differs from the others' in its first words (its number), so no two share a cached
    prefix of a whole block (16 tokens), and has the words asked for."""
    ps = [prompt(i, 200) for i in range(64)]
    assert len({p[:12] for p in ps}) == 64
    head = "Count how many times 'river' appears in this list: "
    assert all(len(p.split(head)[1].split()) == 200 for p in ps)


def test_metric_sums_the_engines_samples_of_a_prometheus_scrape() -> None:
    reg = CollectorRegistry()
    written = Gauge("parrot:kv_cache_written_pages", "w", ["engine"], registry=reg)
    released = Counter("parrot:kv_cache_released_pages", "r", ["engine"], registry=reg)
    written.labels("engine-0").set(1504)
    written.labels("engine-1").set(16)
    released.labels("engine-0").inc(64)
    text = generate_latest(reg).decode()
    assert _metric(text, "parrot:kv_cache_written_pages") == 1520
    assert _metric(text, "parrot:kv_cache_released_pages_total") == 64
    assert _metric(text, "parrot:kv_cache_released_pages_created") > 0  # a family's other series are apart
    assert _metric(text, "parrot:no_such_metric") == 0
