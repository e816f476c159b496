"""The step metrics' named reward components (`reward/<name>`): the same names in the same order
as the union of every group's names gave (the twelfth round of issue 18 item 3 builds one set
where the groups share their keys; the metrics' key order follows the set's)."""

import random

from rl_core.columns import group_columns
from rl_core.controller.step_metrics import step_metrics
from rl_core.types import scored_sample
from tests.unit.test_controller_passes import _pump, _trained


def _group(names, k=2):
    return [scored_sample([1, 2], [3, 4], [-0.5, -0.5], None, "stop", 0, 0, None, "t", 1.0,
                          {n: float(i) for i, n in enumerate(names)}, False, {}, 0.1, 0.01, {"local": 2}, 1)
            for _ in range(k)]


def _names(groups):
    m = step_metrics(_pump(), 0, _trained(groups), {}, {}, 0.0, 0.0)
    return [k for k in m if k.startswith("reward/")]


def _reference(groups):
    return [f"reward/{n}" for n in set().union(*(group_columns(g).component_columns.names() for g in groups))]


def test_shared_names_come_in_the_union_order():
    r = random.Random(0)
    for _ in range(300):
        names = list(dict.fromkeys(f"k{r.randrange(10**6)}" for _ in range(r.randint(0, 30))))
        groups = [_group(names) for _ in range(r.choice([1, 2, 3, 9, 40]))]
        assert _names(groups) == _reference(groups)


def test_groups_of_other_names_or_orders_give_the_union_order():
    mixed = [_group(["x", "y"]), _group(["y", "x"]), _group(["z"]), _group([])]
    uneven = [_group(["x"]), _group(["x"])[:1] + _group(["x", "w"])[:1]]  # a group whose samples differ
    for groups in (mixed, uneven, [_group([])] * 3):
        assert _names(groups) == _reference(groups)
