"""The exception every layer raises for bad input or a bad environment.

``InputError`` (a ``ValueError``) means: the run cannot go on because of something the user gave or the
machine lacks (a corrupt file, a bad plan, an unwritable folder, a full disk). Its message starts with the
file or option at fault and says what is wrong. The command line turns it into exit status 2 and one line on
stderr, never a traceback. Any other exception is a bug in dynaquant.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input or environment; the message names the file (or option) and the problem."""
