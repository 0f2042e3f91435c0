"""Value rules for config fields, declared on the field itself:

    batch_size: PositiveInt = 32  # per device
    dropout: Annotated[float, Rule(lambda v: 0 <= v < 1, "use a probability in [0, 1)")] = 0.0  # ...

`config.load()` checks every rule and names the key and the fix when one fails, so a new
setting is one line in its dataclass: type, rule, default and comment together. A check that
spans settings raises ConfigError, which every command reports the same way: one line per
problem and exit code 2 (`exit_on_user_error`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any

USER_ERROR_EXIT_CODE = 2  # a problem the user can fix, said in one line per problem


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says how."""

    prefix = "config error"

    def lines(self) -> str:
        """The message as the user sees it: one prefixed line per problem, ending in a newline."""
        return "".join(f"{self.prefix}: {line}\n" for line in str(self).splitlines())


def tell_user(error: ConfigError) -> int:
    """Write the error's lines to stderr and return the exit code of a user's error."""
    # one write with its newline: under torchrun (`python -u`) print writes the newline
    # separately, and the ranks' lines interleave
    sys.stderr.write(error.lines())
    sys.stderr.flush()
    return USER_ERROR_EXIT_CODE


@contextmanager
def exit_on_user_error():
    """A ConfigError inside ends the process with its lines and USER_ERROR_EXIT_CODE."""
    try:
        yield
    except ConfigError as error:
        raise SystemExit(tell_user(error)) from None


@dataclass(frozen=True)
class Rule:
    holds: Callable[[Any], bool]
    fix: str  # what the user should type instead, e.g. "use at least 1"


def at_least(low: float) -> Rule:
    return Rule(lambda value: value >= low, f"use at least {low}")


PositiveInt = Annotated[int, at_least(1)]
PositiveFloat = Annotated[float, Rule(lambda value: value > 0, "use a positive number")]
