"""
What a command writes: whole or not at all, and never over what it did not write.

    refuse_inside(out, inputs, option)          an output equal to or inside one of the command's inputs: refused
    refuse_owned(path, option)                  an output inside a run's ckpt/ (its rotation deletes what is there)
    refuse_same(path, other, option, other_option)  two outputs of one command at one path: refused
    target(path, what, found, settings, overwrite, option)  -> "new" | "same" | "replace", or refused
    inspect_file(path, read)                    what `found` is for a local file: None, Foreign(...) or its record
    check_folder(path, option)                  a local output's folder exists and takes files
    replacing(path) as tmp                      a file written under a temporary name beside path, then renamed
    writes(what, kept)                          a write's OSError (no space, read-only, ...) as one StorageError line
    save_figure(fig, path, record)              a PNG written so, with `record` in a text chunk; figure_record()
    fsync_dir(path), fsync_tree(path)           flushed to disk: entries, files
    move_into_place(work, out)                  a store built at OUT.partial renamed to OUT, over one --overwrite replaces
    nothing_at(path)                            a store's path holds nothing (absent, or an empty folder)
    Markers(store, prefix)                      the pieces of a long output already written (resume skips them)

Every command that writes a file or a store asks target() first, before any work: export's model file, the library
index's manifest, embed's features store and picture, reconstruct's figure, label_efficiency's folder. The rules,
for the path a user gives (or a command's default):
  * nothing there (or an empty file or folder): it is written;
  * this command's own output, made from the same inputs with the same settings (what the output records of
    itself: a model file its checkpoint, a manifest its stores, a features store its attributes, a figure a PNG
    text chunk): "same", resumed or replaced as the command documents;
  * its own output made from other inputs or settings: refused, one line naming the difference, unless --overwrite
    ("replace");
  * anything else (a run's log.jsonl, a survey, a folder of the user's): refused, with --overwrite too. A command
    never replaces what it did not write; --overwrite only lets it replace its own kind of output.
refuse_inside() refuses an output at or inside an input (a survey store, a run's checkpoints): writing there would
change what is being read. refuse_owned() refuses an output inside what something else rotates: any training run's
ckpt/ folder (a relaunch's checkpoint rotation removes whole step_N/ folders, and whatever a user put in them),
whichever run it is and however the command was given its model; check_folder() and check_dir() apply it to every
local output. A local output whose folder does not exist is refused too (a typo'd folder must not
quietly become a new one), unless the command makes its own default folder.

A file is written under a hidden temporary name beside it (.NAME.tmpPID: no glob of *.pt or *.png finds it),
flushed, and renamed over the target, one atomic step: a crash leaves the old file or the new one, never half of
either, and a failed write removes its temporary. A store that is resumed (embed's) is built under NAME.partial
and renamed when complete (on an object store, which has no rename, in place: scripts/embed.py says how).
"""
import contextlib
import errno
import json
import os

from configurator import ConfigError


class StorageError(OSError):
    """The file system or object store refused a write (no space, over quota, read-only, no permission): not the
    input, not damage, not a bug: exit code 4 (infra/cli.py), one line. A checkpoint's (infra/checkpoint.py) or a
    command's output's (writes()). agreed: every rank raises it (found before the write), so rank 0 alone says it."""
    agreed = False


@contextlib.contextmanager
def writes(what, kept):
    """with writes("tile 3 of the prediction", "the tiles before it are kept in OUT.partial: ..."): an OSError of the
    write (ENOSPC, EDQUOT, EROFS, EACCES, a folder where a file goes; an object store's PermissionError) becomes one
    StorageError line naming what was being written, the cause, what is kept and how to go on."""
    try:
        yield
    except StorageError:
        raise
    except OSError as e:
        raise StorageError(f"writing {what} failed: {' '.join(str(e).split())}; {kept}") from e


class Foreign(str):
    """What a path holds when it is not the command's own output: a description ("a folder", "a file that is not a
    model file"), for the refusal."""


def is_remote(path):
    """An object-store or other fsspec URL (s3://...), not a local path (file:// is local)."""
    return "://" in str(path) and not str(path).startswith("file://")


def local(path):
    return str(path)[len("file://"):] if str(path).startswith("file://") else str(path)


def _norm(path):
    """A path to compare: local ones resolved (symbolic links, .., relative to here), URLs without trailing '/'."""
    return str(path).rstrip("/") if is_remote(path) else os.path.realpath(local(path))


def refuse_inside(out, inputs, option="--out"):
    """ConfigError if `out` is one of `inputs` or lies inside one (stores are folders: out would be written into it)."""
    o = _norm(out)
    for i in inputs:
        if not i:
            continue
        n = _norm(i)
        if o == n or o.startswith(n.rstrip("/") + "/"):
            raise ConfigError(f"{option}={out!r} is {'the input' if o == n else 'inside the input'} {i!r}: nothing is "
                              f"ever written into what is being read; choose a path outside it")


CKPT = "ckpt"  # a training run's checkpoint folder, out_dir/ckpt (infra/checkpoint.py): its step_N/ are rotated


def _is_run_ckpt(folder):
    """Whether `folder` is a training run's checkpoint folder: named ckpt/, and beside a run's log.jsonl or LEASE,
    or holding step_N/ checkpoints."""
    if os.path.basename(folder) != CKPT or not os.path.isdir(folder):
        return False
    parent = os.path.dirname(folder)
    return (any(os.path.exists(os.path.join(parent, n)) for n in ("log.jsonl", "LEASE")) or
            any(n.startswith("step_") and n[5:].isdigit() for n in os.listdir(folder)))


def refuse_owned(path, option="--out"):
    """ConfigError if the local `path` is, or lies inside, a training run's ckpt/ folder (at any depth): the run's
    next checkpoint rotation (or its relaunch's) removes whole step_N/ folders with whatever was written into them.
    Object-store paths pass (training writes checkpoints to a file system only)."""
    if is_remote(path):
        return
    p = _norm(path)
    up = p
    while True:
        if _is_run_ckpt(up):
            run = os.path.dirname(up)
            raise ConfigError(f"{option}={path!r} lies inside the checkpoint folder {up!r} of the run {run!r}: its "
                              f"checkpoint rotation removes whole step_N/ folders, and what was written into them "
                              f"with them; write it outside ckpt/ (e.g. into {run!r} itself)")
        nxt = os.path.dirname(up)
        if nxt == up:
            return
        up = nxt


def refuse_same(path, other, option, other_option):
    """ConfigError if two outputs of one command are one path, or the first lies inside the second (a --picture
    at --out: the store is a folder, and the figure would be written over it after the whole run)."""
    a, b = _norm(path), _norm(other)
    if a == b or a.startswith(b.rstrip("/") + "/"):
        raise ConfigError(f"{option}={path!r} is {'the same path as' if a == b else 'inside'} {other_option}="
                          f"{other!r}: each output needs a path of its own; give {option} another one")


def check_folder(path, option="--out"):
    """A local output's folder must exist and take files, and not lie in a run's ckpt/ (refuse_owned): ConfigError
    naming the folder and the fix otherwise."""
    refuse_owned(path, option)
    folder = os.path.dirname(os.path.abspath(local(path)))
    if not os.path.isdir(folder):
        up = folder
        while up and not os.path.exists(up):
            up = os.path.dirname(up)
        if up and not os.path.isdir(up):
            raise ConfigError(f"{option}={path!r} lies under {up!r}, which is a file, not a folder: choose another "
                              f"path")
        raise ConfigError(f"{option}={path!r}: the folder {folder!r} does not exist: create it first (mkdir -p "
                          f"{folder}), or correct the path")
    if not os.access(folder, os.W_OK | os.X_OK) or _read_only(folder):
        raise ConfigError(f"{option}={path!r}: the folder {folder!r} is read-only here: choose a writable place")


def check_dir(path, option="out_dir"):
    """A folder a run writes into (train.py's out_dir, label_efficiency's --out): a local path (or a shared file
    system's), existing as a folder or creatable, writable. ConfigError naming the problem and the fix otherwise."""
    if not str(path).strip():
        raise ConfigError(f"{option} is empty: give the folder to write into, e.g. --{option.lstrip('-')}=out/run1")
    if is_remote(path):
        raise ConfigError(f"{option}={path!r}: checkpoints and logs are written to a file system (local, or one every "
                          f"node shares: FSx for Lustre, NFS), not to an object store; give a path")
    p = os.path.abspath(local(path))
    refuse_owned(p, option)
    if os.path.exists(p) and not os.path.isdir(p):
        raise ConfigError(f"{option}={path!r} is a file, not a folder: give a folder (it is created if need be)")
    up = p
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise ConfigError(f"{option}={path!r} lies under {up!r}, which is a file, not a folder: give another path")
    if not os.access(up, os.W_OK | os.X_OK) or _read_only(up):
        where = "" if up == p else f" (its nearest existing folder {up!r} is)"
        raise ConfigError(f"{option}={path!r} is read-only here{where}: point {option} at writable storage")


def check_run_dir(path):
    """train.py's out_dir: check_dir's checks, and its ckpt/ (not check_dir's: that one refuses a run's ckpt/ to other
    writers): a folder, not a file, and writable (a read-only one, say a copy kept from another machine, would lose
    every step until the first checkpoint write failed)."""
    check_dir(path, "out_dir")
    ckpt = os.path.join(path, "ckpt")
    if os.path.exists(ckpt) and not os.path.isdir(ckpt):
        raise ConfigError(f"out_dir/ckpt={ckpt!r} is a file, not a folder: the run's checkpoints go there; move the "
                          f"file away, or choose another out_dir")
    if os.path.isdir(ckpt) and (not os.access(ckpt, os.W_OK | os.X_OK) or _read_only(ckpt)):
        raise ConfigError(f"out_dir/ckpt={ckpt!r} is read-only here, and the run's checkpoints go there: make it "
                          f"writable, or choose another out_dir")


def _read_only(path):
    return bool(os.statvfs(path).f_flag & os.ST_RDONLY)


def inspect_file(path, read, what):
    """What a local file target holds: None (nothing, or an empty file), the record read(path) returns for this
    command's own output (`what`, e.g. "a model file"), or Foreign(what it is) when read(path) gives None or fails."""
    path = local(path)
    if not os.path.lexists(path):
        return None
    if os.path.isdir(path):
        return Foreign("a folder") if os.listdir(path) else None
    if os.path.getsize(path) == 0:
        return None  # (an empty file: nothing to lose)
    try:
        record = read(path)
    except Exception:  # noqa: BLE001 - whatever the file is, it is not this command's output
        record = None
    return Foreign(f"a file that is not {what}") if record is None else record


def target(path, what, found, settings, overwrite=False, option="--out"):
    """May a command write its output (`what`, e.g. "a model file") at `path`? found: what is there (None, Foreign,
    or the settings the output there records); settings: what this run would record. Returns "new" (nothing
    there), "same" (its own output with these settings: resume or replace, as the command documents) or "replace"
    (its own output made otherwise, and --overwrite); raises ConfigError (one line) in every other case."""
    if found is None:
        return "new"
    if isinstance(found, Foreign):
        raise ConfigError(f"{option}={path!r} exists and is {found}: a command never writes over what it did not "
                          f"write (with --overwrite neither); choose another path, or move that one away yourself")
    was, now = _leaves(_plain({k: found.get(k) for k in settings})), _leaves(_plain(settings))
    differ = [k for k in now if was.get(k) != now[k]]
    if not differ:
        return "same"
    if overwrite:
        return "replace"
    shown = "; ".join(f"{k} {_short(was.get(k))}, not {_short(now[k])}" for k in differ[:3])
    raise ConfigError(f"{option}={path!r} holds {what} made with other inputs or settings ({shown}): choose another "
                      f"path, or add --overwrite to replace it")


def _plain(v):
    return json.loads(json.dumps(v, default=str))  # tuples as lists, as a record read back has them


def _leaves(d, prefix=""):
    """{dotted key: value} of a record's leaves (a model's checkpoint shows as model.checkpoint)."""
    out = {}
    for k, v in (d or {}).items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _short(v):
    s = repr(v)
    return s if len(s) <= 160 else s[:157] + "..."


def fsync_dir(path):
    """Flush a directory's entries (new names, renames). Some network file systems refuse fsync on a
    directory (EINVAL): they commit entries on their own, so that is not an error."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def fsync_tree(path):
    """Flush every file under `path`, then every directory's entries."""
    for root, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


@contextlib.contextmanager
def replacing(path):
    """with replacing(path) as tmp: write the file `tmp` (its folder is path's); when the block ends without an
    error, tmp is flushed and renamed over path (atomically), else removed. Crash-safe: path is the old file or the
    new one, never a part of either."""
    path = local(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(folder)  # the rename itself


def move_into_place(work, out):
    """A store built at `work` (OUT.partial) renamed to `out`, over the store of other settings that --overwrite
    replaces (moved aside first, removed after): `out` is the old store or the new one, never a part of either."""
    import shutil
    aside = None
    if os.path.lexists(out):
        aside = f"{out.rstrip('/')}.replaced{os.getpid()}"
        os.replace(out, aside)
    os.replace(work, out)
    fsync_dir(os.path.dirname(os.path.abspath(out)))
    if aside:
        shutil.rmtree(aside, ignore_errors=True)


def nothing_at(path, storage_options=None):
    """True when a store's path holds nothing to protect: it does not exist (local or object store) or is an empty
    folder."""
    if is_remote(path):
        import fsspec
        fs, p = fsspec.url_to_fs(path, **(storage_options or {}))
        return not fs.exists(p)
    return not os.path.lexists(path) or (os.path.isdir(path) and not os.listdir(path))


class Markers:
    """The pieces of a long output already written (embed's windows, predict's tiles): one small object per piece
    under `prefix` of a Zarr store (local or s3://), so that a restart skips them. Listed once, at the start (one LIST
    on S3, not a request per piece): the ranks that share a piece must all list before any of them can mark one."""

    def __init__(self, store, prefix):
        from zarr.core.sync import sync
        self.store, self.prefix = store, prefix

        async def listed():
            return {k async for k in store.list_prefix(prefix)}
        self.done = sync(listed())

    def key(self, idx):
        return self.prefix + ".".join(map(str, idx))

    def __contains__(self, idx):
        return self.key(idx) in self.done

    def mark(self, idx):
        from zarr.core.buffer import default_buffer_prototype
        from zarr.core.sync import sync
        sync(self.store.set(self.key(idx), default_buffer_prototype().buffer.from_bytes(b"1")))


PNG_KEY = "seismic-mae"  # the text chunk a figure's record is kept in


def save_figure(fig, path, record=None, **kw):
    """fig.savefig as a PNG at path, whole or not at all (replacing), with `record` (a dict: what made it) in a PNG
    text chunk that figure_record() reads back."""
    meta = {PNG_KEY: json.dumps(record, default=str)} if record is not None else None
    with replacing(path) as tmp:
        fig.savefig(tmp, format="png", metadata=meta, **kw)


def figure_record(path):
    """The record save_figure() wrote into the PNG at path, or None (not a PNG, or one without it)."""
    from PIL import Image  # (matplotlib's own dependency: figures need it anyway)
    with Image.open(path) as im:
        text = getattr(im, "text", {}).get(PNG_KEY)
    return json.loads(text) if text else None


def figure_target(path, settings, overwrite=False, option="--out", made_by=""):
    """target() for a PNG figure of a command: its record is the PNG's text chunk; `made_by` one of its settings."""
    what = f"a figure of {made_by or 'this command'}"
    return target(path, what, inspect_file(path, figure_record, what), settings, overwrite, option)
