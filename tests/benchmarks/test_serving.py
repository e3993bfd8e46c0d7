"""The serving benchmark sizes the server's pool and host tier from the store as the batching benchmark does."""

from benchmarks.serving import tier_options
from moestream.experts.store import open_store


def test_pool_fraction_and_host_tier_become_serve_options(tiny):
    store = tiny.store("qwen3_moe")
    opened = open_store(store)
    total_gb = opened.manifest.geometry.num_records * opened.manifest.layouts["q4"].stride / 1e9
    assert tier_options(store, None, False) == []
    pool, host = tier_options(store, 0.25, True)[1::2]
    assert tier_options(store, 0.25, True)[::2] == ["--pool-gb", "--host-gb"]
    assert abs(float(pool) - total_gb * 0.25) < 1e-3 * total_gb and float(host) > total_gb
