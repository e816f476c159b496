"""Loading a recipe for a run: read and validated (rl_core.config), then the preflight.

Owns: `load_recipe`, what `rl-core validate`, `rl-core train` and the workflow's stages load a
recipe with, and `preflight`: the checks that need the file system or the user's plug-ins but
nothing heavy, before any model is built (data files row by row, the model and output
directories, the environment's plug-ins and the data/env pairing: `check_env_config`, an
agent function, a custom sampler). Each plug-in is checked by the package that builds it
(rl_core.envs, rl_core.samplers, rl_core.data, rl_core.model); this module only calls them,
which is why it sits in the launch layer. torch is imported only where a plug-in needs it.

Does not own: parsing, overrides and the schema's rules (rl_core.config.loader).
"""

from __future__ import annotations

import os
from pathlib import Path

from rl_core.config import RecipeConfig, read_recipe, run_dir
from rl_core.config.loader import check_model_architecture, check_output_dir
from rl_core.errors import DataError, RecipeError


GENERATE_CHECKED = 20_000
"""Examples of `data.generate` the preflight generates (each set's first ones): a larger set is
made only by train / make_data; the schema bounds its size (config.model_sections)."""


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None) -> RecipeConfig:
    """parse -> override -> validate (`rl_core.config.read_recipe`) -> preflight. Raises
    RecipeError; never builds a model."""
    cfg = read_recipe(path, overrides)
    preflight(cfg, source=str(path))
    return cfg


def preflight(cfg: RecipeConfig, source: str | None = None) -> None:
    """Checks that need the file system but nothing heavy: data files (every row), model
    directory, a reused warm-up (`model.warmup.reuse_from`), the output directory, the
    environment's plug-ins (a `custom` class, reward functions, a reasoning_gym task:
    `check_env_config`), and a `custom` sampler (imported and constructed)."""
    check_model_architecture(cfg, source)
    problems = []
    for field in ("train_file", "val_file"):
        p = Path(getattr(cfg.data, field))
        if not _is_data_path(p) and cfg.data.generate is None:  # generated files are made by make_data / train
            problems.append({"field": f"data.{field}", "value": str(p),
                             "expected": f"an existing JSON-lines file, Parquet file or datasets.save_to_disk "
                                         f"directory (looked for {p.resolve()})",
                             "fix": "fix the path, or generate the toy data with `rl-core make-data addition`."})
    for name, file in cfg.evaluation.sets.items():
        if not _is_data_path(Path(file)):
            problems.append({"field": f"evaluation.sets.{name}", "value": file,
                             "expected": f"an existing prompt file (JSON lines, Parquet or a save_to_disk "
                                         f"directory; looked for {Path(file).resolve()})",
                             "fix": "fix the path or remove the set (an empty evaluation.sets uses data.val_file)."})
    if cfg.model.source == "hf" and cfg.model.path:
        d = Path(cfg.model.path)
        if not (d / "config.json").is_file():
            problems.append({"field": "model.path", "value": str(d),
                             "expected": "an HF model directory containing config.json",
                             "fix": "point model.path at a saved transformers model directory."})
    if cfg.model.source == "tiny" and cfg.model.warmup.reuse_from:
        from rl_core.model.init_policy import reused_policy_dir

        reused_policy_dir(cfg)  # the named warm-up exists and fits this recipe's model and data
    if cfg.model.source == "smollm2":
        from rl_core.model.gguf import find_smollm2_gguf

        find_smollm2_gguf()  # a ModelFileError naming the package and the fix, before anything is built
    if cfg.critic.enabled and cfg.critic.model_path and not (Path(cfg.critic.model_path) / "config.json").is_file():
        problems.append({"field": "critic.model_path", "value": cfg.critic.model_path,
                         "expected": "an HF model directory containing config.json (or a directory saved by the critic)",
                         "fix": "point critic.model_path at a saved transformers model, or remove it to start the critic from the initial policy."})
    problems += _tracker_problems(cfg)
    if problems:
        raise RecipeError(problems, source)
    check_output_dir(run_dir(cfg), "output_dir", source)
    check_env_config(cfg, source)  # the env's plug-ins and task, before anything is built
    _check_data(cfg, source)
    _check_context(cfg, source)
    if cfg.env.type in ("agent", "http") and cfg.async_rl.reproducible:
        raise RecipeError.single("async_rl.reproducible", True, f"false with env.type {cfg.env.type} (the model "
                                 "calls of agent episodes cross a socket, so the engine's batches depend on timing)",
                                 "set async_rl.reproducible: false, or use an in-process environment.")
    if cfg.env.type == "agent":  # import and check the agent function now, not after the build
        from rl_core.envs.agent import load_agent

        load_agent(cfg.env)
    if cfg.async_rl.sampler.type == "custom":  # import, construct and check it now, not after the build
        from rl_core.samplers import build_custom_sampler

        build_custom_sampler(cfg.async_rl.sampler, cfg.grpo.num_prompts_per_step)


def _tracker_problems(cfg: RecipeConfig) -> list[dict]:
    """A tracker in logging.trackers whose library is not installed (found without importing it)."""
    import importlib.util

    return [{"field": "logging.trackers", "value": cfg.logging.trackers,
             "expected": f"the {name!r} package installed for the {name!r} tracker (it is not importable here)",
             "fix": f'pip install "rl_core[{name}]" (with -c constraints.txt), or remove {name!r} from logging.trackers.'}
            for name in cfg.logging.trackers if name != "tensorboard" and importlib.util.find_spec(name) is None]


def check_env_config(cfg: RecipeConfig, source: str | None = None) -> None:
    """The environment's plug-ins, each checked by the module that builds it (a `custom` class:
    rl_core.envs.custom; reward functions: rl_core.envs.reward_functions; a reasoning_gym task:
    rl_core.data.reasoning_gym), and the data/env pairing (`data.answer_key: null` needs an
    environment and a model that use no answers; `data.messages_key` one that renders the chat
    template)."""
    env = cfg.env
    try:
        if env.type == "custom":
            from rl_core.envs.custom import load_env_class

            load_env_class(env.target)
        elif env.type == "reward_functions":
            from rl_core.envs.reward_functions import load_reward_functions

            load_reward_functions(list(env.functions))
        elif env.type == "reasoning_gym":
            from rl_core.data.reasoning_gym import check_data_matches_env, task_dataset

            task_dataset(env.task, dict(env.config))
            if cfg.data.generate is None:  # files made elsewhere: the same task and settings
                check_data_matches_env(env, [(f"data.{f}", getattr(cfg.data, f)) for f in ("train_file", "val_file")
                                             if _is_data_path(Path(getattr(cfg.data, f)))])
    except RecipeError as exc:
        raise RecipeError(exc.problems, source) from None
    if cfg.data.answer_key is None:
        if env.type in ("addition", "chain_addition", "reasoning_gym"):
            raise RecipeError.single("data.answer_key", None, f"a column of reference answers (env.type {env.type} "
                                     f"scores against the example's answer)",
                                     "set data.answer_key to the answer column (default: answer).", source)
        if cfg.model.source == "tiny":
            raise RecipeError.single("data.answer_key", None, "a column of reference answers with model.source tiny "
                                     "(its tokenizer, length check and warm-up use the answers)",
                                     "set data.answer_key, or use a pretrained model (model.source: hf).", source)
    if cfg.data.messages_key and env.type in ("addition", "chain_addition", "reward_functions", "reasoning_gym") \
            and not getattr(env, "use_chat_template", False):
        fix = ("set env.use_chat_template: true" if env.type in ("reward_functions", "reasoning_gym")
               else "use an environment that renders chats (reward_functions, reasoning_gym or custom)")
        raise RecipeError.single("data.messages_key", cfg.data.messages_key,
                                 f"an environment that renders chat prompts with the tokenizer's chat template "
                                 f"(env.type {env.type} does not here)",
                                 f"{fix}, or map a text column with data.prompt_key.", source)


def _is_data_path(p: Path) -> bool:
    """A file, or a directory that looks like a dataset (its contents are checked by _check_data)."""
    return p.is_file() or (p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file()))


def _check_data(cfg: RecipeConfig, source: str | None) -> None:
    """Every row of every data file (format, UTF-8, size, object, mapped keys and types), and
    enough training examples for one RL step."""
    from rl_core.data.dataset import Fields, count_examples

    fields = Fields.of(cfg.data)

    counts = {}
    files = [("data.train_file", cfg.data.train_file), ("data.val_file", cfg.data.val_file)]
    gen = cfg.data.generate
    if gen is not None and not all(_is_data_path(Path(f)) for _, f in files):  # not generated yet
        from rl_core.data.reasoning_gym import RECIPE_FIELDS, reasoning_gym_examples

        few = min(gen.num_train, GENERATE_CHECKED), min(gen.num_val, GENERATE_CHECKED)  # a large set: its start
        reasoning_gym_examples(cfg.env.task, cfg.env.config, *few, gen.seed, RECIPE_FIELDS)
        counts = {"data.train_file": gen.num_train, "data.val_file": gen.num_val}
        files = []
    files += [(f"evaluation.sets.{name}", file) for name, file in cfg.evaluation.sets.items()]
    for field, file in files:
        try:
            counts[field] = count_examples(file, fields)
        except DataError as exc:
            raise DataError(f"`{field}`: {exc}") from None
    n = counts["data.train_file"]
    if cfg.data.max_train_examples is not None:
        n = min(n, cfg.data.max_train_examples)
    p = cfg.grpo.num_prompts_per_step
    if n < p:
        raise RecipeError.single("grpo.num_prompts_per_step", p,
                                 f"at most the training examples used ({n}, from data.train_file"
                                 + (" and data.max_train_examples" if cfg.data.max_train_examples is not None else "") + ")",
                                 "lower grpo.num_prompts_per_step or use a larger data.train_file.", source)


def _model_context(cfg: RecipeConfig) -> tuple[int | None, str]:
    """The policy's context (max positions) and where it was read: an existing initial policy's
    config.json, `model.path`'s, the SmolLM2 GGUF header, or `model.tiny`; None if unreadable."""
    import json

    policy = run_dir(cfg) / "init_policy"
    for d in ([policy] if (policy / "config.json").is_file() else []) + \
            ([Path(cfg.model.path)] if cfg.model.source == "hf" and cfg.model.path else []):
        try:
            conf = json.loads((d / "config.json").read_text())
            return int(conf.get("max_position_embeddings") or conf.get("n_positions")), f"{d / 'config.json'}"
        except (OSError, ValueError, TypeError):
            return None, ""
    if cfg.model.source == "smollm2":
        from rl_core.model.gguf import find_smollm2_gguf, gguf_metadata_value

        path = find_smollm2_gguf()
        n = gguf_metadata_value(path, "llama.context_length")
        return (int(n), f"{path.name}'s llama.context_length") if n else (None, "")
    if cfg.model.source == "tiny":
        return cfg.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
    return None, ""


def _tokenizer_dir(cfg: RecipeConfig) -> Path | None:
    """The tokenizer the run will use, where it exists already: an initial policy's (any
    source), `model.path`'s, or SmolLM2's converted copy; None (built with the policy) else."""
    candidates = [run_dir(cfg) / "init_policy"]
    if cfg.model.source == "hf" and cfg.model.path:
        candidates.append(Path(cfg.model.path))
    if cfg.model.source == "smollm2":
        from rl_core.model.gguf import cache_root

        candidates.append(cache_root() / "models" / "smollm2-135m-instruct-float32")
    return next((d for d in candidates if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()),
                None)


def _check_context(cfg: RecipeConfig, source: str | None) -> None:
    """`generation.native.max_seq_len` within the model's context, and, where the tokenizer
    exists already (an initial policy, an HF model), the longest prompt plus
    `generation.max_tokens` within it (else the initial policy's build checks it)."""
    ctx, where = _model_context(cfg)
    if ctx is None:
        return
    seq = cfg.generation.native.max_seq_len
    if seq is not None and seq > ctx:
        raise RecipeError.single("generation.native.max_seq_len", seq, f"at most the model's context, {ctx:,} tokens "
                                 f"(max positions, from {where})", f"lower generation.native.max_seq_len to {ctx} or "
                                 "less, or leave it null (the model's context, at most 4096).", source)
    tok_dir = _tokenizer_dir(cfg)
    if tok_dir is None or cfg.env.type in ("agent", "http", "custom") or cfg.data.generate is not None:
        return  # agents write their own prompts; a custom class is built with the run; generated data later
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from rl_core.data.dataset import Fields, iter_examples
    from rl_core.envs import make_env

    from rl_core.generation.native.engine import DEFAULT_MAX_SEQ_LEN_CAP

    try:  # model_max_length: no tokenizer warning for long prompts, this check names them
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True, model_max_length=1 << 40)
        env = make_env(cfg.env, tokenizer)
    except Exception:  # noqa: BLE001 - a broken or unfit initial policy: train's own checks refuse or rebuild it
        return
    engine = (seq or min(ctx, DEFAULT_MAX_SEQ_LEN_CAP)) if cfg.generation.backend == "native" else None
    for field in ("train_file", "val_file"):
        batch: list = []
        for row, example in enumerate(iter_examples(getattr(cfg.data, field), Fields.of(cfg.data)), start=1):
            batch.append((row, example))
            if len(batch) == 1024:
                _check_prompts(env, batch, (ctx, where), engine, f"data.{field}", cfg, source)
                batch = []
        _check_prompts(env, batch, (ctx, where), engine, f"data.{field}", cfg, source)


def _check_prompts(env, batch: list, context: tuple[int, str], engine: int | None, field: str,
                   cfg: RecipeConfig, source: str | None) -> None:
    """The longest prompt of `batch` ((row, example) pairs) plus generation.max_tokens within the
    model's context, and shorter than the native engine's max_seq_len (which refuses it)."""
    if not batch:
        return
    examples = [e for _, e in batch]
    ids = env.prompt_ids_many(examples) or [env.prompt_ids(e) for e in examples]
    longest = max(range(len(ids)), key=lambda i: len(ids[i]))
    n, (ctx, where), new = len(ids[longest]), context, cfg.generation.max_tokens
    if n + new > ctx:
        why = f"{n} + generation.max_tokens {new} > {ctx}, the model's context (from {where})"
        fix = "lower generation.max_tokens, or use a model with a longer context"
        if (run_dir(cfg) / "init_policy" / "config.json").is_file():
            fix += f" (the initial policy {run_dir(cfg) / 'init_policy'} fixes the model: rebuild it for another)"
    elif engine is not None and n >= engine:
        why = f"the native engine's generation.native.max_seq_len is {engine} (null: the context, at most 4,096)"
        fix = f"or raise generation.native.max_seq_len (at most {ctx})"
    else:
        return
    raise RecipeError.single(field, getattr(cfg.data, field.split(".")[1]),
                             f"prompts that fit the model: row {batch[longest][0]} has {n} tokens, and {why}",
                             f"shorten or drop that row, {fix}.", source)
