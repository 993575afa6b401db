"""bench/node_seeds.py: whether the pool is above, below or level with routing over seeds."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from node_seeds import interval, main, verdict


def test_an_interval_that_holds_one_is_a_tie_and_one_clear_of_it_a_win_or_a_loss():
    mean, low, high = interval([0.95, 1.04, 0.99, 1.02])
    assert low < 1 < high and verdict(low, high, True, None) == "tie"
    assert pytest.approx(mean) == (0.95 * 1.04 * 0.99 * 1.02) ** 0.25
    assert verdict(*interval([1.10, 1.12, 1.08, 1.11])[1:], True, None) == "above"
    assert verdict(*interval([0.90, 0.93, 0.91, 0.92])[1:], True, None) == "below"


def test_a_cell_that_does_not_vary_with_the_seed_is_judged_against_its_noise_floor():
    mean, low, high = interval([0.998] * 4)  # the trace: one placement, whatever the seed
    assert mean == low == high == pytest.approx(0.998)
    assert verdict(low, high, False, (1.001, 1.003)) == "tie (noise floor)", "within 0.3% either way"
    assert verdict(low, high, False, (1.000, 1.001)) == "below"
    assert verdict(low, high, False, None) == "below"


def test_the_command_reads_per_seed_results_and_writes_each_cells_verdict(tmp_path, monkeypatch, capsys):
    def row(seed, ratio):
        return {"cost_model": "a100-llama2-7b", "workload": "trace", "load": "light", "seed": seed,
                "routing": {"throughput": 100.0}, "pool-write": {"throughput_vs_routing": ratio}}

    (tmp_path / "a.json").write_text(json.dumps({"rows": [row(0, 1.1), row(1, 1.2)]}))
    (tmp_path / "b.json").write_text(json.dumps({"seed": 2, "rows": [{**row(2, 1.15), "seed": None}]}))
    out = tmp_path / "seeds.json"
    monkeypatch.setattr(sys, "argv", ["node_seeds.py", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                                      "--out", str(out)])
    main()
    (cell,) = json.loads(out.read_text())["rows"]
    assert cell["seeds"] == [0, 1, 2] and cell["pool-write"]["verdict"] == "above"
    assert "pool-write: above 1" in capsys.readouterr().out
