"""``--compile``: torch.compile of the transformer blocks (default) or of the whole model.

``--compile-mode block`` (torchtitan's way) compiles each ``Block``'s ``forward`` (one
graph serves every layer: same code and shapes) and the loss (``GPT.cross_entropy``);
``--compile-mode model`` the GPT's whole ``forward``. Only the ``forward`` methods are
replaced, not the modules: state-dict keys stay the same (checkpoints move between
compiled and eager runs) and module hooks run eagerly around the compiled code, so
``--overlap-param-sync``'s forward pre-hooks go on the compiled modules
(``DistributedFusedAdam.attach(unit, unit=True)``), never inside them (every distinct
hook inside would make dynamo recompile, and 24 blocks exceed its recompile limit).
"""

from __future__ import annotations

import torch

MODES = ("block", "model")


def compile_model(model: torch.nn.Module, mode: str = "block",
                  **options) -> list[torch.nn.Module]:
    """Compile ``model``'s blocks or its whole forward in place; returns the modules
    whose ``forward`` is now compiled (the units to attach the optimizer's hooks to).

    ``options`` go to ``torch.compile`` (e.g. ``fullgraph``, ``backend``)."""
    if mode not in MODES:
        raise ValueError(f"compile mode must be one of {MODES}, got {mode!r}")
    if mode == "model":
        model.forward = torch.compile(model.forward, **options)
        return [model]
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError("compile mode 'block' needs a model with .blocks")
    for block in blocks:
        block.forward = torch.compile(block.forward, **options)
    if hasattr(model, "cross_entropy"):  # a method without modules: no hooks inside
        model.cross_entropy = torch.compile(model.cross_entropy, **options)
    return list(blocks)

