"""Warnings that point at the user's line, not at mpzero's."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

# Frames in these files sit between user code and mpzero's hooks and context managers
# (torch's autograd and module hooks, contextlib): skipped as mpzero's own are.
_INTERNAL = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                  for m in (sys.modules[__package__], torch)) + (
    os.path.abspath(contextlib.__file__),)


def user_stacklevel() -> int:
    """``stacklevel`` for :func:`warnings.warn` called from inside mpzero: the first
    frame outside mpzero, torch and ``contextlib`` (the user's call), counted from the
    caller of this function. Call it in the argument list of the ``warnings.warn`` call
    itself; the frame that calls ``user_stacklevel`` is level 1."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_INTERNAL):
        if frame.f_back is None:
            break
        frame = frame.f_back
        level += 1
    return level
