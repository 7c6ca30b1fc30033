"""Command-line flags, each declared once: on the config field it sets.

The rules:

* A flag is declared with :func:`setting` on the attrs field it sets: its spelling, its
  ``--help`` group and text, and argparse's type, choices, nargs, metavar and action, as a
  :class:`Flag`. The field's default is the flag's default; nothing else repeats it (``show=``
  only says how ``--help`` writes it: a size as ``512MiB``).
* A settings class inside another is a :func:`section`. :func:`add_flags` builds the parser and
  :func:`build` turns the parsed arguments into the config by the same walk: the root class and
  its sections, field by field, in declaration order (so ``--help`` lists a group's flags in the
  order of the fields).
* A field may also carry a :class:`Switch`, a flag without a value that, when given, sets the
  field to a fixed value whatever its flag says (``--disable-retries``).
* Validation is declared on the field as well (``check=``) and runs whenever the class is built,
  by :func:`build`, by hand or by ``attrs.evolve``: an invalid config cannot exist. A field whose
  flag has ``choices`` accepts only those. ``None`` always passes: it means "not set".
* Every refusal is a :class:`ConfigError` whose message names the flag (or the URL) at fault.
* A vllm-router flag that trio-pdrouter does not implement is still declared, on the field it
  will set, with ``refused=`` saying why and what to use instead (and a value of a ``choices``
  flag likewise with ``refused_choices=``). It parses, so a vllm-router launch command reaches
  :func:`build`, which then refuses every such flag given, all in one :class:`ConfigError`;
  ``--help`` leaves such flags and values out (the configuration reference lists them).
  Giving a refused flag its default value is not refusing anything: it is accepted. Whoever
  implements the feature removes ``refused=`` and uses the field.
"""

from __future__ import annotations

import argparse
import builtins
import enum
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import attrs

T = TypeVar("T")
Settings = TypeVar("Settings", bound=attrs.AttrsInstance)

#: An attrs validator: called with the instance being built, the field and its value.
Check = Callable[[Any, "attrs.Attribute[Any]", Any], None]

_FLAG = "trio_pdrouter.flag"
_SWITCH = "trio_pdrouter.switch"
_SECTION = "trio_pdrouter.section"


class ConfigError(ValueError):
    """A setting that cannot work; the message says which and why."""


class Group(enum.Enum):
    """The sections of ``--help``, in the order they are shown (a dozen flags or fewer each)."""

    LISTENING = "listening"
    UPSTREAMS = "upstreams"
    ROUTING_POLICY = "routing policy"
    KV_AWARE = "kv_aware: routing on vLLM's KV events"
    REQUESTS = "requests"
    TIMEOUTS = "timeouts"
    RETRIES = "retries"
    CIRCUIT_BREAKERS = "circuit breakers"
    HEALTH = "health checks"
    ADMISSION = "admission"
    CLUSTER = "cluster"
    DISCOVERY = "kubernetes service discovery"
    SECURITY = "security"
    OBSERVABILITY = "observability"
    #: Left out of ``--help`` (the documentation lists them): they parse, then refuse to start.
    REFUSED = "vllm-router flags not implemented (they parse, then refuse to start with a reason)"


@attrs.frozen
class Flag:
    """The command-line option that sets a field; ``None`` leaves an argparse keyword out."""

    spelling: str
    group: Group
    help: str
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    nargs: str | None = None
    metavar: str | tuple[str, ...] | None = None
    action: str | builtins.type[argparse.Action] | None = None
    #: Turns what argparse parsed into the field's value; may raise :class:`ConfigError`.
    parse: Callable[[Any], Any] | None = None
    #: How ``--help`` shows the default, as text ``type`` parses back (sizes: ``512MiB``).
    show: Callable[[Any], str] | None = None
    #: Parsed as usual but left out of ``--help`` (test-only flags).
    hidden: bool = False
    #: Not implemented: why, and the alternative. Given (other than its default), the config
    #: build refuses it.
    refused: str | None = None
    #: Values argparse accepts beside ``choices`` that the config build refuses, with the reason.
    refused_choices: Mapping[str, str] = attrs.field(factory=dict)

    def arguments(self, default: object) -> dict[str, Any]:
        """``add_argument``'s keywords; ``default`` is the field's (a tuple is shown as a list).

        A refused flag is left out of ``--help``, and a refused value out of the choices shown;
        both still parse, so that the config build can refuse them with the reason.
        """
        choices: Offered | tuple[str, ...] | None = self.choices
        if self.choices is not None and self.refused_choices:
            choices = Offered(self.choices, tuple(self.refused_choices))
        if self.show is not None and default is not None:
            default = self.show(default)
        keywords = {
            "type": self.type,
            "choices": choices,
            "nargs": self.nargs,
            "metavar": self.metavar,
            "action": self.action,
        }
        return {
            "default": list(default) if isinstance(default, tuple) else default,
            "help": argparse.SUPPRESS if self.hidden or self.refused else self.help,
            **{name: value for name, value in keywords.items() if value is not None},
        }

    def value(self, args: argparse.Namespace) -> Any:
        """The field's value as ``args`` give it."""
        parsed = getattr(args, _dest(self.spelling))
        return parsed if self.parse is None else self.parse(parsed)

    def refusal(self, args: argparse.Namespace, default: object) -> tuple[str, str] | None:
        """What ``args`` give this flag that cannot be served, and why; None when all can."""
        if self.refused is not None and self.value(args) != default:
            return self.spelling, self.refused
        raw = getattr(args, _dest(self.spelling))
        if isinstance(raw, str) and raw in self.refused_choices:
            return f"{self.spelling} {raw}", self.refused_choices[raw]
        return None


class Offered:
    """A flag's ``choices`` for argparse: it shows (iterates over) the values offered, and
    accepts (contains) those and the refused ones, which the config build then refuses."""

    def __init__(self, offered: tuple[str, ...], refused: tuple[str, ...]) -> None:
        self._offered = offered
        self._accepted = frozenset((*offered, *refused))

    def __iter__(self) -> Iterator[str]:
        return iter(self._offered)

    def __len__(self) -> int:
        return len(self._offered)

    def __contains__(self, value: object) -> bool:
        return value in self._accepted


@attrs.frozen
class Switch:
    """A flag without a value: given, it sets its field to ``sets``, whatever the field's flag
    says."""

    spelling: str
    group: Group
    help: str
    sets: object

    def arguments(self, default: object) -> dict[str, Any]:
        """``add_argument``'s keywords (a switch's own default is "not given")."""
        return {"action": "store_true", "help": self.help}

    def given(self, args: argparse.Namespace) -> bool:
        return bool(getattr(args, _dest(self.spelling)))


def _dest(spelling: str) -> str:
    """The attribute argparse stores a flag's value in."""
    return spelling.removeprefix("--").replace("-", "_")


def setting(
    default: T,
    flag: Flag | None = None,
    *,
    switch: Switch | None = None,
    check: Check | None = None,
) -> T:
    """A config field with its default, the flags that set it and the check of its value."""
    checks = [check] if check is not None else []
    if flag is not None and flag.choices is not None:
        checks.append(_one_of(flag.choices))
    field: T = attrs.field(
        default=default, validator=checks, metadata={_FLAG: flag, _SWITCH: switch}
    )
    return field


def section(cls: type[Settings]) -> Settings:
    """A field holding a nested settings class, whose flags are walked too."""
    field: Settings = attrs.field(factory=cls, metadata={_SECTION: cls})
    return field


def must(test: Callable[[Any], bool], text: str) -> Check:
    """Refuse a value ``test`` rejects with "<flag> <text>"."""

    def check(instance: Any, field: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not test(value):
            raise ConfigError(f"{_name(field)} {text}")

    return check


positive = must(lambda x: x > 0, "must be positive")
non_negative = must(lambda x: x >= 0, "must be 0 or more")


def as_tuple(values: list[str] | None) -> tuple[str, ...]:
    """``parse=`` for a repeatable flag: what was given, as a tuple (none given: empty)."""
    return tuple(values or ())


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(instance: Any, field: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and value not in choices:
            raise ConfigError(
                f"{_name(field)} {value!r} is not supported; choose from {', '.join(choices)}"
            )

    return check


def _name(field: attrs.Attribute[Any]) -> str:
    """How messages call a field: by its flag, else by its name."""
    flag: Flag | None = field.metadata.get(_FLAG)
    return field.name if flag is None else flag.spelling


def declared(
    root: type[attrs.AttrsInstance], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], attrs.Attribute[Any], Flag | Switch]]:
    """Every flag of ``root`` and its sections, with the path of attribute names to its field."""
    for field in attrs.fields(root):
        where = (*path, field.name)
        nested = field.metadata.get(_SECTION)
        if nested is not None:
            yield from declared(nested, where)
        for option in (field.metadata.get(_FLAG), field.metadata.get(_SWITCH)):
            if option is not None:
                yield where, field, option


def add_flags(parser: argparse.ArgumentParser, root: type[attrs.AttrsInstance]) -> None:
    """Add the flags of ``root`` to ``parser``, each in its group, defaults from the fields."""
    groups = {group: parser.add_argument_group(group.value) for group in Group}
    for _, field, option in declared(root):
        groups[option.group].add_argument(option.spelling, **option.arguments(field.default))


def refusals(root: type[attrs.AttrsInstance], args: argparse.Namespace) -> list[str]:
    """One line per reason that flags given in ``args`` are refused (``refused``,
    ``refused_choices``): the flags, then why and what to use instead. Empty when none is."""
    by_reason: dict[str, list[str]] = {}
    for _, field, option in declared(root):
        if isinstance(option, Flag):
            refusal = option.refusal(args, field.default)
            if refusal is not None:
                given, reason = refusal
                by_reason.setdefault(reason, []).append(given)
    return [f"{', '.join(given)}: {reason}" for reason, given in by_reason.items()]


def build(cls: type[Settings], args: argparse.Namespace) -> Settings:
    """The ``cls`` that ``args`` (parsed by a parser from :func:`add_flags`) describe.

    Raises :class:`ConfigError` when the settings cannot work: naming every refused flag given
    (see the module doc) in one message; else with the first invalid setting.
    """
    refused = refusals(cls, args)
    if refused:
        raise ConfigError(
            "vllm-router flags that trio-pdrouter does not support:\n  " + "\n  ".join(refused)
        )
    return _build(cls, args)


def _build(cls: type[Settings], args: argparse.Namespace) -> Settings:
    values: dict[str, Any] = {}
    for field in attrs.fields(cls):
        nested = field.metadata.get(_SECTION)
        flag: Flag | None = field.metadata.get(_FLAG)
        switch: Switch | None = field.metadata.get(_SWITCH)
        if nested is not None:
            values[field.name] = _build(nested, args)
        elif switch is not None and switch.given(args):
            values[field.name] = switch.sets
        elif flag is not None:
            values[field.name] = flag.value(args)
    return cls(**values)
