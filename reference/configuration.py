"""``docs/reference/configuration.md``: every flag, from the declarations ``--help`` is built from.

One table per ``--help`` group, in its order; a flag's row has its invocation as ``--help`` shows
it, its default as ``--help`` shows it, and its help. vllm-router's flags that are refused, which
``--help`` leaves out, are listed too, with the reason; so are values a flag refuses.
"""

from __future__ import annotations

import argparse

from trio_pdrouter.config import RouterConfig, build_parser, flags, shown_default

HEADER = """\
# Configuration reference

Every flag of `trio-pdrouter`, grouped as `trio-pdrouter --help` groups them. This page is
generated from the flag declarations (`make docs-reference`); a test fails when it and the
parser disagree, so edit the declaration in `trio_pdrouter/config/`, never this page.

Sizes take a unit: `512MiB`, `4MiB`, `1GiB`, `64KiB` (powers of 1024; `Ki`, `Mi`, `Gi` too),
`500MB` (powers of 1000), or plain bytes. A flag whose default depends on other flags says so
in its description; an empty default means "not set".
"""


def render() -> str:
    parser = build_parser()
    actions = {name: action for action in parser._actions for name in action.option_strings}
    formatter = parser._get_formatter()

    def invocation(action: argparse.Action) -> str:
        """How ``--help`` writes the flag: ``--max-payload-size SIZE``."""
        return str(formatter._format_action_invocation(action))

    rows: dict[flags.Group, list[str]] = {group: [] for group in flags.Group}
    for _, _, option in flags.declared(RouterConfig):
        if isinstance(option, flags.Flag) and option.hidden:
            continue
        action = actions[option.spelling]
        rows[option.group].append(_row(option, action, invocation(action)))
    out = [HEADER]
    for group, lines in rows.items():
        if not lines:
            continue
        out.append(f"## {_title(group)}\n")
        if group is flags.Group.REFUSED:
            out.append(
                "vllm-router 0.1.17 flags for features not implemented here. They parse, so a"
                " vllm-router command line is read whole; given a value other than their"
                " default, the router exits 2 with one message naming each, why, and what to"
                " use instead. `--help` leaves them out.\n"
            )
        out.append("| flag | default | what it does |\n|---|---|---|")
        out.extend(lines)
        out.append("")
    return "\n".join(out)


def _title(group: flags.Group) -> str:
    if group is flags.Group.REFUSED:
        return "Refused vllm-router flags"
    title = str(group.value)
    if "_" in title.split()[0]:  # a policy's name, spelt as it is typed
        return title
    return title[0].upper() + title[1:]


def _row(option: flags.Flag | flags.Switch, action: argparse.Action, invocation: str) -> str:
    text = option.help
    if isinstance(option, flags.Flag):
        if option.refused is not None:
            text = f"{text}. Refused: {option.refused}"
        for value, reason in option.refused_choices.items():
            text = f"{text}. `{value}` is refused: {reason}"
    shown = shown_default(action) if isinstance(option, flags.Flag) else None
    default = "" if shown is None else f"`{shown}`"
    return f"| `{invocation}` | {default} | {_cell(text)} |"


def _cell(text: str) -> str:
    """``text`` safe in a table cell: no pipe ends the cell, nothing reads as HTML."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
