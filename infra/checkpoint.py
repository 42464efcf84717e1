"""
Checkpoints: save, find and resume, for every strategy (train.py's engines: DeepSpeed ZeRO-2/3, FSDP2).

    save(engine, ckpt_dir, step, client_state, keep, rank, need_bytes)   all ranks; COMPLETE written last
    complete_checkpoints(ckpt_dir)                          [(step, tag)] that resume may take
    resume(engine, cfg, ckpt_dir, world, dtype, log)        load the newest complete one: (its step, samples seen),
                                                            (0, 0) for none, or (None, None) if the run is done
    to_universal(ckpt_dir, tag, log)                        ZeRO state -> DeepSpeed's universal checkpoint (once)

A checkpoint is out_dir/ckpt/step_NNNNNNN/ as the engine writes it, plus a COMPLETE marker written (atomically,
after every shard is flushed to disk) only once every rank has saved. Resume takes the newest complete one, so
a job killed mid-write resumes from the one before; nothing complete is ever rewritten.

Elastic resume: a checkpoint continues on another number of ranks or another dp x cp layout, as long as the global
batch (micro_batch x grad_accum x dp) is the same; the sampler draws sample g of the run's stream from (seed, g)
alone, so the next step reads the same samples whoever reads them. FSDP2's DCP checkpoint reshards on load (its
shards are recorded by global offsets). ZeRO-2/3 partition flat fp32 buffers by rank, so a ZeRO checkpoint written
by W ranks is converted once, by DeepSpeed's own ds_to_universal, into a universal checkpoint (one folder per
parameter: fp32 weight, exp_avg, exp_avg_sq, step) inside the checkpoint, step_N/universal/, which any number of
ranks loads (DeepSpeed's load_universal). A changed global batch is refused unless allow_batch_change=True: then the
data stream continues at the next unseen sample (samples_seen, kept in every checkpoint).

A full disk is an error, not damage: a checkpoint the file system cannot take (no space, over quota, read-only) stops
the run with StorageError, one line naming out_dir, the cause and the bytes a checkpoint needs, after the partial step
directory is removed (it holds space the operator needs back); every older complete checkpoint stays. Before writing,
every rank asks the file system for the room (the planner's checkpoint size) and they agree on the answer, so the
common case fails before a byte is written; a write that fails anyway (someone else filled the disk meanwhile) is
recognised by its error or, where torch's writer hides the errno ("unexpected pos ..."), by the file system's state.

Loading under ZeRO-3 runs collectives (the weights are gathered inside DeepSpeed's load), so a rank whose load fails
must not leave the others waiting in one: before any rank loads, each reads (unpickles, memory-mapped) the files it is
about to load, and all agree on the outcome; a rank that fails makes all of them fall back to the checkpoint before.

Stop signals become a checkpoint of this kind: stop.py.
"""
import errno
import json
import os
import shutil
import subprocess
import sys
import time

import torch

import configurator
from infra.distributed import on_rank_0
from infra.outputs import StorageError, fsync_dir, fsync_tree  # (checkpoint's own names too: tests wrap them)
from model import SIZES, head_counts


def read_marker(folder):
    """folder/COMPLETE as a dict, or None: there is none, or it does not parse (torn: a partial copy, a file system
    fault; save() writes it whole, by a rename). A checkpoint is complete only with a marker that parses."""
    try:
        with open(os.path.join(folder, "COMPLETE")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _step_dirs(ckpt_dir):
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted((int(t[5:]), t) for t in os.listdir(ckpt_dir) if t.startswith("step_") and t[5:].isdigit())


def complete_checkpoints(ckpt_dir):
    """[(step, tag)] of complete checkpoints (a COMPLETE marker that parses), oldest first."""
    return [(s, t) for s, t in _step_dirs(ckpt_dir) if read_marker(os.path.join(ckpt_dir, t)) is not None]


def torn_checkpoints(ckpt_dir):
    """[(step, tag)] whose COMPLETE marker is there but does not parse: not complete, and not a write that died
    part-way either (the marker is renamed into place whole): damaged since. resume() moves them aside."""
    return [(s, t) for s, t in _step_dirs(ckpt_dir)
            if os.path.exists(os.path.join(ckpt_dir, t, "COMPLETE")) and read_marker(os.path.join(ckpt_dir, t)) is None]


def move_aside(ckpt_dir, tag, why, log=print):
    """Rank 0: checkpoint `tag` that must not be resumed from, moved to damaged_TAG (never deleted: someone may
    repair it), with a WARNING saying why. Returns the new name."""
    aside, n = f"damaged_{tag}", 1
    while os.path.exists(os.path.join(ckpt_dir, aside)):  # damaged before, rewritten, damaged again
        n += 1
        aside = f"damaged_{tag}.{n}"
    os.replace(os.path.join(ckpt_dir, tag), os.path.join(ckpt_dir, aside))
    fsync_dir(ckpt_dir)
    log(f"WARNING: checkpoint {ckpt_dir}/{tag} {why}. Moved aside to {ckpt_dir}/{aside} (kept); trying the "
        f"checkpoint before it.")
    return aside


STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def free_bytes(path):
    """(bytes free to this user, read-only?) of the file system holding `path` (or its nearest existing parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, bool(st.f_flag & os.ST_RDONLY)


def room(ckpt_dir, need_bytes):
    """save()'s question before it writes: None if ckpt_dir's file system can take a checkpoint of need_bytes (and
    is writable), else why not."""
    return _lack_of_room(ckpt_dir, need_bytes)


def _lack_of_room(ckpt_dir, need_bytes):
    free, read_only = free_bytes(ckpt_dir)
    if read_only:
        return os.strerror(errno.EROFS)
    if free < need_bytes:
        return f"{os.strerror(errno.ENOSPC)}: {free / 1e9:.3f} GB free"
    return None


def storage_cause(exc, ckpt_dir, need_bytes):
    """Why a failed write is the file system's doing (a str), or None (another failure: a bug, a lost peer). The errno
    where the error carries one; torch's zip writer loses it ("unexpected pos ..."), so then the file system itself
    is asked, while the partial checkpoint still holds its space."""
    e = exc
    while e is not None:
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return os.strerror(e.errno)
        e = e.__cause__ or e.__context__
    text = str(exc)
    for code in STORAGE_ERRNOS:
        if os.strerror(code) in text:
            return os.strerror(code)
    return _lack_of_room(ckpt_dir, need_bytes)


def _storage_error(ckpt_dir, tag, why, need_bytes, written):
    what = "its partial directory was removed" if written else "nothing of it was written"
    return StorageError(
        f"checkpoint {tag} cannot be written to {ckpt_dir}: {why}. A checkpoint needs about {need_bytes / 1e9:.3f} GB "
        f"(the planner's size: fp32 weights and AdamW's two moments); {what}, and every older complete checkpoint is "
        f"kept: free space (or raise the quota, or point out_dir at writable storage with room), then run the same "
        f"command again to resume")


def save(engine, ckpt_dir, step, client_state, keep, rank, need_bytes=0):
    """All ranks: write checkpoint step_{step} (see the top of this file). need_bytes: the room to ask for first."""
    import torch.distributed as dist
    tag = f"step_{step:07d}"
    path = os.path.join(ckpt_dir, tag)
    if (step, tag) in complete_checkpoints(ckpt_dir):
        return  # already saved (a resumed run that had nothing left to do): never rewrite a good one
    # never save non-finite weights, nor start a checkpoint the file system has no room for: each rank checks, all
    # agree on the answers (one MIN all-reduce). The finite flag is built on the device (a bool per parameter read on
    # the host would sync once per parameter); the .item() below is the one sync
    device = next(engine.module.parameters()).device  # NCCL reduces only CUDA tensors
    flags = torch.ones(2, device=device)  # [every weight finite, room for the checkpoint]
    for p in local_params(engine):
        flags[0].mul_(torch.isfinite(p).all())
    no_room = room(ckpt_dir, need_bytes)
    if no_room:
        flags[1] = 0.0
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    finite, roomy = flags.tolist()
    if finite < 1:
        raise FloatingPointError(f"weights are non-finite after step {step}: checkpoint {tag} NOT written; "
                                 f"the newest good one is kept. Lower blr or raise warmup_steps.")
    if roomy < 1:
        e = _storage_error(ckpt_dir, tag, no_room or "no room on another rank's view of it", need_bytes, False)
        e.agreed = True
        raise e
    try:
        if rank == 0 and os.path.isdir(path):
            shutil.rmtree(path)  # a leftover of a write that died before it completed
        dist.barrier()
        engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state)
        dist.barrier()  # every rank has written its shard
        # ... and the shards are on disk before COMPLETE says so: a crash or power loss right after the marker must
        # not leave it pointing at data still in a page cache. One rank per node flushes every file (on a shared
        # file system each node's client flushes what that node wrote; locally one flush covers all ranks).
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            fsync_tree(path)
        dist.barrier()
        if rank == 0:
            _mark_complete(ckpt_dir, tag, step, client_state, keep)
    except Exception as e:
        why = storage_cause(e, ckpt_dir, need_bytes)
        if why is None:
            raise
        # this rank cannot finish the write. Its peers may be waiting in a barrier it will never reach: it stops the
        # run (the launcher ends the others), after removing the partial directory, which holds space the operator
        # needs back. It has no COMPLETE marker, so nothing would ever resume from it.
        if not os.path.exists(os.path.join(path, "COMPLETE")):
            shutil.rmtree(path, ignore_errors=True)
        raise _storage_error(ckpt_dir, tag, why, need_bytes, True) from None
    dist.barrier()


def _mark_complete(ckpt_dir, tag, step, client_state, keep):
    """Rank 0, once every shard is on disk: the COMPLETE marker (atomically), then the rotation of older ones."""
    import torch.distributed as dist
    path = os.path.join(ckpt_dir, tag)
    meta = {"step": step, "world": dist.get_world_size(), "dtype": client_state.get("dtype"),
            "config": client_state["config"], "stores": client_state.get("stores")}
    with open(os.path.join(path, "COMPLETE.tmp"), "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(path, "COMPLETE.tmp"), os.path.join(path, "COMPLETE"))
    fsync_dir(path)  # the rename itself
    fsync_dir(ckpt_dir)  # and the checkpoint's own entry, before older checkpoints are deleted
    done = complete_checkpoints(ckpt_dir)
    for _, old in done[:-keep]:
        shutil.rmtree(os.path.join(ckpt_dir, old), ignore_errors=True)


def local_params(engine):
    """This rank's own values of the weights, under any strategy: ZeRO-3 keeps them in p.ds_tensor (p itself
    is an empty placeholder between uses), FSDP2 in DTensor shards.
    ZeRO-3 pads every partition to ceil(numel / world): on the last ranks the tail of p.ds_tensor is padding that
    DeepSpeed allocates with torch.empty and never writes, so it holds whatever was in memory (NaN bit patterns
    now and then: a 3-rank run once refused its first checkpoint as "non-finite"). Only the real elements count:
      this rank's slice of the flat parameter = [r * part, (r + 1) * part) clipped to [0, p.ds_numel)."""
    for p in engine.module.parameters():
        if hasattr(p, "ds_tensor"):
            part = p.ds_tensor.numel()
            start = torch.distributed.get_rank(group=p.ds_process_group) * part
            yield p.ds_tensor.narrow(0, 0, max(0, min(part, p.ds_numel - start)))
        elif hasattr(p, "to_local"):
            yield p.to_local()
        else:
            yield p


def check_resumable(cfg, ckpt_dir):
    """Refuse (ConfigError) what must not start in ckpt_dir: a new run (resume=False) where an earlier run's
    checkpoints are, and any run where only checkpoints moved aside as damaged are left (starting again at step 0
    there would look like a resume to an auto-resuming launcher). resume(), the dry run and init_from call it."""
    done = complete_checkpoints(ckpt_dir)
    if done and not cfg["resume"]:
        raise configurator.ConfigError(f"{ckpt_dir} holds checkpoints of an earlier run and resume=False: use a new "
                                       f"out_dir (mixing two runs' checkpoints in one directory is never safe)")
    damaged = sorted(t for t in os.listdir(ckpt_dir) if t.startswith("damaged_")) if os.path.isdir(ckpt_dir) else []
    damaged += [t for _, t in torn_checkpoints(ckpt_dir)]  # (moved aside by resume before it looks)
    if damaged and not done and cfg["resume"]:
        raise configurator.ConfigError(f"{ckpt_dir} holds only damaged checkpoints ({', '.join(damaged)}: moved aside, "
                                       f"or with a COMPLETE marker that does not parse): repair one and rename it back "
                                       f"to step_N, or remove them to start again")
    return done


def resume(engine, cfg, ckpt_dir, world, dtype, log, stores=""):
    """Load the newest complete checkpoint in ckpt_dir that loads into `engine` (all ranks; rank 0 chooses).
    Returns (the step to continue from, samples of the stream already trained on): (0, 0) when there is nothing
    to resume, (None, None) when the newest already reached max_steps. Raises ConfigError, before anything is
    trained, when the checkpoint cannot be continued by this run. stores: which stores the training stream draws
    from now, and how (data.samplers' digest): a checkpoint written on others is resumed with a WARNING.

    A checkpoint marked COMPLETE can still fail to load: a shard damaged or truncated since (a file system
    fault, a partial copy). Then every rank says whether it loaded, all agree (one all-reduce), rank 0 names
    the rank, the error and the files that no longer read, moves the checkpoint aside to damaged_step_N (never
    deletes it: someone may repair it) and the ranks try the one before. Only when none loads is it an error:
    an auto-resuming launcher (HyperPod, sbatch --requeue) must not loop on one bad checkpoint. A checkpoint whose
    COMPLETE marker does not parse (torn_checkpoints) is moved aside the same way, before any is tried."""
    dist = torch.distributed
    on_rank_0(lambda: [move_aside(ckpt_dir, t, "has a COMPLETE marker that does not parse (torn since it was written: "
                                               "a partial copy, a file system fault)", lambda m: print(m, flush=True))
                       for _, t in torn_checkpoints(ckpt_dir)] if cfg["resume"] else None)
    check_resumable(cfg, ckpt_dir)
    # rank 0 lists the candidates and tells everyone: all ranks must try the same ones, in the same order
    done = [complete_checkpoints(ckpt_dir) if cfg["resume"] else []]
    dist.broadcast_object_list(done, src=0)
    moved = []
    for i, (_, tag) in enumerate(reversed(done[0])):
        got = _try_resume(engine, cfg, ckpt_dir, tag, world, dtype, log, newest=(i == 0), stores=stores)
        if got != "damaged":
            return got
        moved.append(tag)
    if moved:
        raise configurator.ConfigError(f"no complete checkpoint in {ckpt_dir} loads (moved aside as damaged_*: "
                                       f"{', '.join(moved)}): repair them, or start again in a new out_dir")
    return 0, 0


def _try_resume(engine, cfg, ckpt_dir, tag, world, dtype, log, newest, stores):
    """Check that checkpoint `tag` can be continued by this run and load it: (its step, samples seen), (None, None)
    (the newest is at max_steps: nothing to do), or "damaged" (it did not load on some rank; moved aside)."""
    dist = torch.distributed
    meta = read_marker(os.path.join(ckpt_dir, tag))
    if meta is None:
        raise configurator.ConfigError(f"rank {dist.get_rank()} cannot see {ckpt_dir}/{tag}: out_dir "
                                       f"must be on storage that every node shares")
    if newest and meta["step"] >= cfg["max_steps"] and not cfg.get("eval_only"):
        log(f"run already complete: {ckpt_dir}/{tag} is at step {meta['step']} of max_steps "
            f"{cfg['max_steps']}; raise --max_steps to go on")
        return None, None

    check_compatible(meta, cfg, world, str(dtype), f"{ckpt_dir}/{tag}")
    # first a cheap look at the files (rank 0, shared storage), so that a truncated shard is found before any rank
    # starts loading: under ZeRO-3 the ranks whose own shard is fine go on into collectives inside
    # load_checkpoint (gathering the unpartitioned weights) that a rank whose shard failed would never join
    bad = [unreadable_files(os.path.join(ckpt_dir, tag)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(bad, src=0)
    why, bad = (f"files that no longer read: {', '.join(bad[0])}" if bad[0] else None), bad[0]
    # another world size under ZeRO: DeepSpeed's universal checkpoint, converted once (FSDP2's DCP reshards itself)
    universal = not why and meta["world"] != world and cfg["strategy"] in ("zero2", "zero3")
    if universal:
        log(f"resuming {ckpt_dir}/{tag} (written by {meta['world']} rank{'s' * (meta['world'] != 1)}) on {world} "
            f"rank{'s' * (world != 1)} through its universal checkpoint")
    if not why and not universal:  # each rank reads the files it is about to load; all agree before any loads
        why = unloadable_own_files(os.path.join(ckpt_dir, tag), dist.get_rank())
    ok = _agreed(engine, why)
    why, client = (why, None) if not ok else _load(engine, cfg, ckpt_dir, tag, universal, log)
    ok = ok and _agreed(engine, why)
    if not ok and universal:  # the conversion is derived data: one that does not load (damaged since) is made again
        if dist.get_rank() == 0:
            log(f"the universal checkpoint of {ckpt_dir}/{tag} does not load ({why or 'on another rank'}): "
                f"converting again")
            shutil.rmtree(os.path.join(ckpt_dir, tag, "universal"), ignore_errors=True)
        dist.barrier()
        why, client = _load(engine, cfg, ckpt_dir, tag, universal, log)
        ok = _agreed(engine, why)
    if ok:
        log(f"resumed from {ckpt_dir}/{tag} (step {client['step']})")
        if meta.get("stores") and meta["stores"] != stores:
            log(f"WARNING: the training stores or sample_weighting differ from those of {tag} (a glob that finds "
                f"more stores now, another manifest): the run goes on, but not on the samples it would have had")
        old_batch = global_batch(meta["config"], meta["world"])
        seen = client.get("samples_seen", client["step"] * old_batch)
        if old_batch != global_batch(cfg, world):
            log(f"global batch {old_batch} -> {global_batch(cfg, world)} (allow_batch_change): the data stream goes "
                f"on at sample {seen} (samples seen), at step {client['step']}; lr = blr x the new batch / 256")
        return client["step"], seen
    reasons = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, why)
    if dist.get_rank() == 0:
        why_all = (f"files that no longer read: {', '.join(bad)}" if bad else
                   "; ".join(f"rank {r}: {w}" for r, w in enumerate(reasons) if w))
        move_aside(ckpt_dir, tag, f"is marked complete but does not load: {why_all}", lambda m: print(m, flush=True))
    dist.barrier()
    return "damaged"


def _load(engine, cfg, ckpt_dir, tag, universal, log):
    """This rank loads checkpoint `tag` (through its universal conversion, made first if need be): (None, the
    client state) or (why it did not load, None). Why names the file: DeepSpeed's errors rarely do (seen: a bare
    "AssertionError:"), so the files its checkpoint engine reads are noted as it reads them, and the last one is the
    culprit, whether it failed to read or its contents failed DeepSpeed's checks after it was read."""
    from torch.distributed.checkpoint.api import CheckpointException  # DCP's: a BaseException, not an Exception
    load_dir, load_tag = ckpt_dir, tag
    if universal:
        load_dir, load_tag = os.path.join(ckpt_dir, tag), os.path.basename(to_universal(ckpt_dir, tag, log))
    files = []  # [name, read through?] of each file DeepSpeed's checkpoint engine reads, in order (FSDP2: none; a
    # universal load reads its parameters' files past it, so there the last one noted need not be the culprit)
    reader = None if universal else getattr(engine, "checkpoint_engine", None)
    if reader is not None:
        def noting(path, *args, **kwargs):
            files.append([os.path.relpath(path, os.path.join(ckpt_dir, tag)), False])
            out = read(path, *args, **kwargs)
            files[-1][1] = True
            return out
        read, reader.load = reader.load, noting  # (on this instance, for this load: put back below)
    try:
        if universal:  # DeepSpeed's "checkpoint": {"load_universal": true}, for this one load
            engine._config.load_universal_checkpoint = True
        path, client = engine.load_checkpoint(load_dir, tag=load_tag)
        if path is None or client is None:
            return "the engine found no checkpoint there", None
        if universal and cfg["strategy"] == "zero3":
            _repair_zero3_universal_load(engine, os.path.join(load_dir, load_tag))
        return None, client
    except (Exception, CheckpointException) as e:  # damage the cheap look cannot see (the unpickler, DCP...)
        if isinstance(e, CheckpointException) and e.failures:  # DCP: every rank's failure, tracebacks in text
            e = e.failures.get(torch.distributed.get_rank(), next(iter(e.failures.values())))[0]
        if not files:
            return describe(e), None
        name, through = files[-1]
        return f"{name}{' was read, but its contents did not load' if through else ' does not read'}: " \
               f"{describe(e)}", None
    finally:
        if universal:
            engine._config.load_universal_checkpoint = False
        if reader is not None:
            reader.load = read


def describe(e):
    """An exception in one line: its type and message. An assert without a message (DeepSpeed has many) says what
    was asserted, the statement and where it is; without its source, that a file failed DeepSpeed's check."""
    import linecache
    import traceback
    msg = " ".join(str(e).split())
    if isinstance(e, AssertionError) and not msg:
        frames = traceback.extract_tb(e.__traceback__)
        if frames and frames[-1].line:
            f = frames[-1]  # the statement may run over lines: as many as make it whole Python
            lines = [linecache.getline(f.filename, f.lineno + i).strip() for i in range(8)]
            statement = next((" ".join(lines[:n]) for n in range(1, 9) if _whole(" ".join(lines[:n]))), f.line)
            where = f.filename.split("site-packages/")[-1] if "site-packages/" in f.filename else \
                os.path.basename(f.filename)
            msg = f"`{statement}` failed ({where}:{f.lineno})"
        else:
            msg = "a file failed DeepSpeed's check"
    return f"{type(e).__name__}: {msg}"[:300]


def _whole(source):
    try:
        compile(source, "<assert>", "exec")
        return True
    except SyntaxError:
        return False


def _agreed(engine, why):
    """All ranks agree whether every rank loaded (a rank that loaded must not train alone): one MIN all-reduce."""
    ok = torch.tensor([0.0 if why else 1.0], device=next(engine.module.parameters()).device)
    torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
    return ok.item() == 1.0


def to_universal(ckpt_dir, tag, log):
    """All ranks: the universal checkpoint of the ZeRO checkpoint ckpt_dir/tag, at ckpt_dir/tag/universal, made once
    by rank 0 with DeepSpeed's own converter (python -m deepspeed.checkpoint.ds_to_universal). Returns its path.

    Published like a checkpoint: the converter writes universal.tmp/, every file is flushed, a COMPLETE marker goes
    in last and only then is the folder renamed to universal/. A crash part-way leaves universal.tmp/, which the
    next launch removes and converts again. Of the checkpoint's own files nothing is changed (the converter also
    writes step_N/latest_universal, a pointer for its own loader, removed at once: a crash in between leaves that
    small file, which nothing reads)."""
    src = os.path.join(ckpt_dir, tag)
    out = os.path.join(src, "universal")

    def convert():
        if read_marker(out) is not None:
            return  # converted by an earlier launch (a torn marker: converted again)
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # an earlier conversion that died part-way
        log(f"converting {src} to a universal checkpoint (DeepSpeed's ds_to_universal), once")
        t0 = time.time()
        workers = max(1, min(8, os.cpu_count() or 1))  # processes that read the ranks' shards side by side
        rc, tail = _run_showing_progress(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", src, "--output_folder",
             tmp, "--inject_missing_state", "--num_extract_workers", str(workers), "--num_merge_workers",
             str(max(1, workers // 2))])
        if rc != 0:
            raise configurator.ConfigError(
                f"DeepSpeed's ds_to_universal could not convert {src} (exit {rc}: {tail or 'no output'}). The "
                f"checkpoint's own files are untouched; they may be damaged in a way the file check before loading "
                f"cannot see, or this DeepSpeed may not read them: resume it on the number of ranks that wrote it, or "
                f"move it aside to resume from the one before")
        if os.path.exists(os.path.join(src, "latest_universal")):
            os.remove(os.path.join(src, "latest_universal"))  # the converter's pointer for its own loader: unused
        shutil.rmtree(out, ignore_errors=True)  # one without COMPLETE (a partial copy): the rename needs the name
        fsync_tree(tmp)
        with open(os.path.join(tmp, "COMPLETE"), "w") as f:
            json.dump({"source": tag}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        fsync_dir(src)
        log(f"converted in {time.time() - t0:.1f} s: {out}")

    on_rank_0(convert)
    return out


def _run_showing_progress(cmd):
    """Run DeepSpeed's converter (minutes for a large model), its progress shown: its tqdm bars (stderr) pass through
    to ours as they come, on a terminal as they are, elsewhere one line per redraw and at most one every 30 s
    (tqdm's own TQDM_MININTERVAL; MAE_PROGRESS_EVERY_S as in infra/progress.py), so that a log shows it alive
    without thousands of half-lines. Its stdout is kept for the error. Returns (exit code, its last non-empty line)."""
    import collections
    import threading
    tty = sys.stderr.isatty()
    env = dict(os.environ)
    if not tty:
        env.setdefault("TQDM_MININTERVAL", os.environ.get("MAE_PROGRESS_EVERY_S", "30"))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    tail = collections.deque(maxlen=64)  # the last chunks of its stderr, for the error message

    def relay():
        while chunk := p.stderr.read1(65536):
            tail.append(chunk)
            sys.stderr.buffer.write(chunk if tty else chunk.replace(b"\r", b"\n"))
            sys.stderr.buffer.flush()
    t = threading.Thread(target=relay, daemon=True)
    t.start()
    out = p.stdout.read()
    rc = p.wait()
    t.join()
    text = (b"".join(tail) + out).decode(errors="replace").replace("\r", "\n")
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return rc, lines[-1] if lines else ""


def _repair_zero3_universal_load(engine, folder):
    """Two flaws of DeepSpeed's ZeRO-3 universal loader (0.19.8, stage3.py, load_hp_checkpoint_state_from_checkpoint_
    dir_stage3) with more than one parameter group or sub-group, found by the elastic-resume tests (the run resumed on another
    world size drifted from the uninterrupted one by 2.5e-4 two steps on; with these repairs it follows it exactly):
      * it gives every group's state THE SAME `step` tensor, which AdamW increments in place once per group (and per
        sub-group: ZeRO-3 steps a group of more than sub_group_size elements, 1e9, in parts): with our two groups
        (decay / no decay) the count ran twice as fast, and Adam's bias correction with it;
      * it copies the first group's hyperparameters into every group, so the no-decay group (biases, norms, cls and
        mask tokens) got weight decay.
    Each group gets its own step tensor back, and its own hyperparameters from the converted optimizer_state.pt."""
    for state in engine.optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    saved = torch.load(os.path.join(folder, "zero", "optimizer_state.pt"), map_location="cpu", weights_only=False,
                       mmap=True)["param_groups"]
    for group, was in zip(engine.optimizer.param_groups, saved):
        group.update({k: v for k, v in was.items() if k != "params"})


# the config keys model.build_model reads, for both models and for each task's: a checkpoint or a model file carries
# its run's config, and one written before a key existed cannot rebuild its model (check_model_config refuses it)
MODEL_KEYS = ("model_size", "heads", "dec_heads", "crop", "patch", "task")
TASK_KEYS = {"mae": ("mask_ratio", "norm_pix_loss", "mask_strata", "cp"),
             "segment": ("classes", "pos_weight", "seg_head", "seg_features")}


def check_model_config(c, where):
    """Raise ConfigError, one line, unless config `c` (what the checkpoint or model file at `where` carries) has every
    key its model is built from (MODEL_KEYS and its task's TASK_KEYS) and a model size model.py has (SIZES)."""
    missing = [k for k in MODEL_KEYS + TASK_KEYS.get(c.get("task"), ()) if k not in c]
    if missing:
        one = len(missing) == 1
        raise configurator.ConfigError(
            f"{where}: its config has no {', '.join(missing)} (written before {'the key' if one else 'those keys'} "
            f"existed): add {'it' if one else 'them'}, with the value its run used, to the config it carries (a "
            f"checkpoint's COMPLETE, a model file's 'config') and try again")
    if c["model_size"] not in SIZES:  # (a file of a size this code no longer has, or another branch's)
        raise configurator.ConfigError(f"{where}: its model_size {c['model_size']!r} is not one this code knows "
                                       f"({', '.join(SIZES)}): use the code that wrote it")


def global_batch(c, world):
    """Samples per optimizer step of a run of config `c` on `world` ranks: micro_batch x grad_accum x dp."""
    return c["micro_batch"] * c["grad_accum"] * (world // (c.get("cp") or 1))


def check_compatible(meta, cfg, world, dtype, where):
    """Raise ConfigError unless the checkpoint whose COMPLETE marker is `meta` can be continued by a run of config
    `cfg` on `world` ranks computing in `dtype` (a str like 'torch.bfloat16'; None: not compared, as in launch.sh's
    pre-flight, which cannot always tell what 'auto' will resolve to on the nodes). Needs no engine: resume
    calls it on every rank, train.py's dry run before torchrun starts. Another world size or dp x cp layout is
    fine (elastic resume, see the top of this file); the global batch must stay unless allow_batch_change."""
    # what the run's function depends on must not change under it: the model, the data stream, the masks
    # (mask_ratio; mask_strata, whose default follows cp) and the compute dtype (resolved: 'auto' is bf16 on
    # GPU). A checkpoint whose config lacks a key of its model is refused (check_model_config); older checkpoints
    # lack some other keys: those are not compared.
    check_model_config(meta["config"], f"checkpoint {where}")

    def resolved(c, dt):
        return {**{k: c.get(k) for k in ("model_size", "patch", "seed", "strategy", "crop", "mask_ratio")},
                # the heads split the same weights into another function
                "heads, dec_heads": head_counts(c),
                # the task and what it learns
                "task": c["task"], **({k: c.get(k) for k in ("label_var", "classes")} if c["task"] == "segment" else {}),
                "mask_strata": (c["mask_strata"] or c["cp"]) if c["task"] == "mae" else None,  # (a segmenter masks none)
                # what is held out: training never touched it, and must not start to (nor a validation of trained
                # inlines pass for held out, e.g. an eval_only with another val_frac)
                "val_paths or val_frac": (c.get("val_paths") or c.get("val_frac")) if "val_frac" in c else None,
                "dtype": dt}
    was = resolved(meta["config"], meta.get("dtype"))
    now = resolved(json.loads(json.dumps(cfg)), dtype)  # tuples come back as lists
    for key in was:
        if was[key] is not None and now.get(key) is not None and was[key] != now[key]:
            hint = ("; the masks follow mask_strata, which defaults to cp: a run that will change cp sets "
                    "mask_strata (a multiple of every cp it will use) from its start" if key == "mask_strata" else "")
            raise configurator.ConfigError(
                f"checkpoint {where} was trained with {key}={was[key]!r}, this run has {now[key]!r}: "
                f"set it back to resume, or use another out_dir to start a new run{hint}")
    old, new = global_batch(meta["config"], meta["world"]), global_batch(cfg, world)
    if old != new and not cfg.get("allow_batch_change") and not cfg.get("eval_only"):  # (evaluation: any batch)
        c = meta["config"]
        raise configurator.ConfigError(
            f"checkpoint {where} was trained with global batch {old} (micro_batch {c['micro_batch']} x grad_accum "
            f"{c['grad_accum']} x dp {meta['world'] // (c.get('cp') or 1)}), and this run's is {new} (micro_batch "
            f"{cfg['micro_batch']} x grad_accum {cfg['grad_accum']} x dp {world // cfg['cp']}): "
            + (f"set micro_batch x grad_accum = {old // (world // cfg['cp'])} to continue the same run"
               if old % (world // cfg["cp"]) == 0 else
               f"no micro_batch x grad_accum gives {old} on dp {world // cfg['cp']}")
            + f", or set allow_batch_change=True to go on with batch {new} from the next unseen sample")


def unloadable_own_files(path, rank):
    """Why this rank could not load the checkpoint files it is about to load (its own shards and the ones every rank
    reads), or None. Each is unpickled memory-mapped (the tensors' bytes are not read): what raises here is what would
    raise inside the engine's load, where under ZeRO-3 the other ranks would already wait in its collectives.
      DeepSpeed ZeRO-2:  mp_rank_00_model_states.pt (every rank), zero_pp_rank_R_mp_rank_00_optim_states.pt (rank R)
      DeepSpeed ZeRO-3:  zero_pp_rank_R_mp_rank_00_model_states.pt and ..._optim_states.pt (rank R)
      FSDP2 (DCP):       its load is collective itself (a failing rank's error reaches every rank): nothing here."""
    for name in sorted(os.listdir(path)):
        if name.endswith(".pt") and (name == "mp_rank_00_model_states.pt" or f"zero_pp_rank_{rank}_" in name):
            try:
                torch.load(os.path.join(path, name), map_location="cpu", weights_only=False, mmap=True)
            except Exception as e:
                return f"{name}: " + " ".join(f"{type(e).__name__}: {e}".split())[:200]
    return None


def unreadable_files(path):
    """The files of a checkpoint that no longer read as what they claim to be: torch.save's zip archives (.pt)
    whose directory at the end is gone (a truncated copy), DCP shards (.distcp) shorter than the byte ranges its
    .metadata gives them, and empty files. A cheap check (no tensor is read), to name the culprit."""
    import zipfile
    bad, ends = [], {}
    meta_path = os.path.join(path, ".metadata")
    if os.path.exists(meta_path):
        try:
            from torch.distributed.checkpoint import FileSystemReader
            for info in FileSystemReader(path).read_metadata().storage_data.values():
                ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        except Exception:
            bad.append(".metadata")
    for name in sorted(os.listdir(path)):
        f = os.path.join(path, name)
        if not os.path.isfile(f) or name in ("COMPLETE", ".metadata"):
            continue
        size = os.path.getsize(f)
        if size == 0 or (name.endswith(".pt") and not zipfile.is_zipfile(f)) or size < ends.get(name, 0):
            bad.append(name)
    return bad
