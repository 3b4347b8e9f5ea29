"""The scale benchmark's cost model: reduce-scatter bytes, the busiest owner, and calibration."""

import math

import pytest

from benchmarks.scale_model import LINKS, calibrate, part_count, simulate, synthetic_shapes


def test_synthetic_shapes_hold_the_parameters():
    for params in (1000, 1024, 1_000_000, 3_000_001):
        assert sum(math.prod(s) for s in synthetic_shapes(params)) == params


def test_a_peer_pays_about_twice_the_payload_while_every_member_owns_parts():
    model = {"stream_overhead_bytes": 0.0, "dht_a": 5.0, "dht_b": 1.0, "parts": 245}
    for g in (8, 32, 245):
        row = simulate(model, g, 4_000_000, LINKS[0])
        assert row["bytes_sent_per_node_per_round"] == pytest.approx(2 * (g - 1) / g * 4_000_000)
        assert row["bytes_sent_busiest_node_per_round"] == pytest.approx(row["bytes_sent_per_node_per_round"])
    # more members than parts: the owners carry the rest
    big = simulate(model, 4000, 4_000_000, LINKS[0])
    assert big["owners"] == 245 and big["bytes_sent_busiest_node_per_round"] > 10 * 4_000_000
    grouped = simulate(model, 4000, 4_000_000, LINKS[0], max_group_size=32)
    assert grouped["group"] == 4000 / 128 and grouped["bytes_sent_busiest_node_per_round"] < 2 * 4_000_000


def test_calibration_recovers_the_stream_overhead_and_the_dht_fit():
    payload = 4_000_000
    runs = [{"peers": g, "params": 1_000_000, "codec": "none", "payload_bytes": payload, "schemes": ["reduce-scatter"],
             "bytes_sent_per_node_per_round": 2 * (g - 1) / g * payload + 2 * (g - 1) * 300,
             "dht_requests_per_node_per_round": 6 + 2 * math.log2(g)} for g in (8, 16, 32)]
    model = calibrate(runs)
    assert model["stream_overhead_bytes"] == pytest.approx(300)
    assert (model["dht_a"], model["dht_b"]) == (pytest.approx(6), pytest.approx(2))
    assert model["parts"] == part_count(1_000_000)


def test_simulated_groups_are_unequal_as_measured_and_the_largest_sets_the_pace():
    model = {"stream_overhead_bytes": 0.0, "dht_a": 5.0, "dht_b": 1.0, "parts": 245}
    row = simulate(model, 1000, 4_000_000, LINKS[0], max_group_size=32)
    assert row["name"].startswith("simulated: 1000 peers, groups of <= 32") and row["simulated"] is True
    assert row["largest_group"] > row["group"]  # binomial sizes around the mean: the pace is the largest group's
    busiest = 2 * (row["largest_group"] - 1) / row["largest_group"] * 4_000_000
    assert row["bytes_sent_busiest_node_per_round"] == pytest.approx(busiest)
    assert row["bytes_sent_per_node_per_round"] < row["bytes_sent_busiest_node_per_round"]


def test_resimulate_recomputes_a_reports_simulated_rows_from_its_measured_runs(tmp_path):
    import json

    from benchmarks.scale import resimulate

    payload = 4_000_000
    runs = [{"peers": g, "params": 1_000_000, "codec": "none", "payload_bytes": payload, "schemes": ["reduce-scatter"],
             "bytes_sent_per_node_per_round": 2 * (g - 1) / g * payload, "dht_requests_per_node_per_round": 6 + 2 * math.log2(g)}
            for g in (8, 16)]
    path = tmp_path / "scale.json"
    path.write_text(json.dumps({"runs": runs, "simulated": [], "simulated_one_group": [], "meta": {"git_commit": "abc"}}))
    resimulate(path, 32)
    report = json.loads(path.read_text())
    assert report["runs"] == runs and report["meta"] == {"git_commit": "abc"}, "the measurements and their provenance stay"
    assert report["simulated"] and all(row["largest_group"] >= row["group"] for row in report["simulated"])
    assert report["resimulated"]["note"] and "commit" in report["resimulated"]
