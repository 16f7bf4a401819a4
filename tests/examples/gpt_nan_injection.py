"""The GPT example with NaN losses on chosen iterations (a test's fault, not a flag of
the example):

    python tests/examples/gpt_nan_injection.py --nan-iters 2,5 [train.py flags]

Before the example's ``main`` runs, its ``train_step`` is wrapped: on the iterations of
``--nan-iters`` every micro-batch's loss is multiplied by NaN before the backward pass,
so the loss and the gradient norm are NaN on every rank, as a diverging run's are. The
rest is ``train.py`` itself (its fault guard, ``run_guarded`` and exit codes).
"""

from __future__ import annotations

import argparse
import inspect

from examples.gpt import faults, train


def install(nan_iters: set[int]) -> None:
    """Wrap ``train.train_step`` so the losses of ``nan_iters`` are NaN."""
    real = train.train_step
    signature = inspect.signature(real)

    def train_step(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["iteration"] not in nan_iters:
            return real(*args, **kwargs)
        model = bound.arguments["model"]
        forward = model.forward
        model.forward = lambda *a, **k: forward(*a, **k) * float("nan")
        try:
            return real(*args, **kwargs)
        finally:
            del model.forward  # the class's forward again

    train.train_step = train_step


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--nan-iters", required=True,
                   help="comma-separated iterations whose losses are NaN")
    ours, rest = p.parse_known_args(argv)
    install({int(v) for v in ours.nan_iters.split(",") if v.strip()})
    faults.run_guarded(train.main, rest)


if __name__ == "__main__":
    main()
