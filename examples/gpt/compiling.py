"""``--compile``: torch.compile of the transformer blocks (default) or of the whole model.

- ``--compile-mode block`` (the default, as torchtitan does per block): each
  ``Block``'s ``forward`` is compiled, and the loss (``GPT.cross_entropy``: the
  vocab-parallel cross entropy and its mean, no module inside). All blocks have the
  same code and shapes, so one compilation serves every layer (dynamo recompiles at
  most once per distinct guard set); the embeddings, the final norm and the output
  layer stay eager. Eager, the cross entropy's chunk loop costs about 15 ms per
  iteration at the 1.3B shape on an H200 (vocab 50304, 16k tokens: 25 chunks of ten
  kernels each); compiled, inductor fuses each chunk's max, exp, sums and gradient
  (measured inside ``--compile-mode model``: about 5 ms; see docs/performance.md).
- ``--compile-mode model``: the GPT's ``forward`` as a whole; TP collectives and
  the cross entropy's chunk loop are graph breaks where dynamo cannot trace them.

Only the ``forward`` methods are replaced (an instance attribute), not the modules:
the state-dict keys stay the same (no ``_orig_mod.`` prefix, so checkpoints move
freely between compiled and eager runs), and the module's own hooks run eagerly
around the compiled code. So the optimizer's forward pre-hooks of
``--overlap-param-sync`` go on the compiled modules themselves
(``DistributedFusedAdam.attach(unit, unit=True)``, one hook gathering the whole block),
never inside them: there every distinct hook would make dynamo recompile (24 blocks
exceed its recompile limit and the blocks fall back to eager). DistributedFusedAdam's
per-parameter post-accumulate-grad hooks are unaffected: the parameters stay leaves of
the eager autograd graph, whose AccumulateGrad nodes fire the hooks after each compiled
backward region.
The optimizer step is not compiled.
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

