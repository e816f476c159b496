"""Shell completion for `rl-core` (bash and zsh), generated from its argparse parser.

Owns: `completion_script(parser, shell)`: a script that completes the subcommands, each
subcommand's options, the values of options and positionals with fixed choices
(`--format text|markdown`, `make-data addition|...`), and, after a recipe, its dotted
override fields (`grpo.max_num_steps=`) from the recipe schema; anything else completes
file names. zsh runs the same function through its `bashcompinit`. Install with
`source <(rl-core completion bash)` (or `zsh`) in the shell's rc file.

Does not own: the parser (cli.py). See docs/usage.md, "Quickstart".
"""

from __future__ import annotations

import argparse
import shlex
import typing


def _words(items) -> str:
    return shlex.quote(" ".join(items))


def _override_fields() -> list[str]:
    """Every recipe field as `dotted.path=` (the schema, torch-free)."""
    from pydantic import BaseModel

    from rl_core.config.schema import RecipeConfig

    out: list[str] = []

    def models(annotation) -> list[type[BaseModel]]:  # the sections in a field's type (a union: each member)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        if typing.get_origin(annotation) in (list, dict, tuple, set):  # items are not dotted paths
            return []
        return [m for arg in typing.get_args(annotation) for m in models(arg)]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            subs = models(info.annotation)
            for sub in subs:
                walk(sub, f"{prefix}{name}.")
            if not subs:
                out.append(f"{prefix}{name}=")

    walk(RecipeConfig, "")
    return list(dict.fromkeys(out))


def actions_of(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """A parser's arguments; argparse has no public accessor for them."""
    return list(p._actions)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in actions_of(parser):
        if action.nargs == argparse.PARSER:  # the subcommands: name -> parser
            return dict(action.choices)
    return {}


def _case_lines(name: str, sub: argparse.ArgumentParser) -> list[str]:
    opts, valued, choices, positional = [], [], [], []
    actions = actions_of(sub)
    for action in actions:
        if action.option_strings:
            opts.extend(action.option_strings)
            if action.nargs != 0:
                valued.extend(action.option_strings)
                if action.choices:
                    choices.append((action.option_strings, list(action.choices)))
        else:
            positional.append(list(action.choices) if action.choices else None)
    lines = [f"        {name})", f"            opts={_words(opts)}", f"            valued={_words(valued)}"]
    for flags, values in choices:
        lines.append(f"            case \"$prev\" in {'|'.join(flags)}) COMPREPLY=($(compgen -W "
                     f"{_words(values)} -- \"$cur\")); return 0;; esac")
    first = _words(positional[0]) if positional and positional[0] else "''"
    recipe = 1 if any(a.dest == "recipe" for a in actions) else 0
    lines += [f"            first={first}", f"            recipe={recipe}"]
    lines.append("            ;;")
    return lines


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script of `parser` (prog `rl-core`) for `shell` ("bash" or "zsh")."""
    subs = _subcommands(parser)
    top = [o for a in actions_of(parser) for o in a.option_strings]
    cases = [line for name, sub in subs.items() for line in _case_lines(name, sub)]
    fields = _override_fields()
    body = "\n".join([
        "_rl_core_complete() {",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" prev="${COMP_WORDS[COMP_CWORD-1]}"',
        "    local cmd='' i pos=0 opts='' valued='' first='' recipe=0",
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        '        case "${COMP_WORDS[i]}" in -*) ;; *) cmd="${COMP_WORDS[i]}"; break;; esac',
        "    done",
        '    if [[ -z "$cmd" ]]; then',
        f'        COMPREPLY=($(compgen -W {_words([*subs, *top])} -- "$cur")); return 0',
        "    fi",
        '    case "$cmd" in',
        *cases,
        "        *) return 0;;",
        "    esac",
        '    [[ " $valued " == *" $prev "* ]] && return 0  # an option value: file names',
        '    if [[ "$cur" == -* ]]; then COMPREPLY=($(compgen -W "$opts" -- "$cur")); return 0; fi',
        "    for ((i = i + 1; i < COMP_CWORD; i++)); do  # positionals before the word being completed",
        '        if [[ "${COMP_WORDS[i]}" == -* ]]; then [[ " $valued " == *" ${COMP_WORDS[i]} "* ]] && ((i++))',
        "        else ((pos++)); fi",
        "    done",
        '    if [[ $pos -eq 0 && -n "$first" ]]; then COMPREPLY=($(compgen -W "$first" -- "$cur")); return 0; fi',
        '    if [[ $pos -ge 1 && $recipe -eq 1 && "$cur" != */* ]]; then',
        f'        COMPREPLY=($(compgen -W {_words(fields)} -- "$cur"))',
        "        [[ ${#COMPREPLY[@]} -gt 0 ]] && compopt -o nospace 2>/dev/null",
        "    fi",
        "    return 0",
        "}",
        "complete -o default -F _rl_core_complete rl-core",
    ])
    head = f"# {shell} completion for rl-core (generated by `rl-core completion {shell}`)\n"
    if shell == "zsh":  # zsh runs the bash function through bashcompinit (compinit first, if not loaded)
        head += ("(( $+functions[compdef] )) || { autoload -U +X compinit && compinit -u; }\n"
                 "autoload -U +X bashcompinit && bashcompinit\n")
    return head + body + "\n"
