"""`Option`: one command-line option declared once — its flags, type, default, help, panel and
check — from which `takes` builds a command's typer parameters and `config_values` reads
config.toml's keys, so a bad value fails with the same one line wherever it comes from."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from difflib import get_close_matches
from typing import Any, Generic, TypeVar, cast

import typer

from fsd_chat.support.config import ConfigError, UserConfig
from fsd_chat.support.errors import FsdChatError, SettingsError
from fsd_chat.support.text import renamed_note, some

T = TypeVar("T")


S = TypeVar("S", bound=str)


F = TypeVar("F", bound=Callable[..., None])


@dataclass(frozen=True, slots=True)
class Option(Generic[T]):
    """One command-line option, declared once; the typer parameter and the config.toml key are both
    built from it.

    Attributes:
        name: The command's parameter name, and the config.toml key.
        flags: Its spellings, e.g. ("--threshold", "-T"); a boolean's read "--x/--no-x".
        kind: The value's type, str, int, float or bool: what typer converts the flag's text to and
            what config.toml's value must be (an integer is taken for a float).
        default: The value when neither the flag nor config.toml gives one.
        help: The help text.
        panel: The help panel it is listed under (None: the plain "Options").
        check: Validates a value of `kind`, from a flag and from config.toml alike, and returns it;
            raises an `FsdChatError` (one line, exit 2). None: any value of the type is accepted.
        choices: The values it takes, when they are few; shown in the help.
        required: The flag must be given. Otherwise a default of None makes None a value (the
            option has no default of its own, e.g. `--seed`).
    """

    name: str
    flags: tuple[str, ...]
    kind: type[T]
    default: T | None
    help: str
    panel: str | None = None
    check: Callable[[T], T] | None = None
    choices: tuple[str, ...] = ()
    required: bool = False

    def validate(self, value: T | None) -> T | None:
        """`value` once checked (None, the value of an option without a default, is not checked).

        Raises:
            FsdChatError: the check's error.
        """
        return value if value is None or self.check is None else self.check(value)

    def parameter(self) -> inspect.Parameter:
        """The typer parameter (keyword-only) of a command that takes this option."""
        info = typer.Option(
            ... if self.required else self.default,
            *self.flags,
            help=self.help,
            rich_help_panel=self.panel,
            metavar=f"[{'|'.join(self.choices)}]" if self.choices else None,
            callback=self.validate,
            show_default=self.default is not None,
        )
        annotation = self.kind | None if self.default is None and not self.required else self.kind
        return inspect.Parameter(
            self.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation
        )

    def of(self, values: Mapping[str, object]) -> T:
        """This option's value in a command's `values` (of its type, checked when parsed), for an
        option that always has one."""
        return cast(T, values[self.name])

    def get(self, values: Mapping[str, object]) -> T | None:
        """This option's value in a command's `values`, or None (an option without a default, not given)."""
        return cast(T | None, values[self.name])

    def from_config(self, value: object, where: str) -> T | None:
        """A config.toml value of this option, checked as its flag would be.

        Raises:
            ConfigError: a value of the wrong type, or one its check refuses.
        """
        number = self.kind is float and isinstance(value, int)
        # bool is an int in Python, but `threshold = true` is surely a mistake.
        if not (isinstance(value, self.kind) or number) or (
            isinstance(value, bool) and self.kind is not bool
        ):
            raise ConfigError(f"{where}: {self.name} = {value!r} has the wrong type")
        try:
            return self.validate(cast(T, float(cast(int, value)) if number else value))
        except FsdChatError as exc:
            # The key, since the check's message names the flag or the quantity ("draft length k").
            raise ConfigError(f"{where}: {self.name}: {exc}") from None

    def replace(self, **changes: Any) -> Option[T]:
        """A variant of this option (another default, or a longer help) for one command."""
        return dataclasses.replace(self, **changes)

    def listed(self, flag: str | None = None) -> Option[str]:
        """The comma-separated form of this option, as `bench` takes it to sweep over its values
        (which the sweep parses and checks): the same help, panel, default and choices (shown once,
        as the flag's metavar); `flag` (e.g. "--thresholds") renames it."""
        return Option(
            flag.removeprefix("--").replace("-", "_") if flag else self.name,
            (flag,) if flag else self.flags,
            str,
            None if self.default is None else str(self.default),
            f"{self.help} Comma-separated: each is measured.",
            self.panel,
            choices=self.choices,
        )


def takes(*options: Option[Any]) -> Callable[[F], F]:
    """Decorator: the command also takes these options, as keyword arguments after its own
    parameters (which come first in its help). Its `**values` then hold them by name."""

    def add(command: F) -> F:
        # eval_str: typer takes `__signature__` as it is, and the commands' annotations are strings.
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        command.__signature__ = inspect.Signature([*own, *(o.parameter() for o in options)])  # type: ignore[attr-defined]
        return command

    return add


def one_of(kind: str, choices: tuple[S, ...], renamed: Mapping[str, S] | None = None) -> Callable[[str], S]:
    """The check of an option whose value is one of `choices`; its error names the `kind` of value,
    and the current name of a former one (`renamed`: former -> current name).

    The returned check raises SettingsError for any other value.
    """

    def check(value: str) -> S:
        for choice in choices:
            if value == choice:
                return choice
        note = renamed_note(value, renamed or {})
        raise SettingsError(f"unknown {kind} {value!r}{note}; use {', '.join(choices)}")

    return check


FORMER_SETTINGS = {"compile_draft": "compile"}
"""config.toml settings renamed, and their new names: refused in one line naming the new one
(`compile_draft` became `compile` when the target's steps were compiled too)."""


def config_values(config: UserConfig, options: Iterable[Option[Any]]) -> dict[str, object]:
    """config.toml's settings, checked against the options it may set (those of the chat command).

    Raises:
        ConfigError: an unknown setting, a value of the wrong type, or one its option's check refuses.
    """
    known = {option.name: option for option in options}
    where = str(config.path)
    former = sorted(set(config.options) & FORMER_SETTINGS.keys())
    if former:
        raise ConfigError(f"{where}: the setting {former[0]} is now called {FORMER_SETTINGS[former[0]]}")
    unknown = sorted(set(config.options) - set(known))
    if unknown:
        # A misspelt name (`tempreature`) is named with the known one it is closest to.
        nearest = [
            f"{name} → {match[0]}" for name in unknown if (match := get_close_matches(name, known, n=1))
        ]
        hint = f" (did you mean {some(nearest)}?)" if nearest else ""
        raise ConfigError(
            f"{where}: unknown setting(s) {some(unknown)}{hint}; known: {', '.join(sorted(known))}"
        )
    return {name: known[name].from_config(value, where) for name, value in config.options.items()}
