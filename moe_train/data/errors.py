"""The one error type of the data layer: bad or missing data found before training starts."""

from __future__ import annotations


class DataError(Exception):
    """A problem with the recipe's data (missing, truncated or corrupt files, token ids beyond the vocab).

    The message is one line and names the file or field, so that the CLI can print it as is and exit 2.
    """
