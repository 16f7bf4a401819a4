"""Warnings that point at the user's line, not at mpzero's."""

from __future__ import annotations

import os
import sys

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def user_stacklevel() -> int:
    """``stacklevel`` for :func:`warnings.warn` called from inside mpzero: the first
    frame outside the mpzero package (the user's call), counted from the caller of
    this function."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(
            _PACKAGE_DIR + os.sep):
        frame = frame.f_back
        level += 1
    return level
