"""
The model file: one file of weights out of any complete checkpoint, whatever wrote it (ZeRO-2, ZeRO-3, FSDP2; any
rank count), and everything that reads one back. `python -m scripts.export OUT_DIR` writes one (scripts/export.py).

    find_checkpoint(out_dir, tag=None)            -> (ckpt_dir, tag, meta)   ckpt_dir = out_dir/ckpt, meta = COMPLETE
    state_dict_from_checkpoint(out_dir, tag=None) -> (state_dict, meta)      the MAE's full fp32 weights, in memory
    export(out_dir, tag=None, out=None, encoder_only=False, overwrite=False) -> path   the file
    read_model_file(path, map_location="cpu")     -> (state_dict, meta)      a file's weights, format checked
    load(path_or_obj, map_location="cpu")         -> (model, meta)           the config's MAE with the file's weights
    init_from(model, cfg, log)                    train.py's init_from=PATH (init_source, check_init, warm_start)

The file is one torch.save of tensors and plain types only, so it loads with torch.load(path, weights_only=True)
(no code runs on load, no DeepSpeed or distributed setup is needed):

    {"format": "seismic-mae", "version": 1,
     "model": {"blocks.0.qkv.weight": fp32 tensor, ...},   the MAE's plain module names, fp32, contiguous, CPU
     "config": the run's config (COMPLETE's: plain types, tuples as lists),
     "step": the optimizer steps it was trained for, "encoder_only": bool,
     "source": {"strategy": ..., "world": ..., "tag": ..., "dtype": the compute dtype it was trained in}}

The weights are the fp32 master weights: a bf16 run computes with bf16 copies of them, which would lose the low
bits that the next updates build on (and that a fine-tuning run would start from). None of the shard merging
is ours: ZeRO checkpoints go through DeepSpeed's own zero_to_fp32 (which reads the fp32 partitions out of the
optimizer files and leaves the Adam moments on disk: it memory-maps the files and drops them), FSDP2's through
torch.distributed.checkpoint in one process, asking only for the model's entries, so the optimizer state (two
fp32 moments per weight: 13 GB at 1.6 B parameters) is never read. Host memory: the model once for DCP, twice
for ZeRO (DeepSpeed concatenates each rank's partition into one flat vector; each tensor is then copied out of
it, so that a file never carries the vector's other bytes: an encoder-only file would hold the decoder too).
"""
import contextlib
import json
import math
import os
import sys
import warnings

import torch

import configurator
from infra import checkpoint, distributed, outputs
from infra.progress import CountingWrites, Progress
from model import Segmenter, build_model, head_counts

FORMAT, VERSION = "seismic-mae", 1
# the models' top-level parts (model.Encoder, MAE and Segmenter). Every weight belongs to exactly one of them: a part
# added to a model later must be added here, or export fails loudly instead of silently dropping it or keeping it.
ENCODER = ("patch_embed", "cls_token", "blocks", "norm")
DECODER = ("decoder_embed", "mask_token", "decoder_blocks", "decoder_norm", "decoder_pred", "seg_pred", "head")
PRETRAINING_ONLY = ("mask_token", "decoder_pred")  # what fine-tuning (task="segment") does not use


# -----------------------------------------------------------------------------
# 1. which checkpoint


def normalise_tag(tag):
    """'step_0000500', 'step_500', '500' or 500 -> 500."""
    s = str(tag)
    digits = s[len("step_"):] if s.startswith("step_") else s
    if not digits.isdigit():
        raise configurator.ConfigError(f"tag {tag!r} is not a checkpoint tag: give step_N or N "
                                       f"(step_0000500, step_500 and 500 name the same checkpoint)")
    return int(digits)


def find_checkpoint(out_dir, tag=None):
    """The newest complete checkpoint of the run in out_dir (or the one `tag` names): (ckpt_dir, tag, meta), where
    ckpt_dir is out_dir/ckpt (the directory DeepSpeed calls checkpoint_dir), the checkpoint is ckpt_dir/tag, and
    meta is its COMPLETE marker (step, world, dtype, config) plus "tag". Only complete checkpoints are taken: a
    step_* directory without COMPLETE may be a write that died half-way (checkpoint.save writes the marker last)."""
    if os.path.isfile(out_dir):
        raise configurator.ConfigError(f"{out_dir} is a file, not a run's out_dir (to check a model file: "
                                       f"python -m scripts.export --check={out_dir})")
    ckpt_dir = os.path.join(out_dir, "ckpt")
    if not checkpoint.complete_checkpoints(ckpt_dir) and checkpoint.complete_checkpoints(out_dir):
        ckpt_dir = out_dir  # given OUT_DIR/ckpt itself
    done = checkpoint.complete_checkpoints(ckpt_dir)
    if not done:
        partial = sorted(t for t in os.listdir(ckpt_dir) if t.startswith("step_")) if os.path.isdir(ckpt_dir) else []
        why = (f" ({', '.join(partial)} without COMPLETE: writes that did not finish)" if partial else
               "" if os.path.isdir(ckpt_dir) else f" ({ckpt_dir} does not exist)")
        raise configurator.ConfigError(
            f"no complete checkpoint in {ckpt_dir}{why}: a checkpoint counts once its COMPLETE marker is written, "
            f"after every rank has saved; train.py writes one every ckpt_interval steps and at the end of a run "
            f"(bash launch.sh CONFIG --out_dir={out_dir}). Give the run's out_dir")
    torn = checkpoint.torn_checkpoints(ckpt_dir)
    if tag is None:
        _, tag = done[-1]
        newer = [t for s, t in torn if s > done[-1][0]]
        if newer:
            print(f"WARNING: {ckpt_dir}/{newer[-1]}'s COMPLETE marker does not parse (torn since it was written): not "
                  f"taken; {tag} is the newest complete checkpoint (train.py moves the torn one aside when it resumes)",
                  file=sys.stderr, flush=True)
    else:
        want = normalise_tag(tag)
        found = [t for s, t in done if s == want]
        if not found:
            there = os.path.isdir(os.path.join(ckpt_dir, f"step_{want:07d}"))
            why = (" (its COMPLETE marker does not parse: torn since it was written)" if want in dict(torn) else
                   " (it is there without COMPLETE: its write did not finish)" if there else "")
            raise configurator.ConfigError(
                f"no complete checkpoint step_{want:07d} in {ckpt_dir}{why}; "
                f"complete ones: {', '.join(t for _, t in done)}")
        tag = found[0]
    meta = checkpoint.read_marker(os.path.join(ckpt_dir, tag))
    if meta is None:  # (gone or torn between the listing and now: another process at work in out_dir)
        raise configurator.ConfigError(f"cannot read {ckpt_dir}/{tag}/COMPLETE any more: is a run moving it? try again")
    checkpoint.check_model_config(meta.get("config") or {}, f"{ckpt_dir}/{tag}")
    return ckpt_dir, tag, {**meta, "tag": tag}


# -----------------------------------------------------------------------------
# 2. the full fp32 state dict, through DeepSpeed's or PyTorch's own readers


def part(key):
    """'encoder' or 'decoder': which half of the MAE a weight belongs to."""
    top = key.split(".")[0]
    if top in ENCODER:
        return "encoder"
    if top in DECODER:
        return "decoder"
    raise configurator.ConfigError(f"weight {key!r} belongs to neither export.ENCODER nor export.DECODER: a part "
                                   f"added to model.MAE or model.Segmenter must be added to one of them")


def _zero_state_dict(ckpt_dir, tag):
    """ZeRO-2/3: DeepSpeed merges the fp32 partitions of every rank's optimizer file. Its progress talk goes to
    stderr, so that our stdout carries only the file's path. lazy_mode: a ZeRO-3 weight comes back as DeepSpeed's
    GatheredTensor, whose slices are read out of the memory-mapped files only when _own() asks for it, one weight
    at a time in _read_checkpoint's loop, where the progress is shown (eagerly DeepSpeed gathers them all first,
    silently: the long part of a large export). The same tensors either way; ZeRO-2's are views of the merged
    vector in both modes."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede `import deepspeed`
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    with contextlib.redirect_stdout(sys.stderr):
        return get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag=tag, lazy_mode=True)


def _dcp_state_dict(path, template):
    """FSDP2: torch.distributed.checkpoint in this one process (no process group: DCP then loads locally, no_dist),
    into full-size plain tensors. Only the "model" entries are asked for, so only their bytes are read: DCP reads
    each requested shard's byte range and nothing else (FileSystemReader.read_data), the "optim" entries stay on
    disk. The checkpoint's own metadata is checked first: the same weights as the config's MAE, stored in fp32
    (FSDP2 keeps the fp32 parameters as its shards and casts only for compute; a bf16 entry would mean we were
    about to export a rounded copy)."""
    import torch.distributed.checkpoint as dcp
    stored = {k[len("model."):]: v for k, v in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
              if k.startswith("model.")}
    _check_names(stored.keys(), template.keys(), path)
    for k, v in stored.items():
        if tuple(v.size) != tuple(template[k].shape) or v.properties.dtype != torch.float32:
            raise configurator.ConfigError(f"{path}: weight {k} is stored as {v.properties.dtype} {tuple(v.size)}, the "
                                           f"config's MAE has float32 {tuple(template[k].shape)}")
    state = {"model": {k: torch.empty(v.shape, dtype=torch.float32) for k, v in template.items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


def _check_names(have, want, where):
    have, want = set(have), set(want)
    if have != want:
        raise configurator.ConfigError(
            f"{where} does not hold the config's MAE: missing {sorted(want - have)[:5]}, unexpected "
            f"{sorted(have - want)[:5]} (a checkpoint of another model, or model.py changed since it was written)")


def _own(t):
    """An fp32 CPU tensor with a storage of its own (a view of DeepSpeed's flat vector would save the vector)."""
    if not isinstance(t, torch.Tensor):  # DeepSpeed's lazy GatheredTensor (ZeRO-3): its slices gathered now
        t = t.contiguous()
    t = t.detach().to("cpu").contiguous()  # DeepSpeed's come with requires_grad (views of the optimizer's params)
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def state_dict_from_checkpoint(out_dir, tag=None):
    """The full fp32 weights of the run's newest complete checkpoint (or `tag`), with the plain module names of
    the MAE (blocks.0.qkv.weight ...), as fp32 contiguous CPU tensors in the MAE's own order. Returns (state_dict,
    meta): meta is the checkpoint's COMPLETE marker (step, world, dtype, config) plus "tag" and "strategy"."""
    return _read_checkpoint(*find_checkpoint(out_dir, tag))


def _read_checkpoint(ckpt_dir, tag, meta):
    from torch.distributed.checkpoint.api import CheckpointException
    cfg = meta["config"]
    strategy = cfg.get("strategy", "zero2")  # runs before FSDP2 existed were all ZeRO-2
    if strategy not in ("zero2", "zero3", "fsdp2"):
        raise configurator.ConfigError(f"{ckpt_dir}/{tag} was written by strategy {strategy!r}; scripts/export.py reads "
                                       f"zero2, zero3 and fsdp2 checkpoints")
    path = os.path.join(ckpt_dir, tag)
    template = build_model(cfg, device="meta").state_dict()  # names and shapes only
    try:
        sd = _dcp_state_dict(path, template) if strategy == "fsdp2" else _zero_state_dict(ckpt_dir, tag)
        _check_names(sd.keys(), template.keys(), path)
        out = {}
        # weight by weight (ZeRO-3's gathered out of the shards here: the files are read now, so this stays inside
        # the reader's error handling), counted in bytes on stderr (infra/progress.py): a weight's size varies
        # by thousands between a bias and a block's MLP, bytes give a true ETA
        with Progress(total=sum(v.nbytes for v in template.values()), desc="export: reading weights", unit="B",
                      unit_scale=True) as bar:
            for k, v in template.items():
                t = _own(sd.pop(k))  # pop: what is copied out can be freed
                if t.dtype != torch.float32 or tuple(t.shape) != tuple(v.shape):
                    raise configurator.ConfigError(f"{path}: weight {k} came back as {t.dtype} {tuple(t.shape)}, "
                                                   f"the config's MAE has float32 {tuple(v.shape)}")
                out[k] = t
                bar.update(t.nbytes)
    except configurator.ConfigError:
        raise
    except (Exception, CheckpointException) as e:  # the unpickler, the zip reader, DCP: a damaged file, any way
        # a COMPLETE checkpoint that cannot be read has lost a file since (or was copied in part). DCP wraps the
        # reader's exception, with its traceback in the text: the original says what is missing
        if isinstance(e, CheckpointException) and e.failures:
            e = next(iter(e.failures.values()))[0]
        msg = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        raise configurator.ConfigError(f"cannot read checkpoint {path} ({strategy}): {msg} (a file missing or "
                                       f"damaged? export another one with --tag)") from None
    return out, {**meta, "strategy": strategy}


# -----------------------------------------------------------------------------
# 3. the file


def export(out_dir, tag=None, out=None, encoder_only=False, overwrite=False):
    """Write the newest complete checkpoint of out_dir (or `tag`) as one model file; returns its path. Default:
    OUT_DIR/model_step_NNNNNNN.pt (..._encoder.pt with encoder_only). The file is written under a temporary name
    in the same directory, flushed to disk, then renamed over the final name (one atomic step: infra/outputs.py): a
    crash leaves either no file or the whole file. Where a file is already, it is replaced only when it is a model
    file exported from the same checkpoint (the same weights again), or, with overwrite, from another one; anything
    else (a run's log, another kind of file) is never written over. Checked before the checkpoint is read."""
    ckpt_dir, tag, meta = find_checkpoint(out_dir, tag)
    name = f"model_{tag}{'_encoder' if encoder_only else ''}.pt"
    out = out or os.path.join(os.path.dirname(os.path.abspath(ckpt_dir)), name)  # out_dir (also if given .../ckpt)
    if os.path.isdir(out):
        out = os.path.join(out, name)
    outputs.refuse_inside(out, [ckpt_dir])  # (the checkpoints' rotation deletes what is in there)
    outputs.check_folder(out)
    source = {"ckpt_dir": os.path.abspath(ckpt_dir), "tag": tag}
    settings = {"checkpoint": source, "config": meta["config"], "step": int(meta["step"]),
                "encoder_only": bool(encoder_only)}
    found = outputs.inspect_file(out, made_from, "a model file")
    if isinstance(found, dict) and found["checkpoint"].get("ckpt_dir") is None:  # exported before sources were
        found["checkpoint"] = {**found["checkpoint"], "ckpt_dir": source["ckpt_dir"]}  # kept: by config and step
    outputs.target(out, "a model file", found, settings, overwrite)
    sd, meta = _read_checkpoint(ckpt_dir, tag, meta)
    if encoder_only:
        sd = {k: v for k, v in sd.items() if part(k) == "encoder"}
    else:
        for k in sd:
            part(k)  # every weight accounted for
    obj = {"format": FORMAT, "version": VERSION, "model": sd, "config": meta["config"], "step": int(meta["step"]),
           "encoder_only": bool(encoder_only),
           "source": {"strategy": meta["strategy"], "world": int(meta["world"]), "tag": tag,
                      "dtype": meta.get("dtype"), "ckpt_dir": source["ckpt_dir"]}}
    with outputs.replacing(out) as tmp:
        # the other long part: writing the file (6.4 GB at 1.6 B parameters), counted in bytes as torch.save
        # writes them, of the weights' bytes (the zip's headers come on top, a little per tensor)
        with open(tmp, "wb") as f, Progress(total=sum(t.nbytes for t in sd.values()), desc="export: writing",
                                            unit="B", unit_scale=True) as bar:
            torch.save(obj, CountingWrites(f, bar))
    return out


def made_from(path):
    """What an existing model file was exported from (export()'s settings: its checkpoint, config, step and whether
    encoder only), read without its weights (memory-mapped); None for any other file."""
    obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        return None
    src = obj.get("source") or {}
    return {"checkpoint": {"ckpt_dir": src.get("ckpt_dir"), "tag": src.get("tag")}, "config": obj.get("config"),
            "step": obj.get("step"), "encoder_only": bool(obj.get("encoder_only"))}


def identity(path, tag=None):
    """What a model (a model file, or a run's out_dir: its newest complete checkpoint) is, cheaply (no weight is read):
    the checkpoint it is or was exported from (with a run's out_dir, `tag` names another than the newest), its step,
    and a digest of its config. Two models with the same identity
    hold the same weights: what a command's output records of the model it was made with (scripts/embed.py)."""
    import hashlib
    if os.path.isdir(path):
        ckpt_dir, tag, meta = find_checkpoint(path, tag)
        rec = {"checkpoint": {"ckpt_dir": os.path.abspath(ckpt_dir), "tag": tag}, "config": meta["config"],
               "step": meta["step"]}
    else:
        read_model_file(path, mmap=True)  # (a file that is not a model file: the one clear error)
        rec = made_from(path)
    ck = rec["checkpoint"]
    return {"checkpoint": f"{ck['ckpt_dir']}/{ck['tag']}" if ck.get("ckpt_dir") else ck.get("tag"), "step": rec["step"],
            "config": hashlib.sha256(json.dumps(rec["config"], sort_keys=True).encode()).hexdigest()[:16]}


# -----------------------------------------------------------------------------
# 4. reading it back


def read_model_file(path_or_obj, map_location="cpu", mmap=False):
    """A model file's weights and what else it holds: (state_dict, meta), meta = the file without "model", plus
    "tag" (the checkpoint it came from). Read with weights_only=True: only tensors and plain types, no code runs.
    mmap=True: the tensors stay on disk until used (a look at the config costs nothing; the ranks of a node share
    one read through the page cache). Raises ConfigError for anything that is not a seismic-mae model file of a
    version this file reads, or whose config lacks a key its model is built from (checkpoint.check_model_config)."""
    if isinstance(path_or_obj, (str, os.PathLike)):
        name = str(path_or_obj)
        try:
            obj = torch.load(path_or_obj, map_location=map_location, weights_only=True, mmap=mmap)
        except FileNotFoundError:
            raise configurator.ConfigError(f"{name}: no such file") from None
        except OSError as e:
            raise configurator.ConfigError(f"cannot read {name}: {e}") from None
        except Exception as e:  # noqa: BLE001 - arbitrary bytes fail in the unpickler in many ways (KeyError too)
            # torch's messages run to several lines of advice (some of it, "weights_only=False will likely
            # succeed", wrong here): keep the reason
            text = str(e)
            if "WeightsUnpickler error:" in text:
                text = text.split("WeightsUnpickler error:", 1)[1]
            why = next((line.split(". ")[0] for line in text.splitlines() if line.strip()), "empty or truncated")
            raise configurator.ConfigError(f"{name} is not a seismic-mae model file (torch.load with weights_only=True "
                                           f"cannot read it: {why.strip()}); write one with python -m scripts.export "
                                           f"OUT_DIR") from None
    else:
        name, obj = "the object given", path_or_obj
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise configurator.ConfigError(f"{name} is not a seismic-mae model file (no format {FORMAT!r}): "
                                       f"write one with python -m scripts.export OUT_DIR")
    if obj.get("version") != VERSION:
        raise configurator.ConfigError(f"{name} is a seismic-mae model file of version {obj.get('version')!r}; this "
                                       f"scripts/export.py reads version {VERSION}")
    checkpoint.check_model_config(obj.get("config") or {}, name)
    meta = {k: v for k, v in obj.items() if k != "model"}
    meta["tag"] = (obj.get("source") or {}).get("tag")
    return obj["model"], meta


def _no_decoder(*args, **kwargs):
    raise RuntimeError("this MAE was loaded from an encoder-only file (scripts/export.py --encoder_only): it has no decoder "
                       "and cannot reconstruct or compute the MAE loss. Use model.forward_encoder(patches, ids_keep), "
                       "or export without --encoder_only")


def load(path_or_obj, map_location="cpu"):
    """One call: read a model file (weights_only), rebuild its config's MAE, load the weights with strict=True.
    Returns (model in eval mode, meta). model.encoder_only says which kind it is; for an encoder-only file the
    decoder's submodules and mask_token are None before the strict load, so it checks exactly the encoder's
    weights, and a forward that needs the decoder raises a clear error rather than run random decoder weights."""
    sd, meta = read_model_file(path_or_obj, map_location)
    name = str(path_or_obj) if isinstance(path_or_obj, (str, os.PathLike)) else "the object given"
    cfg = meta["config"]
    w = sd.get("patch_embed.weight")
    # the patch embedding is a Conv3d kernel (dim, 1, pz, py, px): it fixes the patch for good
    if w is None or w.ndim != 5 or tuple(w.shape[2:]) != tuple(cfg["patch"]):
        raise configurator.ConfigError(
            f"{name}: its patch_embed.weight is {tuple(w.shape) if w is not None else 'missing'}, which does not fit "
            f"its config's patch {tuple(cfg['patch'])} (expected (dim, 1, {', '.join(map(str, cfg['patch']))})): the "
            f"file's config and weights disagree; export it again from its checkpoint")
    model = build_model(cfg, device="meta")  # no init, no memory: the file's tensors become the parameters
    encoder_only = bool(meta.get("encoder_only"))
    if encoder_only:
        for key in DECODER:
            setattr(model, key, None)  # gone from state_dict(): the strict load checks exactly the encoder
        model.forward_decoder = _no_decoder
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as e:
        raise configurator.ConfigError(f"{name}: its weights do not fit its config's MAE ({cfg['model_size']!r}, "
                                       f"patch {tuple(cfg['patch'])}): {' '.join(str(e).split())[:500]}") from None
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:  # a buffer model.py gained that the file cannot have: build_model must make it (not on meta)
        raise configurator.ConfigError(f"{name}: {left[:5]} are not in the file and were not built: update modelfile.load")
    model.encoder_only = encoder_only
    return model.eval(), meta


# -----------------------------------------------------------------------------
# 5. warm start: train.py's init_from=PATH (a new run, step 0, fresh optimizer, these weights)


def init_source(path, option="init_from"):
    """What init_from=PATH holds, cheaply (nothing but a config is read): (its run's config, a description). PATH is
    a model file (this file's format; an encoder-only one too) or a run's out_dir (its newest complete checkpoint).
    train.py's dry run and setup call it before any work; the commands too, with `option` their own name for it."""
    if os.path.isdir(path):
        try:
            ckpt_dir, tag, meta = find_checkpoint(path)
        except configurator.ConfigError as e:
            raise configurator.ConfigError(f"{option}={path!r}: {e}") from None
        return meta["config"], f"{ckpt_dir}/{tag} (step {meta['step']})"
    if not os.path.exists(path):
        raise configurator.ConfigError(f"{option}={path!r}: no such file or directory; give a model file (python -m "
                                       f"scripts.export OUT_DIR writes one) or a run's out_dir")
    _, meta = read_model_file(path, mmap=True)
    return meta["config"], f"{path} (step {meta['step']}{', encoder only' if meta.get('encoder_only') else ''})"


def check_init(src, cfg, where):
    """Raise ConfigError unless weights trained with config `src` fit the MAE of config `cfg`. The crop may differ
    (positions are computed per token, from its grid coordinates: a larger crop has more tokens, each embedded as
    before; no weight depends on the grid); the patch and the model's shape may not."""
    if tuple(src["patch"]) != tuple(cfg["patch"]):
        pv, cv = (math.prod(p) for p in (src["patch"], cfg["patch"]))
        raise configurator.ConfigError(
            f"init_from {where} was trained with patch {tuple(src['patch'])} and this run has {tuple(cfg['patch'])}: "
            f"the patch embedding (a Conv3d kernel of the patch's shape) and the decoder's output ({pv} vs {cv} "
            f"voxels per token) are shaped by it; set patch={tuple(src['patch'])} (the crop may change), or start "
            f"from scratch")
    if src["model_size"] != cfg["model_size"]:
        a, b = (build_model({**cfg, "model_size": m, "crop": cfg["patch"]}, device="meta") for m in
                (src["model_size"], cfg["model_size"]))
        raise configurator.ConfigError(
            f"init_from {where} is model_size {src['model_size']!r} ({a.dim} wide, {len(a.blocks)} blocks) and this "
            f"run builds {cfg['model_size']!r} ({b.dim} wide, {len(b.blocks)} blocks): the weights do not fit; set "
            f"model_size={src['model_size']!r}, or start from scratch")
    # the heads split the same weights into another function; the decoder's count matters where its blocks are
    # taken (pretraining, or fine-tuning with the linear head: the UNETR head takes the encoder alone)
    (h, dh), (h2, dh2) = head_counts(src), head_counts(cfg)
    if cfg["task"] == "segment" and cfg["seg_head"] == "unetr":
        dh = dh2
    if (h, dh) != (h2, dh2):
        raise configurator.ConfigError(
            f"init_from {where} was trained with {h} encoder and {dh} decoder heads and this run has {h2} and {dh2}: "
            f"the weights fit, but the heads split them into another function; set heads={h} dec_heads={dh}, or "
            f"start from scratch")


def warm_start(model, path, cfg, name=None):
    """Load init_from's weights (a model file: `path`, read memory-mapped) into `model`, the run's MAE as train.setup
    built it, before any strategy wraps it. A full file sets every weight; an encoder-only one the encoder, and the
    decoder keeps its fresh init. `name`: what init_from said, if not `path`. Returns a line for the log."""
    sd, meta = read_model_file(path, mmap=True)
    check_init(meta["config"], cfg, path)
    own = model.state_dict()
    want = [k for k in own if meta.get("encoder_only") is not True or part(k) == "encoder"]
    have = list(sd)
    if isinstance(model, Segmenter) and meta["config"]["task"] == "mae":  # fine-tuning a pretrained MAE: its encoder
        want = [k for k in want if not k.startswith(("seg_pred", "head."))]  # (and with the linear head its decoder
        have = [k for k in have if not k.startswith(PRETRAINING_ONLY)]  # blocks); the head, or its output, is new
        if model.seg_head == "unetr":  # the UNETR head has no use for the MAE's decoder
            have = [k for k in have if part(k) == "encoder"]
    _check_names(have, want, path)
    with torch.no_grad():
        for k in want:
            if tuple(sd[k].shape) != tuple(own[k].shape):
                raise configurator.ConfigError(f"init_from {path}: weight {k} is {tuple(sd[k].shape)}, this run's MAE "
                                               f"has {tuple(own[k].shape)}")
            own[k].copy_(sd[k])  # (state_dict's tensors share the parameters' storage)
    fresh = {k.split(".")[0] for k in own if k not in want}
    src = meta["config"]
    took, note = (("the encoder", " (the UNETR head starts fresh)") if "head" in fresh else
                  ("the encoder", " (the decoder starts fresh)") if "decoder_blocks" in fresh else
                  ("every weight but the head's output layer", " (seg_pred starts fresh)") if fresh else
                  ("every weight", ""))
    kind = "MAE" if src["task"] == "mae" else "segmenter"
    return (f"init_from {name or path}{f' (exported to {path})' if name else ''}: "
            f"{took} of a {src['model_size']} {kind} trained {meta['step']} steps on {tuple(src['crop'])} crops{note}; "
            f"a new run from step 0, fresh optimizer")


def init_from(model, cfg, log):
    """train.py's init_from, on every rank: the trained weights into the plain model, before a strategy shards it or
    copies them into its fp32 masters. Only a new run: one with checkpoints of its own resumes them (a requeued job
    goes on). init_from is a model file, or a run's out_dir (its newest checkpoint, exported once by rank 0)."""
    # rank 0's view of out_dir, so that every rank takes the same branch (and resume=False is refused first)
    if distributed.on_rank_0(lambda: checkpoint.check_resumable(cfg, os.path.join(cfg["out_dir"], "ckpt"))):
        log(f"init_from={cfg['init_from']} not used: {cfg['out_dir']} has checkpoints of its own to resume")
        return
    src = cfg["init_from"]
    check_init(init_source(src)[0], cfg, src)  # before any work: a wrong patch or width
    if os.path.isdir(src):
        path = distributed.on_rank_0(lambda: export(src, out=os.path.join(cfg["out_dir"], "init_from.pt"),
                                                     overwrite=True))  # (this run's own copy, whatever it held)
        log(warm_start(model, path, cfg, name=src))
    else:
        log(warm_start(model, src, cfg))
