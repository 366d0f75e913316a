"""The experts' load as pictures and warnings: the dead-expert warning (hand-made counts), the
TensorBoard tokens-per-expert histograms (bucket e = expert e's count), and `jaxmoe plot`'s layer x
expert heatmap on a synthetic metrics.jsonl (a dead expert is crossed in red)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmoe.train.metrics import DeadExperts, expert_histograms


def test_dead_expert_warning_once_per_streak():
    d = DeadExperts(2)
    rows = [[[1, 0, 3], [2, 2, 0]],  # step 1: zero runs [0,1,0] [0,0,1]
            [[1, 0, 3], [2, 2, 0]],  # step 2: expert 1 of layer 0 and expert 2 of layer 1 reach 2
            [[1, 0, 3], [2, 2, 0]],  # step 3: still dead, already said
            [[1, 5, 3], [2, 2, 4]],  # step 4: both get tokens: re-armed
            [[0, 0, 3], [2, 2, 4]],
            [[0, 0, 3], [2, 2, 4]]]  # step 6: layer 0 experts 0 and 1 again
    got = [d.update(i + 1, r) for i, r in enumerate(rows)]
    assert got[0] is None and got[2] is None and got[3] is None and got[4] is None
    assert "step 2" in got[1] and "MoE layer 0 expert 1; MoE layer 1 expert 2" in got[1]
    assert "MoE layer 0 experts 0, 1" in got[5] and "no tokens for 2 steps" in got[5]
    assert all("\n" not in g for g in got if g)
    assert DeadExperts(0).update(1, [[0, 0]]) is None  # 0: off


def test_tensorboard_histograms_from_counts():
    calls = []

    class Writer:
        def add_histogram_raw(self, tag, **kw):
            calls.append((tag, kw))

    expert_histograms(Writer(), 7, [[3, 0, 1], [0, 0, 0]])
    assert len(calls) == 1  # a layer without tokens is skipped
    tag, kw = calls[0]
    assert tag == "expert_load/moe_layer_0" and kw["global_step"] == 7
    assert kw["bucket_counts"] == [3.0, 0.0, 1.0] and kw["num"] == 4.0
    assert kw["sum"] == 2.0 and kw["sum_squares"] == 4.0 and kw["bucket_limits"] == [0.5, 1.5, 2.5]


def test_plot_writes_the_layer_by_expert_heatmap(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from jaxmoe.train.plot import plot_run

    rng = np.random.default_rng(0)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 21):
            counts = rng.integers(1, 50, (3, 8))
            counts[2, 5] = 0  # never routed to
            c = counts.astype(float)
            f.write(json.dumps({"step": step, "loss": 5.0 - step * 0.1, "ce": 5.0, "lb": 1.0,
                                "expert_counts": counts.tolist(),
                                "expert_load_max_mean": (c.max(-1) / c.mean(-1)).tolist()}) + "\n")
    written = plot_run(tmp_path)
    png = tmp_path / "plots" / "expert_heatmap.png"
    assert png in written
    img = imread(png)
    assert img.shape[0] > 200 and img.shape[1] > 800
    red = (img[..., 0] > 0.9) & (img[..., 1] < 0.2) & (img[..., 2] < 0.2)
    assert red.sum() > 10  # the dead expert's cross
