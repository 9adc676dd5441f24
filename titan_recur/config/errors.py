"""The config's error and the did-you-mean hint its messages share."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class ConfigError(ValueError):
    """A bad config file, key or value; the message is a single line meant for the user."""


def suggest(name: str, choices: Sequence[str]) -> str | None:
    """Closest spelling, else a choice that ends with the name (``steps`` -> ``training.steps``)."""
    close = difflib.get_close_matches(name, choices, n=1)
    return close[0] if close else next((c for c in choices if c.endswith("." + name)), None)
