"""Expert counters: the totals read per request and per scrape are the snapshot's."""

from moestream.stats.counters import ExpertStats, delta


def test_totals_are_the_snapshots_totals():
    stats = ExpertStats(num_layers=3, num_experts=4)
    stats.at(0, "q4").lookups += 5
    stats.at(2, "q4").hits += 2
    stats.at(1, "q2").misses += 1
    stats.read(0, "q4", "host", nbytes=100, seconds=0.5, records=2)
    stats.read(2, "q2", "disk", nbytes=30)
    before = stats.totals()
    assert before == stats.snapshot()["totals"]
    assert before["q4"]["lookups"] == 5 and before["q4"]["reads"]["host"] == {"records": 2, "bytes": 100}
    stats.read(1, "q4", "host", nbytes=50)
    assert delta(before, stats.totals())["q4"]["reads"]["host"] == {"records": 1, "bytes": 50}
