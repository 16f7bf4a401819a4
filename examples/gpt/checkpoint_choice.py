"""Which checkpoint a run resumes from: the newest one that verifies on every rank.

Each rank checks the files it would read (checksums, and that each unpickles as plain
data) and the ranks agree on the worst verdict (one all-reduce): a damaged checkpoint
is skipped for an older one (SKIP, every rank prints why); a sound one made for another
run (the torch format at another TP size) stops the search (REFUSE), since resuming
from an older checkpoint that happens to fit would silently lose the newer progress.
``latest`` is never trusted. See docs/reliability.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from mpzero.checkpoint import safe_load

from .checkpointing import (
    DCP_DIR,
    CheckpointError,
    CheckpointMismatch,
    collective_device,
    distributed,
    iteration_dir,
    list_checkpoints,
    ranks,
    read_manifest,
    restores_rng,
    sha256_file,
    tp_mismatch,
)

SKIP, REFUSE = 1, 2  # what a checkpoint that cannot be loaded makes the search do


def _verify_local(ckpt: Path, r: dict) -> tuple[int, str] | None:
    """``(SKIP or REFUSE, why)`` when this rank cannot load ``ckpt``; None when it can.

    Checks the files this rank reads: their checksums, and that each unpickles as plain
    data (``torch.load(weights_only=True)``, tensors mapped, not read; DCP's metadata
    through the restricted unpickler). Rank 0 also checks that every file of the
    manifest exists. A damaged or refused file: SKIP (the search goes on to an older
    checkpoint); a sound checkpoint saved for another TP size in the torch format:
    REFUSE (the search stops)."""
    try:
        manifest = read_manifest(ckpt)
        mismatch = tp_mismatch(ckpt, manifest, r)
        if mismatch:
            return REFUSE, mismatch
        if manifest.get("ckpt_format") == "torch_dist":  # every rank reads any file:
            names = [n for k, n in enumerate(sorted(manifest["files"]))  # split the checks
                     if n.startswith(DCP_DIR + "/") and k % r["world"] == r["rank"]]
        else:
            names = [f"model_tp{r['tp_rank']:02d}.pt"]
        rng = f"rng_rank{r['rank']:05d}.pt"
        if restores_rng(manifest, r) and rng in manifest["files"]:
            names.append(rng)
        for name in names:
            path = ckpt / name
            expected = manifest["files"].get(name)
            if expected is None:
                return SKIP, f"{name} is not listed in {ckpt}/manifest.json (incomplete save)"
            if not path.exists():
                return SKIP, f"{path} is missing"
            if sha256_file(path) != expected:
                return SKIP, f"checksum mismatch for {path} (truncated, corrupted or half-written)"
            if name.endswith(".pt"):
                # The manifest is not signed: a replaced file comes with its checksum.
                # Unpickling it with weights_only (tensors mapped, not read) tells a
                # file that would run code from data before anything is loaded.
                safe_load.torch_load(path, mmap=True)
        if manifest.get("ckpt_format") == "torch_dist":  # DCP's metadata, read safely
            safe_load.read_dcp_metadata(ckpt / DCP_DIR / ".metadata")
        if r["rank"] == 0:
            for name in manifest["files"]:
                if not (ckpt / name).exists():
                    return SKIP, f"{ckpt / name} is missing (listed in the manifest)"
    except (CheckpointError, safe_load.UnsafeCheckpointError) as e:
        return SKIP, str(e)
    except (OSError, RuntimeError, KeyError, TypeError, AttributeError) as e:
        return SKIP, f"{ckpt}: unreadable ({e!r})"
    return None


def _decide(ckpt: Path, r: dict) -> tuple[int, list[str]]:
    """Collective: ``(0, [])`` when ``ckpt`` loads on every rank, else the worst verdict
    of any rank (SKIP or REFUSE) and the ranks' reasons (each once, prefixed with the
    ranks that gave it when there are several ranks). Each rank prints its own reason;
    rank 0 prints all of them."""
    mine = _verify_local(ckpt, r)
    code = torch.tensor([mine[0] if mine else 0], device=collective_device())
    if distributed():
        dist.all_reduce(code, op=dist.ReduceOp.MAX)
    verdict = int(code.item())
    if not verdict:
        return 0, []
    if distributed():  # the ranks' reasons (strings from our own processes)
        whys: list = [None] * dist.get_world_size()
        dist.all_gather_object(whys, mine[1] if mine else None)
    else:
        whys = [mine[1] if mine else None]
    by_reason: dict[str, list[int]] = {}
    for k, w in enumerate(whys):
        if w:
            by_reason.setdefault(w, []).append(k)
    reasons = [w if len(whys) == 1 else
               f"rank{'s' if len(ks) > 1 else ''} {','.join(map(str, ks))}: {w}"
               for w, ks in by_reason.items()]
    if mine:
        print(f"rank {r['rank']}: {'refusing' if mine[0] == REFUSE else 'skipping'} "
              f"checkpoint {ckpt}: {mine[1]}", flush=True)
    if r["rank"] == 0 and not mine:
        print(f"skipping checkpoint {ckpt}: it does not verify on every rank: "
              + "; ".join(reasons), flush=True)
    elif r["rank"] == 0 and len(reasons) > 1:
        print(f"  (checkpoint {ckpt}, all ranks: {'; '.join(reasons)})", flush=True)
    return verdict, reasons


def choose_checkpoint(load_dir: str | Path, iteration: int | None = None) -> Path | None:
    """The checkpoint to resume from (collective: every rank gets the same answer).

    Without ``iteration``: the newest ``iter_*`` directory that verifies on every rank
    (:func:`find_loadable_checkpoint`). With it: that iteration, which must verify.
    None when ``load_dir`` holds no checkpoint (or does not exist)."""
    if iteration is None:
        return find_loadable_checkpoint(load_dir)
    ckpt = iteration_dir(load_dir, iteration)
    verdict, reasons = _decide(ckpt, ranks())
    if verdict == REFUSE:
        raise CheckpointMismatch("; ".join(reasons))
    if verdict:
        raise CheckpointError(f"--load-iteration {iteration}: {ckpt} cannot be loaded: "
                              + "; ".join(reasons))
    return ckpt


def find_loadable_checkpoint(load_dir: str | Path) -> Path | None:
    """The newest checkpoint of ``load_dir`` that verifies on EVERY rank (collective:
    every rank gets the same answer). Damaged ones are reported with their path and the
    reason (rank 0 prints every rank's) and skipped. A sound one that does not fit this
    run (the torch format at another TP size) stops the search: a
    :class:`~checkpointing.CheckpointMismatch` on every rank, rather than an older checkpoint that
    happens to fit. None when ``load_dir`` has no checkpoint at all; a
    :class:`CheckpointError` on every rank when there are checkpoints but none
    verifies everywhere."""
    r = ranks()
    candidates = list_checkpoints(load_dir)
    if distributed():  # every rank walks the same list (rank 0's view of the directory)
        box = [[str(c) for c in candidates]]
        dist.broadcast_object_list(box, src=0)
        candidates = [Path(c) for c in box[0]]
    reasons = []
    for ckpt in candidates:
        verdict, why = _decide(ckpt, r)
        if not verdict:
            return ckpt
        if verdict == REFUSE:
            raise CheckpointMismatch("; ".join(why) + " (not reaching past it to an older "
                                     "checkpoint)")
        reasons.append(f"{ckpt}: {'; '.join(why)}")
    if candidates:
        raise CheckpointError(f"no checkpoint in {load_dir} verifies on every rank: "
                              + "; ".join(reasons))
    return None
