"""The step metrics read from single-turn groups held as columns (the thirteenth round of issue
18 item 3): the generation time's mean and max and the turns' mean without a per-sample list, and
`DictColumns.joined` chaining the groups' columns in C, give the metrics the per-sample lists gave
(every value, floats by `repr`), for groups of several sizes and generation times whose sum rounds."""

import random

import numpy as np

from rl_core.columns import DictColumns, GroupResults, GroupSamples, GroupScores
from rl_core.controller.step_metrics import step_metrics
from tests.unit.test_controller_passes import _pump, _trained

TIMED = {"timing/step_s", "throughput/trained_tokens_per_s"}  # read the clock


def _columns(r: random.Random, n: int, gen_s: float) -> GroupSamples:
    ids = [np.arange(r.randint(0, 9), dtype=np.int64) for _ in range(n)]
    lps = [np.full(len(i), -0.25, dtype=np.float32) for i in ids]
    rewards = [float(r.random() < 0.5) for _ in range(n)]
    scores = GroupScores(rewards, {"correct": list(rewards), "digits": [r.random() for _ in range(n)]}, None,
                         {"correct": [x > 0 for x in rewards]})
    results = GroupResults(ids, lps, [r.choice(["stop", "length"]) for _ in range(n)], [0] * n, [1] * n)
    return GroupSamples([1, 2, 3][:r.randint(0, 3)], results, ["t"] * n, scores, gen_s,
                        [r.random() * 1e-3 for _ in range(n)], True)


def _metrics(groups):
    m = step_metrics(_pump(), 0, _trained(groups), {}, {}, 0.0, 0.0)
    return {k: repr(v) for k, v in m.items() if k not in TIMED and k != "_histograms"}, m["_histograms"]


def _groups(seed: int, sizes: list[int], times: list[float]) -> list[GroupSamples]:
    r = random.Random(seed)
    return [_columns(r, n, t) for n, t in zip(sizes, times)]


def test_column_groups_give_the_metrics_of_their_samples():
    r = random.Random(3)
    for trial in range(40):
        sizes = [r.choice([1, 3, 5, 16]) for _ in range(r.randint(1, 30))]
        times = [r.choice([0.1, 1 / 3, 2.675, 1e-9, 7.0]) * r.random() for _ in sizes]
        columns = _groups(trial, sizes, times)  # read as columns (never built)
        records = [list(g) for g in _groups(trial, sizes, times)]  # the same groups as Sample records
        assert not any(g.built for g in columns)
        assert _metrics(columns) == _metrics(records)


def test_joined_columns_equal_the_loop_over_groups():
    shared = [DictColumns.of_columns(3, {"a": [1, 2, 3], "b": [0.5, 0.25, 0.0]}) for _ in range(4)]
    missing = shared[:2] + [DictColumns.of_columns(2, {"b": [9, 8]})] + shared[2:]
    dicts = shared[:1] + [DictColumns([{"a": 7}, {"a": 8, "c": 1}])]
    for groups in (shared, missing, dicts, []):
        for key, default in (("a", None), ("b", 0.0), ("z", 0.0)):
            want = [v for c in groups for v in c.column(key, default)]
            assert DictColumns.joined(groups, key, default) == want
