"""`STAGE_SECTIONS` (which recipe fields rerun which workflow stage) against the recipe schema.

The digests of `rl_core.launch.workflow` look values up by dotted path in the recipe's dump
and silently find nothing for a misspelt or renamed field: that stage would then never rerun
when the field changes. These tests walk the pydantic models of the schema instead.
"""

from __future__ import annotations

import types
import typing

import pytest
from pydantic import BaseModel

from rl_core.config import RecipeConfig
from rl_core.launch.workflow import NO_STAGE, NOT_RESULTS, STAGE_SECTIONS, WorkflowPlan


def _models(annotation) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation can hold (unions, Optional, Annotated, containers)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is None:
        return []
    out: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        out += _models(arg)
    return out


def schema_path(path: str) -> bool:
    """Whether dotted `path` names a field of the recipe schema (in any variant of a union section)."""
    models: list[type[BaseModel]] = [RecipeConfig]
    for name in path.split("."):
        fields = [m.model_fields[name] for m in models if name in m.model_fields]
        if not fields:
            return False
        models = [m for f in fields for m in _models(f.annotation)]
    return True


def test_schema_path_walks_the_models():
    assert schema_path("grpo.seed") and schema_path("env.type") and schema_path("async_rl.sampler.type")
    assert schema_path("trainer.weight_sync.type") and schema_path("model.tiny.architecture")
    assert not schema_path("grpo.sead") and not schema_path("nosuch") and not schema_path("grpo.seed.x")


@pytest.mark.parametrize("stage", sorted(STAGE_SECTIONS))
def test_stage_sections_name_real_schema_fields(stage):
    keep = STAGE_SECTIONS[stage]
    for path in keep or ():
        assert schema_path(path), f"STAGE_SECTIONS[{stage!r}] names {path!r}, which is not a recipe field"


def test_sections_without_results_are_top_level_fields():
    top = set(RecipeConfig.model_fields)
    assert set(NOT_RESULTS) <= top, set(NOT_RESULTS) - top
    assert set(NO_STAGE) <= set(NOT_RESULTS)


def test_every_top_level_section_reruns_some_stage_or_is_documented_as_none():
    covered = set(NO_STAGE)
    for keep in STAGE_SECTIONS.values():
        if keep is None:
            covered |= set(RecipeConfig.model_fields) - set(NOT_RESULTS)
        else:
            covered |= {path.split(".")[0] for path in keep}
    missing = set(RecipeConfig.model_fields) - covered
    assert not missing, f"recipe sections no stage depends on (add them to a stage or to NO_STAGE): {missing}"
    # a section that reruns no stage is not also claimed by one
    claimed = {p.split(".")[0] for keep in STAGE_SECTIONS.values() if keep for p in keep}
    assert not claimed & set(NO_STAGE)


def test_stage_digests_follow_a_change_of_each_listed_field():
    """Changing any listed field (to a non-default value) changes that stage's digest."""
    base = RecipeConfig()
    plan = WorkflowPlan(run="r", recipe="r.yaml", overrides=[], launcher="local", cfg=base, epochs=[],
                        recipe_files=[])
    changed = {"grpo.seed": 7, "generation.max_tokens": 9, "data.val_file": "other.jsonl", "model.dtype": "bfloat16"}
    for stage, keep in STAGE_SECTIONS.items():
        for path, value in changed.items():
            if keep is not None and path not in keep:
                continue
            section, field = path.split(".")
            cfg = base.model_copy(update={section: getattr(base, section).model_copy(update={field: value})})
            other = WorkflowPlan(**{**plan.__dict__, "cfg": cfg})
            assert other.digest(stage) != plan.digest(stage), (stage, path)
