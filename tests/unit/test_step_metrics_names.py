"""`step_metrics._component_names`: the set of named reward components, in the iteration order
the per-group union gave (the step metrics' keys follow it)."""

import random

from rl_core.columns import DictColumns
from rl_core.controller.step_metrics import _component_names


def _reference(groups):
    return list(set().union(*(c.names() for c in groups)))


def test_shared_keys_give_the_union_in_its_order():
    r = random.Random(0)
    for _ in range(2000):
        keys = list(dict.fromkeys(f"k{r.randrange(10**6)}" for _ in range(r.randint(0, 40))))
        groups = [DictColumns.of_columns(2, {k: [0.0, 1.0] for k in keys}) for _ in range(r.choice([1, 2, 3, 9, 100]))]
        assert list(_component_names(groups)) == _reference(groups)


def test_groups_of_other_keys_or_dicts_take_the_union_per_group():
    a = DictColumns.of_columns(1, {"x": [1.0], "y": [2.0]})
    b = DictColumns.of_columns(1, {"y": [1.0], "x": [2.0]})  # the same names in another order
    c = DictColumns([{"z": 1.0}, {"x": 2.0}])  # dicts of different keys
    for groups in ([a, b], [a, c, b], [c], [], [DictColumns.of_columns(1, {})] * 3):
        assert list(_component_names(groups)) == _reference(groups)
