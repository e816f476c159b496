"""Every fake in tests/helpers and every real implementation satisfies its protocol.

Two checks per object: `isinstance` against the runtime-checkable protocol (every member
exists), and a member-by-member comparison with the protocol's declaration: each method is
there, async where the protocol's is, and accepts every parameter the protocol names, under
the same name and position, optional where the protocol's is optional (callers pass them
by keyword: `export_weights(on_device=True)`, `finish(advance_version=False)`); any extra
parameter it takes must be optional. Classes that cannot be built here (multi-process
trainers, vLLM backends) get the method check on the class.
"""

from __future__ import annotations

import inspect

import pytest

from rl_core.envs import ENVS, make_env
from rl_core.protocols import (BatchPromptEnvironment, Environment, EpisodeEnvironment, GenerationBackend,
                                TrainerBackend, WeightSync)
from rl_core.samplers import SAMPLERS, make_sampler
from rl_core.samplers.base import Sampler
from rl_core.weights import WEIGHT_SYNCS, make_weight_sync
from tests.helpers import fakes
from tests.helpers.recipes import recipe

PROTOCOLS = (Environment, GenerationBackend, TrainerBackend, WeightSync, Sampler)
# every Fake* class of tests.helpers.fakes -> the protocol it stands in for
FAKES = {"FakeEnv": Environment, "FakeBackend": GenerationBackend, "FakeTrainer": TrainerBackend,
         "FakeWeightSync": WeightSync}
_MISSING = object()
NOT_A_SEAM = {"FakeTokenizer", "FakeChatTokenizer"}  # stand in for HF tokenizers, which rl_core wraps in no protocol


def protocol_members(proto: type) -> tuple[dict[str, object], set[str]]:
    """(methods and properties by name, data attribute names) the protocol declares."""
    methods = {n: v for n, v in vars(proto).items()
               if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))}
    attrs = {n for n in getattr(proto, "__annotations__", {}) if not n.startswith("_")}
    return methods, attrs - set(methods)


def signature_problems(proto: type, impl: type) -> list[str]:
    """What about `impl`'s methods does not match `proto`'s declaration (empty: conforms)."""
    problems = []
    methods, _ = protocol_members(proto)
    for name, declared in methods.items():
        if isinstance(declared, property):
            if not hasattr(impl, name) and name not in getattr(impl, "__annotations__", {}):
                problems.append(f"{name}: missing (a property of {proto.__name__})")
            continue
        got = inspect.getattr_static(impl, name, _MISSING)
        if got is _MISSING:
            problems.append(f"{name}: missing")
            continue
        if isinstance(got, (staticmethod, classmethod)) or not callable(got):
            problems.append(f"{name}: not a plain method ({type(got).__name__})")
            continue
        if inspect.iscoroutinefunction(declared) != inspect.iscoroutinefunction(got):
            problems.append(f"{name}: {'async' if inspect.iscoroutinefunction(declared) else 'sync'} in "
                            f"{proto.__name__}, not in {impl.__name__}")
        want = list(inspect.signature(declared).parameters.values())[1:]
        have = list(inspect.signature(got).parameters.values())[1:]
        var_pos = any(p.kind is p.VAR_POSITIONAL for p in have)
        var_kw = any(p.kind is p.VAR_KEYWORD for p in have)
        named = [p for p in have if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY, p.KEYWORD_ONLY)]
        for i, p in enumerate(want):
            match = next((q for q in named if q.name == p.name), None)
            if match is None:
                if not (var_kw and (var_pos or p.kind is p.KEYWORD_ONLY)):
                    problems.append(f"{name}: does not accept `{p.name}`")
                continue
            if p.kind is p.POSITIONAL_OR_KEYWORD and (match.kind is not p.POSITIONAL_OR_KEYWORD
                                                      or named.index(match) != i):
                problems.append(f"{name}: `{p.name}` is not positional parameter {i + 1}")
            if p.default is not p.empty and match.default is p.empty:
                problems.append(f"{name}: `{p.name}` is optional in {proto.__name__} but required here")
        extra = [q for q in named if q.name not in {p.name for p in want} and q.default is q.empty]
        if extra:
            problems.append(f"{name}: requires parameters the protocol does not pass: "
                            f"{', '.join(q.name for q in extra)}")
    return problems


def assert_conforms(obj: object, proto: type) -> None:
    impl = obj if isinstance(obj, type) else type(obj)
    problems = signature_problems(proto, impl)
    if not isinstance(obj, type):
        _, attrs = protocol_members(proto)
        problems += [f"{a}: missing attribute" for a in sorted(attrs) if not hasattr(obj, a)]
        if not problems:
            assert isinstance(obj, proto), f"{impl.__name__} is not a {proto.__name__}"
    assert not problems, f"{impl.__name__} vs {proto.__name__}:\n  " + "\n  ".join(problems)


# ------------------------------------------------------------------ the checker itself


class _Conforming:
    name = "x"
    reward_names = ()
    max_turns = 1
    end_token_ids = (0,)
    runs_episodes = False

    async def aclose(self): ...
    def prompt_ids(self, example): ...
    def stop_strings(self): ...
    def reference_completion_ids(self, example): ...
    def parse_completion(self, completion_ids, completion_text, finish_reason): ...
    def observe(self, example, turn, completion): ...
    def score(self, example, completion_ids, completion_text, finish_reason): ...
    def score_turns(self, example, turns): ...


def test_the_checker_accepts_a_conforming_class_and_names_each_mismatch():
    assert_conforms(_Conforming(), Environment)

    class Renamed(_Conforming):
        def score(self, example, ids, completion_text, finish_reason): ...

    class Missing(_Conforming):
        parse_completion = None

    class Async(_Conforming):
        async def stop_strings(self): ...

    class NeedsMore(_Conforming):
        def observe(self, example, turn, completion, history): ...

    assert signature_problems(Environment, Renamed) == [
        "score: does not accept `completion_ids`", "score: requires parameters the protocol does not pass: ids"]
    assert signature_problems(Environment, Missing) == ["parse_completion: not a plain method (NoneType)"]
    assert signature_problems(Environment, Async) == ["stop_strings: sync in Environment, not in Async"]
    assert signature_problems(Environment, NeedsMore) == [
        "observe: requires parameters the protocol does not pass: history"]

    class OldTrainer(fakes.FakeTrainer):  # the fake before issue 14
        def export_weights(self):
            return {}

    assert signature_problems(TrainerBackend, OldTrainer) == ["export_weights: does not accept `on_device`"]
    no_counter = fakes.FakeTrainer()
    del no_counter.optimizer_steps  # the controller reads it for checkpoints and the summary
    with pytest.raises(AssertionError, match="optimizer_steps: missing attribute"):
        assert_conforms(no_counter, TrainerBackend)


# ------------------------------------------------------------------ fakes


def test_every_fake_in_tests_helpers_is_mapped_to_its_protocol():
    found = {n for n, v in vars(fakes).items() if isinstance(v, type) and n.startswith("Fake")
             and v.__module__ == fakes.__name__}
    assert found - NOT_A_SEAM == set(FAKES), "map each new fake to its protocol in FAKES"


@pytest.mark.parametrize("name", sorted(FAKES))
def test_fake_satisfies_its_protocol(name):
    assert_conforms(getattr(fakes, name)(), FAKES[name])


def test_fake_parts_satisfy_the_controllers_protocols():
    parts = fakes.make_parts(recipe())
    assert_conforms(parts.env, Environment)
    assert_conforms(parts.backend, GenerationBackend)
    assert_conforms(parts.trainer, TrainerBackend)
    assert_conforms(parts.sampler, Sampler)


# ------------------------------------------------------------------ real implementations


@pytest.fixture(scope="module")
def tokenizer():
    from rl_core.data.dataset import load_jsonl
    from rl_core.model.tokenizer import build_tokenizer

    return build_tokenizer(load_jsonl("data/addition/val.jsonl"), 300)


@pytest.mark.parametrize("env_type", ["addition", "chain_addition"])
def test_builtin_environments_satisfy_environment(env_type, tokenizer):
    assert_conforms(make_env(recipe(env={"type": env_type}).env, tokenizer), Environment)


@pytest.mark.parametrize("env_type", sorted(ENVS))
def test_every_registered_environment_class_has_the_protocols_methods(env_type):
    assert_conforms(ENVS[env_type], Environment)


@pytest.mark.parametrize("env_type", sorted(ENVS))
def test_environments_that_run_episodes_are_episode_environments(env_type):
    """`EpisodeEnvironment` is what rl_core.rollout calls on an environment with `runs_episodes`."""
    cls = ENVS[env_type]
    if cls.runs_episodes:
        assert_conforms(cls, EpisodeEnvironment)
    else:
        assert not hasattr(cls, "run_agent")


def test_agent_environments_built_satisfy_both_protocols(tokenizer):
    env = make_env(recipe(env={"type": "http", "url": "http://127.0.0.1:8765"}).env, tokenizer)
    assert_conforms(env, EpisodeEnvironment)
    assert_conforms(env, Environment)


def test_builtin_environments_have_the_batch_prompt_encode(tokenizer):
    """`BatchPromptEnvironment` is optional (the rollout pump then encodes each group's prompt):
    `BaseEnv` has it, the fake environment of the controller's unit tests does not."""
    for env_type in ("addition", "chain_addition"):
        assert_conforms(make_env(recipe(env={"type": env_type}).env, tokenizer), BatchPromptEnvironment)
    assert not isinstance(fakes.FakeEnv(), BatchPromptEnvironment)


SAMPLER_RECIPES = {
    "in_order": {"async_rl": {"sampler": {"type": "in_order", "max_lookahead_versions": 1}}},
    "in_order_adaptive": {"async_rl": {"sampler": {"type": "in_order", "max_lookahead_versions": 2,
                                                   "adaptive": {"enabled": True}}}},
    "weight_fifo": {"async_rl": {"sampler": {"type": "weight_fifo"}}},
    "windowed": {"async_rl": {"sampler": {"type": "windowed"}}},
    "ready_first": {"async_rl": {"sampler": {"type": "ready_first"}}, "loss": {"importance_sampling": {"enabled": True}}},
}


def test_every_sampler_type_is_checked():
    # `custom` is checked against the protocol when it is built (rl_core.samplers.custom)
    assert set(SAMPLERS) - {"custom"} == {v["async_rl"]["sampler"]["type"] for v in SAMPLER_RECIPES.values()}


@pytest.mark.parametrize("case", sorted(SAMPLER_RECIPES))
def test_builtin_samplers_satisfy_sampler(case):
    assert_conforms(make_sampler(recipe(**SAMPLER_RECIPES[case])), Sampler)


WEIGHT_SYNC_RECIPES = {
    "in_process": {},
    "filesystem": {},
    "broadcast": {"generation": {"backend": "http", "placement": "separate", "http": {"num_local_servers": 1}}},
}


@pytest.mark.parametrize("kind", sorted(WEIGHT_SYNCS))
def test_every_weight_transport_satisfies_weight_sync(kind, tmp_path):
    cfg = recipe(trainer={"weight_sync": {"type": kind}}, **WEIGHT_SYNC_RECIPES[kind])
    sync = make_weight_sync(cfg, tmp_path)
    assert_conforms(sync, WeightSync)
    assert sync.kind == kind


def test_native_and_http_backends_satisfy_generation_backend():
    from rl_core.generation.native.backend import NativeBackend
    from rl_core.generation.http.backend import HttpBackend
    from tests.helpers.engine_models import make_engine, tiny_model

    assert_conforms(NativeBackend(make_engine(tiny_model())), GenerationBackend)
    assert_conforms(HttpBackend(["http://127.0.0.1:9"]), GenerationBackend)  # not started: no connection made


def test_native_backend_has_the_optional_group_call():
    """GroupGenerationBackend is optional (rl_core.rollout.group falls back to a generate per
    sample); the native backend implements it, with the declared signature."""
    from rl_core.generation.native.backend import NativeBackend
    from rl_core.generation.http.backend import HttpBackend
    from rl_core.protocols import GroupGenerationBackend

    assert_conforms(NativeBackend, GroupGenerationBackend)
    assert not isinstance(HttpBackend(["http://127.0.0.1:9"]), GroupGenerationBackend)  # the per-sample default
    assert not isinstance(fakes.FakeBackend(), GroupGenerationBackend)


def test_vllm_backends_have_the_generation_backend_methods():
    from rl_core.generation.vllm.backend import VLLMBackend
    from rl_core.generation.vllm.server import VLLMServerBackend

    assert_conforms(VLLMBackend, GenerationBackend)
    assert_conforms(VLLMServerBackend, GenerationBackend)


def test_torch_trainer_satisfies_trainer_backend(tmp_path):
    from rl_core.train import make_trainer
    from tests.helpers.trainers import tiny_hf_dir

    trainer = make_trainer(recipe(trainer={"backend": "torch"}), tiny_hf_dir(tmp_path / "policy"), device="cpu")
    assert_conforms(trainer, TrainerBackend)


def test_multi_process_trainers_have_the_trainer_backend_methods():
    from rl_core.train.fsdp import FSDPTrainer
    from rl_core.train.megatron import MegatronTrainer

    assert_conforms(FSDPTrainer, TrainerBackend)
    assert_conforms(MegatronTrainer, TrainerBackend)


def test_the_recovering_trainer_is_a_trainer_backend():
    from rl_core.train.recovery import RecoveringTrainer

    trainer = RecoveringTrainer(fakes.FakeTrainer(), lambda base, old, deadline: None, base=None, base_version=0,
                                max_restarts=2, deadline_s=60.0)
    assert_conforms(trainer, TrainerBackend)
