"""Checkpoints of a training run: sharded, atomic, checked, and safe to load.

    <ckpt_dir>/latest                  "step_0000004": the last complete checkpoint
    <ckpt_dir>/step_0000004/           one checkpoint:
        .metadata, __<r>_0.distcp      model and optimizer, through torch.distributed.checkpoint
                                       (each rank writes its shards; any world reads them)
        meta.json                      step, world size, model config, run fingerprint,
                                       scheduler state, the results rows so far
        rng_rank<r>.json               each rank's RNG states
        manifest.json                  size and sha256 of every other file (written last)

Atomic: every file goes into step_N.tmp/, which becomes step_N/ by one rename once the manifest
is written, and only then does `latest` (replaced by rename too) name it; a crash at any moment
leaves the previous checkpoint loadable. Safe: nothing is unpickled but DCP's metadata, through
an unpickler that admits only DCP's own metadata classes, and non-tensor items load with
torch.load(weights_only=True); RNG states and counters are JSON. Checked: every file's size and
sha256 against the manifest before anything reads it, so damage is an error naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import re
import shutil
import warnings

import numpy as np
import torch
import torch.distributed as dist

from experiments.common.errors import InputError
from experiments.common.files import sha256_of
from model.sharding import experts_as_global, parameter_count

NAME = re.compile(r"^step_(\d{7})$")
MANIFEST, META = "manifest.json", "meta.json"


class CheckpointError(InputError):
    """A checkpoint that cannot be used; the message names the file or the mismatch."""


def step_name(step: int) -> str:
    return f"step_{step:07d}"


# ----- safe reading of DCP's metadata and non-tensor items -----------------------------------------
_DCP_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_DCP_META, n)
    for n in (
        "Metadata",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch.Size and torch dtypes; anything else is an error."""

    def find_class(self, module, name):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which DCP metadata never holds: refusing to load it")


def _reader(path: str):
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415
    from torch.distributed.checkpoint.metadata import StorageMeta  # noqa: PLC0415

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(os.path.join(self.path, ".metadata"), "rb") as f:
                md = _MetadataUnpickler(f).load()
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def read_data(self, plan, planner):
            try:
                return super().read_data(plan, planner)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - a damaged shard, whatever DCP's reader raised: named in one line
                raise CheckpointError(f"{os.path.join(self.path, self.culprit(plan))!r} cannot be read ({_first_line(e)})") from None

        def culprit(self, plan) -> str:
            """The file a failed read names: the first shorter than the items the metadata puts in
            it (a truncated shard), else the first the plan reads."""
            ends: dict[str, int] = {}
            for item in plan.items:
                info = self.storage_data[item.storage_index]
                ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
            for name in sorted(ends):
                path = os.path.join(self.path, name)
                if not os.path.exists(path) or os.path.getsize(path) < ends[name]:
                    return name
            return sorted(ends)[0]

    return SafeReader(path)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner  # noqa: PLC0415
    from torch.distributed.checkpoint._traverse import set_element  # noqa: PLC0415  (what DefaultLoadPlanner uses)

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            try:
                obj = torch.load(value, weights_only=True)  # plain numbers, tuples, dicts: never code
            except Exception as e:  # noqa: BLE001 - a crafted or damaged item: named, never run
                raise CheckpointError(f"the item {read_item.dest_index.fqn!r} is not plain data ({_first_line(e)})") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


# ----- files ----------------------------------------------------------------------------------------
def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _replace_text(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def rng_state() -> dict:
    """This process's RNG states as JSON-able lists (no pickles)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, state, gauss_py = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "python": [version, list(state), gauss_py],
    }


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(torch.tensor(s["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, state, gauss_py = s["python"]
    random.setstate((version, tuple(state), gauss_py))


# ----- save -------------------------------------------------------------------------------------------
def save(ckpt_dir: str, step: int, model, opt, meta: dict) -> str:
    """Collective: every rank writes its shards and RNG states; rank 0 the meta, the manifest, the
    rename and `latest`. `meta` must be JSON-able (step and world are added)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415  (a BaseException)
    from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415

    rank, world = dist.get_rank(), dist.get_world_size()
    final = os.path.join(ckpt_dir, step_name(step))
    tmp = final + ".tmp"
    err = None
    if rank == 0:
        try:
            os.makedirs(ckpt_dir, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a crash's leftovers
            os.makedirs(tmp)
        except OSError as e:
            err = _write_failure(e, tmp)
    err = _agree(err)
    if err is None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": experts_as_global(model_sd, model), "optim": experts_as_global(optim_sd, model)}
        try:
            written = dcp.save(state, checkpoint_id=tmp)  # collective: every rank gets any rank's failure
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a rank's write failed (a full disk): one line
            err = _write_failure(e, tmp)
        if err is None:
            check_complete(written, model, tmp)  # every rank has the metadata: all raise alike, before any rename
            try:
                _write_json(os.path.join(tmp, f"rng_rank{rank}.json"), rng_state())
            except OSError as e:
                err = _write_failure(e, tmp)
        err = _agree(err)
    if err is None and rank == 0:
        try:
            _write_json(os.path.join(tmp, META), {**meta, "step": step, "world_size": world})
            files = sorted(f for f in os.listdir(tmp) if f != MANIFEST)
            _write_json(
                os.path.join(tmp, MANIFEST),
                {f: {"bytes": os.path.getsize(os.path.join(tmp, f)), "sha256": sha256_of(os.path.join(tmp, f))} for f in files},
            )
            if os.path.exists(final):  # the same step saved again: the new one replaces it
                shutil.rmtree(final)
            os.replace(tmp, final)
            _replace_text(os.path.join(ckpt_dir, "latest"), step_name(step))
        except OSError as e:
            err = _write_failure(e, tmp)
    err = _agree(err)
    if err is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # the partial checkpoint's space back; `latest` still names the last good one
        raise CheckpointError(err)
    return final


FULL_BELOW = 1 << 20  # a disk with less free than this when a write failed: the failure is called a full disk


def _write_failure(e: BaseException, tmp: str) -> str:
    """One line for a checkpoint that could not be written: the first OS error of any rank (DCP
    gathers them), the disk named when it is full."""
    _, inner = _first_rank_failure(e)
    inner = inner or e
    while not isinstance(inner, OSError) and inner.__cause__ is not None:
        inner = inner.__cause__
    try:
        free = shutil.disk_usage(os.path.dirname(tmp) or ".").free
    except OSError:
        free = None
    full = free is not None and free < FULL_BELOW  # torch's serializer reports a short write as a bad position
    if isinstance(inner, OSError):
        full = full or inner.errno in (errno.ENOSPC, errno.EDQUOT)
        what = inner.strerror or str(inner)
    else:
        what = _first_line(inner)
    if full:
        what += f" (the disk is full: {free} bytes free)" if free is not None else " (the disk is full)"
    return (
        f"checkpoint {tmp!r} cannot be written: {what}; it was removed, and the checkpoints before it are intact: free space "
        f"there, or give another --ckpt-dir"
    )


class IncompleteCheckpoint(RuntimeError):
    """A checkpoint that would not hold the whole model: a bug in how the parameters are laid out,
    never a user's error (so not a CheckpointError): its traceback is kept."""


def check_complete(written, model, folder: str) -> None:
    """What DCP wrote (its Metadata) holds the whole model: each model tensor's chunks cover its
    global shape exactly once, and the global shapes add up to the parameter count of the model's
    config (every expert once). Raised before the checkpoint is renamed into place, so no layout
    can silently save part of the model (as one that saved one EP slot's experts under every
    slot's name once did)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415

    total = 0
    for fqn, md in written.state_dict_metadata.items():
        if not fqn.startswith("model.") or not isinstance(md, TensorStorageMetadata):
            continue
        size = int(np.prod(md.size, dtype=np.int64))
        chunks = sum(int(np.prod(c.sizes, dtype=np.int64)) for c in md.chunks)
        if chunks != size:
            raise IncompleteCheckpoint(
                f"checkpoint {folder!r}: {fqn} of shape {list(md.size)} was written as {len(md.chunks)} chunks of {chunks} "
                f"elements, not {size}: the ranks' shards do not tile it"
            )
        total += size
    want = parameter_count(model.cfg)
    if total != want:
        raise IncompleteCheckpoint(
            f"checkpoint {folder!r} holds {total:,} model parameters, the model has {want:,}: some ranks' parameters were "
            f"saved under another rank's name (expert parallelism degree {getattr(model, 'ep', 1)})"
        )


# ----- load -------------------------------------------------------------------------------------------
def checkpoints(ckpt_dir: str) -> list[str]:
    """Complete checkpoints (renamed from .tmp), newest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted((d for d in os.listdir(ckpt_dir) if NAME.match(d) and os.path.isdir(os.path.join(ckpt_dir, d))), reverse=True)


def latest(ckpt_dir: str) -> str:
    """The name `latest` holds, checked: a checkpoint folder directly inside ckpt_dir, nothing else."""
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(path):
        raise CheckpointError(f"--resume: no checkpoint in {ckpt_dir!r} (no 'latest' file)")
    with open(path) as f:
        name = f.read(64).strip()
    if not NAME.match(name):
        raise CheckpointError(f"{path!r} holds {name!r}; it must name a checkpoint folder of {ckpt_dir!r} like 'step_0000004'")
    if not os.path.isdir(os.path.join(ckpt_dir, name)):
        raise CheckpointError(f"{path!r} names {name!r}, which is not a folder in {ckpt_dir!r}")
    return name


def verify(folder: str, rank: int = 0, world: int = 1) -> None:
    """Every file of the checkpoint against the manifest (this rank checks every world-th file;
    the caller combines the ranks' verdicts). Raises CheckpointError naming the first bad file."""
    mpath = os.path.join(folder, MANIFEST)
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mpath!r} is missing or unreadable ({e}): the checkpoint is incomplete or damaged") from None
    shaped = isinstance(manifest, dict) and all(
        isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str) for v in manifest.values()
    )
    if not shaped:
        raise CheckpointError(f"{mpath!r} is not a manifest (an object of file: {{bytes, sha256}}): the checkpoint is damaged")
    present = sorted(f for f in os.listdir(folder) if f != MANIFEST)
    if sorted(manifest) != present:
        extra = sorted(set(present) - set(manifest if isinstance(manifest, dict) else ()))
        missing = sorted(set(manifest if isinstance(manifest, dict) else ()) - set(present))
        raise CheckpointError(f"checkpoint {folder!r} does not match its manifest: files missing {missing}, not listed {extra}")
    for i, name in enumerate(present):
        if i % world != rank:
            continue
        path, want = os.path.join(folder, name), manifest[name]
        size = os.path.getsize(path)
        if size != want.get("bytes"):
            raise CheckpointError(f"{path!r} has {size} bytes, the manifest says {want.get('bytes')}: truncated or damaged")
        if sha256_of(path) != want.get("sha256"):
            raise CheckpointError(f"{path!r} fails its sha256 check: the file is damaged")


def _agree(err: str | None) -> str | None:
    """The first error any rank found (every rank gets the same one), or None: ranks decide
    together, so no rank falls back alone and leaves the others waiting in a collective."""
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    return next((e for e in errs if e), None)


def _read_json(path: str):
    """A checkpoint's JSON file; CheckpointError naming it when it is not (binary, cut, damaged)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path!r} is not readable JSON ({_first_line(e)})") from None


def read_meta(folder: str) -> dict:
    meta = _read_json(os.path.join(folder, META))
    if not isinstance(meta, dict) or not {"step", "world_size", "model", "fingerprint"} <= set(meta):
        raise CheckpointError(f"{os.path.join(folder, META)!r} lacks the step, world size, model or run fingerprint")
    return meta


def check_compatible(meta: dict, expect: dict, folder: str) -> None:
    """One line naming what differs between the checkpoint's run and this one."""
    expect = json.loads(json.dumps(expect))  # as it reads back from JSON (tuples become lists)
    if meta["world_size"] != expect["world_size"]:
        raise CheckpointError(
            f"{folder!r} was written by {meta['world_size']} ranks and this run has {expect['world_size']}: resume on "
            f"{meta['world_size']} ranks (plans, data and results are per world size)"
        )
    for key, what in (("model", "holds another model"), ("fingerprint", "is of another run")):
        a, b = _flat(meta[key]), _flat(expect[key])
        diff = [f"{k}={a.get(k)!r} there, {b.get(k)!r} here" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        if diff:
            raise CheckpointError(f"{folder!r} {what}: {'; '.join(diff[:4])}")


def _flat(d: dict, prefix: str = "") -> dict:
    """{'workload': {'seed': 0}} -> {'workload.seed': 0}: a difference named by the setting that differs."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _checked(folder: str, expect: dict) -> tuple[dict, dict]:
    """This rank's checks of one checkpoint before anything is loaded: its share of the files
    against the manifest, the meta and the run it belongs to, DCP's metadata through the safe
    unpickler, and this rank's RNG states. (meta, rng states); CheckpointError naming the file."""
    rank, world = dist.get_rank(), dist.get_world_size()
    verify(folder, rank, world)
    meta = read_meta(folder)
    check_compatible(meta, expect, folder)
    path = os.path.join(folder, ".metadata")
    try:
        with open(path, "rb") as f:  # read here first: DCP would hide our error in its own
            _MetadataUnpickler(f).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle, whatever it raises: named in one line
        raise CheckpointError(f"{path!r} is not DCP metadata ({_first_line(e)})") from None
    rng = _read_json(os.path.join(folder, f"rng_rank{rank}.json"))
    if not isinstance(rng, dict) or not {"torch", "numpy", "python"} <= set(rng):
        raise CheckpointError(f"{os.path.join(folder, f'rng_rank{rank}.json')!r} holds no RNG states")
    return meta, rng


def _load_shards(folder: str, model, opt) -> str | None:
    """Collective: model and optimizer from the checkpoint's shards; None, or the error in one line
    (every rank gets DCP's failure, whichever rank's read failed)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415  (a BaseException)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415

    model_sd, optim_sd = get_state_dict(model, opt)
    # read through the experts' global view, which writes into model_sd's and optim_sd's tensors
    state = {"model": experts_as_global(model_sd, model), "optim": experts_as_global(optim_sd, model)}
    try:
        dcp.load(state, storage_reader=_reader(folder), planner=_planner())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP gathers every rank's failure into one exception
        return _dcp_failure(e, folder)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return None


def _first_rank_failure(e: BaseException) -> tuple[int | None, BaseException | None]:
    """(rank, exception) of the lowest rank whose failure DCP gathered into `e` (its `failures`),
    or (None, None) when `e` carries none."""
    failures = getattr(e, "failures", None) or {}
    for r in sorted(failures):
        inner = failures[r]
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return r, inner
    return None, None


def _dcp_failure(e: BaseException, folder: str) -> str:
    """One line from DCP's exception: the first rank's failure (ours name the file), else its first line."""
    r, inner = _first_rank_failure(e)
    if inner is not None:
        text = str(inner) if isinstance(inner, CheckpointError) else _first_line(inner)
        return f"checkpoint {folder!r}, rank {r}: {text}"
    return f"checkpoint {folder!r}: {_first_line(e)}"


def candidates(ckpt_dir: str, step: int | None) -> list[str]:
    """The checkpoints --resume tries, in order: `step`'s; or the one `latest` names, then every
    other complete one, newest first."""
    if step is not None:
        name = step_name(step)
        if not os.path.isdir(os.path.join(ckpt_dir, name)):
            raise CheckpointError(
                f"--resume-step {step}: no folder {name!r} in {ckpt_dir!r}; complete checkpoints: {checkpoints(ckpt_dir)}"
            )
        return [name]
    first = latest(ckpt_dir)
    return [first] + [n for n in checkpoints(ckpt_dir) if n != first]


def load(ckpt_dir: str, model, opt, expect: dict, step: int | None = None) -> dict:
    """Collective. Load the checkpoint of `step`, or the newest usable one of this run: `latest`
    first, then every other complete checkpoint newest first, skipping (with a warning naming
    each) the damaged ones and those of another run. Returns its meta (rows, scheduler state,
    step); restores this rank's RNG states. Every defect is one line naming the file; the ranks
    decide together which checkpoint to load."""
    errors = []
    for name in candidates(ckpt_dir, step):
        folder = os.path.join(ckpt_dir, name)
        try:
            meta, rng = _checked(folder, expect)
            err = None
        except CheckpointError as e:
            err = str(e)
        err = _agree(err) or _agree(_load_shards(folder, model, opt))
        if err is None:
            set_rng_state(rng)
            return {**meta, "path": folder}
        errors.append(err)
        if step is None and dist.get_rank() == 0:
            warnings.warn(f"checkpoint {name} is unusable ({err}); trying the one before", stacklevel=2)
    raise CheckpointError(
        errors[0] if len(errors) == 1 else f"no usable checkpoint in {ckpt_dir!r}: {errors[0]} (and {len(errors) - 1} more)"
    )


def refuse_others(ckpt_dir: str, expect: dict) -> None:
    """A new run (no --resume) writes its checkpoints only into a folder that holds none: another
    run's would be replaced and lose its `latest`, and this run's own would be overwritten. One
    line naming what is there and the flag to choose."""
    found = checkpoints(ckpt_dir)
    if not found:
        return
    try:
        meta = read_meta(os.path.join(ckpt_dir, found[0]))
        check_compatible(meta, expect, os.path.join(ckpt_dir, found[0]))
        whose = f"this run's own, up to step {meta['step']}: --resume continues it"
    except CheckpointError as e:
        whose = f"another run's ({e}): --resume would skip them"
    raise CheckpointError(
        f"--ckpt-dir {ckpt_dir!r} holds checkpoints ({', '.join(found[:3])}{', ...' if len(found) > 3 else ''}), {whose}; "
        f"a new run writes into a new --ckpt-dir, never over them"
    )
