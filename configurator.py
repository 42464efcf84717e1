"""
The config: every key with its default and meaning (the block below: first the researcher's keys, the sample and
model, data, masking, optimizer, schedule, fine-tuning, cp, strategy and validation; then one block of operations
keys: the run's folder and checkpoints, reading the stores, the cluster), and how config files and overrides change
them, nanoGPT style, without magic beyond exec.

    python train.py config/quickstart.py --max_steps=50 --crop=(64,64,64)

defaults() is a fresh dict of the block below (train.py's config; the planner and the benches start from it
too). apply() runs each config file (plain Python that assigns names) and then each --key=value, in
command-line order, and checks every change:
  * the key must exist below (a typo must not silently do nothing; the error names the keys spelled like it);
  * the value must have the default's type (an int is accepted where a float is expected).
Values are parsed with ast.literal_eval, so --crop=(64,64,64) is a tuple and --data_paths=['a','b'] a
list; a value that does not parse is taken as a string (--out_dir=out/run1). What a value may be (ranges,
combinations) is check_config's job, at the end of this file: every key's check beside the keys.
"""

import ast
import builtins
import copy
import difflib
import importlib
import math

import ring_attention
from model import SIZES, aligned_heads, build_model, token_grid


# -----------------------------------------------------------------------------
# every config key and its default (config/*.py files and --key=value change them)
# ---- the researcher's keys: what is trained, on what, how
# the sample and the model
crop = (64, 64, 128)  # voxels per sample, (inline, crossline, time)
patch = (16, 16, 16)  # voxels per token
model_size = "tiny"  # tiny | mini | small | base | large | huge | giant | G (model.SIZES: width, depth, heads)
heads = 0  # encoder attention heads; 0 = the size's own. Width / heads = the head dim: 64 or 128 run the GPU's
#            fused attention fastest (python -m scripts.plan CONFIG prints the step at both layouts)
dec_heads = 0  # the decoder's, likewise (its width is 512 from base up: 4 heads of 128)
# the data (infra/reader.py, data.py)
data_paths = ["data/quickstart.mdio"]  # MDIO v1/v0 stores or 3D Zarr arrays (local, s3://, any fsspec URL), glob
#                                        patterns (s3://bucket/library/*.mdio) and @manifests (python -m scripts.library index)
sample_weighting = "volume"  # volume: a store drawn by its live voxels | uniform | manifest (each line's "weight")
min_live = 0.0  # skip crops whose live-trace fraction is below this
flip_crops = False  # augmentation: training crops (and labels) mirrored at random along inline and crossline, each
#                     with probability 1/2, as a function of the sample's index (data.Sampler's flip); never validation
make_synthetic = False  # create a synthetic volume at data_paths[0] if it does not exist (quickstart); a local
#                          path only: a remote one (s3://) must hold the store, it is never written to
synthetic_shape = (128, 128, 256)  # (inline, crossline, time) of that synthetic volume
synthetic_chunks = (64, 64, 64)  # its Zarr chunks
seed = 0  # data, mask and init randomness
# masking and the loss
mask_ratio = 0.75  # fraction of tokens hidden from the encoder
norm_pix_loss = False  # normalise each target patch by its own mean / std
mask_strata = 0  # masking strata (a multiple of cp; 0 = cp). Fix it to make masks independent of cp
# the optimizer
micro_batch = 2  # samples per rank per micro step
grad_accum = 1  # micro steps per optimizer step
blr = 1.5e-4  # base learning rate; lr = blr * global_batch / 256
weight_decay = 0.05  # AdamW, on weight matrices only (not biases, norms, cls/mask tokens)
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0  # max global gradient norm; 0 = off
# the schedule
max_steps = 200  # optimizer steps in the whole run
warmup_steps = 20  # linear warmup from lr/warmup_steps to lr
min_lr = 0.0  # lr at the last step (half-cosine decay after warmup)
# fine-tuning: the encoder (every token visible) and the decoder's blocks as a head that classifies every voxel
task = "mae"  # mae (pretraining) | segment (fine-tuning on label_var; start from init_from, or from scratch)
label_var = "fault"  # segment: the stores' integer class variable beside the amplitude (MDIO v1), on its grid
classes = 2  # segment: label values 0 .. classes - 1; 2 is binary (one logit per voxel, weighted BCE)
pos_weight = 10.0  # segment, binary: the loss weight of class-1 voxels (faults are a few % of the voxels)
seg_head = "unetr"  # segment: unetr (features of several encoder depths up to every voxel, unetr.py) |
#                     linear (the decoder's blocks, then each token's voxels from it alone: a probe's head)
seg_features = 16  # segment, unetr: channels at full resolution (x 2 at each coarser level), UNETR's feature size
layer_decay = 1.0  # segment: encoder block k's lr x layer_decay^(depth - k), the embedding's ^(depth + 1) (MAE: 0.75)
freeze_encoder_steps = 0  # segment: the encoder's lr is 0 for the first steps, the head alone learns (then all: LP-FT)
init_from = ""  # a new run starts from these weights (scripts/export.py's model file, or an out_dir): warm start, step 0
# context parallelism: each sample's tokens split over cp ranks (contiguous inline slabs)
cp = 1  # ranks per sample; world size must be a multiple; at most one node (8) in practice
cp_impl = "ring"  # ring (ring_attention.py) | torch (PyTorch's own ring functions, checked against ours at start)
# the strategy, precision and memory
strategy = "zero2"  # zero2 (DeepSpeed ZeRO-2) | zero3 (DeepSpeed ZeRO-3) | fsdp2 (PyTorch fully_shard)
dtype = "auto"  # auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
grad_ckpt = False  # activation checkpointing: keep a block's input only, recompute the block in backward
ckpt_blocks = -1  # with grad_ckpt: how many blocks (-1 every one; infra/plan.py: which, ckpt_order, and the least)
compile = False  # torch.compile each block (the ring stays one opaque op); off until measured on a GPU
zero_bucket = int(5e8)  # DeepSpeed's gradient bucket, in elements (its default): GPU memory vs. fewer collectives
zero3_max_live = int(1e9)  # ZeRO-3: weights reused within this many elements stay gathered; caps prefetch too
# validation (infra/evaluate.py; segment: the loss and IoU / Dice per class) and figures
val_paths = []  # held-out stores (as data_paths; also manifest lines with split "val"); none: the last val_frac
val_frac = 0.1  # inline fraction of each training volume held out (when val_paths is empty); 0 = no validation
eval_interval = 100  # steps between evaluations (also one before the first step and one after the last)
eval_samples = 16  # fixed validation samples: crops and masks are functions of (seed, validation index) only
val_floor = True  # mae: also score a predictor that learns nothing (kriging, infra/floor.py) on the same masked
#                   patches, once, at the first evaluation: the loss an MAE must get below (val_floor in log.jsonl)
eval_only = False  # evaluate the newest complete checkpoint (val_loss and its figure), then exit
figures = True  # rank 0 writes out_dir/figures/recon_step_N.png and loss.png at each evaluation (matplotlib)
tensorboard = False  # also send scalars and figures to torch.utils.tensorboard, in out_dir/tb

# ---- operations: where a run writes, how it reads, how it stops and resumes, the cluster
# the run's folder, its log and checkpoints
out_dir = "out/quickstart"  # logs and checkpoints (task="segment" from init_from = this out_dir: out_dir + "_segment")
log_interval = 10  # steps between log lines
ckpt_interval = 100  # steps between checkpoints (one is also written at the end)
keep_ckpts = 2  # complete checkpoints kept; keep >= 2: the newest may be mid-write when a job dies
resume = True  # continue from the newest complete checkpoint in out_dir, if any (on any world size: infra/checkpoint.py)
allow_batch_change = False  # resume with another global batch: the stream goes on at the next unseen sample
stop_step = 0  # > 0: stop after this step as if interrupted (checkpoint, exit); tests use it
lease_stale = 10.0  # out_dir's lease (infra/lease.py) is stale after this many times the gap between its refreshes
lease_min_s = 300.0  # ... and never sooner than this (start-up, a long evaluation); a dead holder on this host: at once
# reading the stores (infra/reader.py)
in_flight = 16  # requests in flight per rank (on one event loop; also sizes the S3 connection pool)
read_threads = 0  # decompression threads per rank (0: the CPUs this rank may use / the ranks on its node)
prefetch = 2  # micro batches read ahead of compute
align_crops = False  # crop origins on chunk boundaries: fewest chunks (and bytes) per crop
max_open_stores = 64  # stores kept open per rank (least recently used closed first): flat memory for any library
read_retries = 6  # retries of a failing chunk request (exponential backoff, jitter), then an error
read_timeout_s = 30.0  # a request that has not answered by then is retried
s3_anon = False  # anonymous S3 (public buckets); else the normal AWS credential chain
s3_endpoint = ""  # S3-compatible endpoint URL (MinIO, a loopback test server); "" = AWS
store_chunks = (128, 128, 128)  # the chunks data_paths' stores were written in (MDIO's default): what the
#                                 planner prices S3 requests at, one GET a chunk; the reader reads each store's own
# the cluster and the planner (launch.sh and infra/plan.py read these)
nodes = 1  # nodes the job runs on
gpus_per_node = 0  # ranks per node; 0 = every GPU of the machine (or NPROC / 2 CPU ranks without GPU)
stop_lead_s = 0  # SLURM sends SIGUSR1 this long before the time limit: a checkpoint, exit 75; 0 = the planner's
dry_run = False  # validate and plan for nodes x gpus_per_node, print, exit (DRY_RUN=1 bash launch.sh ...)
gpu_peak_flops = 989e12  # dense bf16 FLOP/s of one GPU for MFU (H100/H200 SXM)
ckpt_write_gbps = 2.0  # out_dir's write bandwidth, GB/s: the planner's checkpoint time (and stop_lead_s's)

KEYS = [k for k, v in list(globals().items())
        if not k.startswith("_") and isinstance(v, (int, float, bool, str, tuple, list))]


# -----------------------------------------------------------------------------
# changing them

class ConfigError(ValueError):
    """A bad override: the message names the key and the fix."""


def need(ok, msg):
    """A check of a key or a command's option: ConfigError(msg) unless ok (msg names the problem and the fix)."""
    if not ok:
        raise ConfigError(msg)


def _check(cfg, key, value, where):
    if key not in cfg:
        # the keys spelled most like it (a typo: mak_steps -> max_steps), then those of its family (eval_...)
        close = difflib.get_close_matches(key, list(cfg), n=3, cutoff=0.6)
        close += [k for k in cfg if k.split("_")[0] == key.split("_")[0] and k not in close]
        hint = (f"did you mean {' or '.join(close[:5])}?" if close else
                "no known key is like it: every key, its default and meaning are at the top of configurator.py")
        raise ConfigError(f"unknown config key {key!r} ({where}); {hint}")
    default = cfg[key]
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if default is not None and type(value) is not type(default):
        raise ConfigError(f"config key {key!r} ({where}) must be {type(default).__name__} like its default "
                          f"{default!r}, got {type(value).__name__} {value!r}")
    return value


def apply(cfg, argv):
    """Apply config files and --key=value overrides in `argv` to the dict `cfg` (train.py's globals, or
    a plain dict of the config keys). Returns the dict of keys that were changed."""
    changed = {}
    for arg in argv:
        if not arg.startswith("--"):
            # a config file: run it in a scratch namespace, then check what it assigned
            try:
                src = open(arg).read()
            except OSError as e:
                raise ConfigError(f"cannot read config file {arg!r}: {e}") from e
            scope = {"__file__": arg}  # so that a config can build on another one beside it (config/context_1m.py)
            run_config_file(src, arg, scope)
            for key, value in scope.items():
                if key.startswith("__") or callable(value) or type(value).__name__ == "module":
                    continue  # imports and helper functions a config file may use
                changed[key] = cfg[key] = _check(cfg, key, value, f"in {arg}")
        else:
            if "=" not in arg:
                raise ConfigError(f"override {arg!r} must look like --key=value")
            key, text = arg[2:].split("=", 1)
            try:
                value = ast.literal_eval(text)
            except (SyntaxError, ValueError):
                value = text  # a bare string
            changed[key] = cfg[key] = _check(cfg, key, value, f"from {arg}")
    return changed


def run_config_file(src, path, scope):
    """exec a config file's source in `scope`; a file that does not parse or fails as it runs is a ConfigError
    naming the file, the line and the cause (a config file is Python that assigns names: max_steps = 500)."""
    import traceback
    try:
        code = builtins.compile(src, path, "exec")  # (`compile` is a config key here)
    except SyntaxError as e:
        raise ConfigError(f"config file {path}, line {e.lineno}: {e.msg}: {(e.text or '').strip()!r} (a config "
                          f"file is Python that assigns names, e.g. max_steps = 500)") from None
    try:
        exec(code, scope)
    except Exception as e:
        here = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
        line = f", line {here[-1].lineno}: {(here[-1].line or '').strip()!r}" if here else ""
        raise ConfigError(f"config file {path}{line} fails: {type(e).__name__}: {e}") from None


def defaults():
    """Every config key with its default (the block above), as a fresh dict: train.py's config, the planner's,
    the benches'. A copy, so that a run's changes never reach another's."""
    return copy.deepcopy({k: globals()[k] for k in KEYS})


# -----------------------------------------------------------------------------
# checking them: what a value may be (ranges, combinations), everything that can be checked before any work

# The numeric keys' ranges: (least, most, whether the least itself is allowed); None: no bound. Every int or float
# key is here or checked below with a message of its own (tests/test_mistakes.py holds every key to a bad value).
BOUNDS = {k: (1, None, True) for k in ("max_steps", "micro_batch", "grad_accum", "log_interval", "ckpt_interval",
                                       "keep_ckpts", "in_flight", "prefetch", "zero_bucket", "zero3_max_live",
                                       "max_open_stores", "eval_interval", "nodes", "seg_features")}
BOUNDS.update({k: (0, None, True) for k in ("read_retries", "warmup_steps", "min_lr", "weight_decay", "grad_clip",
                                            "stop_step", "seed", "gpus_per_node", "stop_lead_s", "lease_min_s",
                                            "freeze_encoder_steps")})
BOUNDS.update({k: (0, None, False) for k in ("blr", "read_timeout_s", "ckpt_write_gbps", "lease_stale",
                                             "gpu_peak_flops")})
BOUNDS["min_live"] = (0, 1, True)


def check_heads(cfg):
    """heads / dec_heads: 0 (the size's own) or a count that divides the stack's width (model.SIZES)."""
    dim, _, own, dec_dim, _, dec_own = SIZES[cfg["model_size"]]
    for key, width, h0 in (("heads", dim, own), ("dec_heads", dec_dim, dec_own)):
        h = cfg[key]
        good = aligned_heads(width)
        need(isinstance(h, int) and not isinstance(h, bool) and h >= 0 and (h == 0 or width % h == 0),
             f"{key}={h!r}: 0 (model_size {cfg['model_size']!r}'s own {h0}) or a count that divides its width "
             f"{width}" + (f", e.g. {good} (heads of {width // good})" if good else ""))


def check_config(cfg):
    """Every key's value and every combination, before any work: ConfigError naming the problem and the fix.
    The paths a run writes are checked by train.check (infra/outputs.py), the data's own rules by data.Sampler."""
    need(cfg["model_size"] in SIZES, f"model_size {cfg['model_size']!r} unknown; choose one of {list(SIZES)}")
    check_heads(cfg)
    for key, (lo, hi, closed) in BOUNDS.items():
        v = cfg[key]
        need(math.isfinite(v) and (v >= lo if closed else v > lo) and (hi is None or v <= hi),
             f"{key} must be {'>=' if closed else '>'} {lo}{f' and <= {hi}' if hi is not None else ''}, got {v!r}")
    need(all(0 <= cfg[b] < 1 for b in ("beta1", "beta2")),
         f"beta1 and beta2 (AdamW's) must be in [0, 1), got {cfg['beta1']}, {cfg['beta2']}")
    for key in ("crop", "patch", "synthetic_shape", "synthetic_chunks", "store_chunks"):
        v = cfg[key]
        need(len(v) == 3 and all(isinstance(a, int) and a > 0 for a in v),
             f"{key} must be 3 positive ints (inline, crossline, time), got {v!r}")
    need(all(c % p == 0 for c, p in zip(cfg["crop"], cfg["patch"])),
         f"crop {cfg['crop']} is not divisible by patch {cfg['patch']} along every axis: choose a crop that is a "
         f"multiple of the patch, e.g. {tuple(max(p, c // p * p) for c, p in zip(cfg['crop'], cfg['patch']))}")
    check_masking(cfg)
    grid = token_grid(cfg["crop"], cfg["patch"])
    L = math.prod(grid)
    # context parallelism
    cp, strata = cfg["cp"], cfg["mask_strata"] or cfg["cp"]
    need(cp >= 1, f"cp must be >= 1, got {cp}")
    need(cfg["cp_impl"] in ("ring", "torch"), f"cp_impl must be 'ring' or 'torch', got {cfg['cp_impl']!r}")
    need(grid[0] % cp == 0,
         f"the token grid {grid} cannot be split evenly over cp={cp} ranks: each rank holds grid[0]/cp inline "
         f"slabs, so crop[0]/patch[0] = {grid[0]} must be a multiple of cp (e.g. crop[0] = "
         f"{cfg['patch'][0] * cp * max(1, round(grid[0] / cp))})")
    need(cfg["mask_strata"] >= 0, "mask_strata must be >= 0 (0 = cp)")
    need(strata % cp == 0 and L % strata == 0,
         f"mask_strata {strata} must be a multiple of cp={cp} and divide the {L} tokens")
    m = build_model({**cfg, "mask_strata": 0, "cp": 1}, device="meta")  # (shapes only: head dims, block count)
    if cp > 1:  # the ring runs on the fused attention kernels: check their head dims now
        for blk in (*m.blocks[:1], *m.decoder_blocks[:1]):  # (a segmenter with the UNETR head has no decoder)
            d = blk.qkv.in_features // blk.heads
            try:
                ring_attention.check_head_dim(d)
            except ValueError as e:
                raise ConfigError(f"model_size {cfg['model_size']!r} ({blk.heads} heads of {d}) with "
                                               f"cp={cp}: {e}; set heads / dec_heads for head dims of 64 or 128") from None
    n_blocks = len(m.blocks) + len(m.decoder_blocks)
    need(-1 <= cfg["ckpt_blocks"] <= n_blocks, f"ckpt_blocks={cfg['ckpt_blocks']}: -1 (every block) or a number "
                                               f"of blocks up to the {n_blocks} of model_size {cfg['model_size']!r}")
    need(cfg["read_threads"] >= 0, f"read_threads must be >= 0 (0: one per CPU of this rank), got {cfg['read_threads']}")
    # the words
    need(cfg["sample_weighting"] in ("volume", "uniform", "manifest"),
         f"sample_weighting must be 'volume', 'uniform' or 'manifest', got {cfg['sample_weighting']!r}")
    need(cfg["dtype"] in ("auto", "float32", "bfloat16"), f"dtype must be auto|float32|bfloat16, got {cfg['dtype']!r}")
    need(cfg["strategy"] in ("zero2", "zero3", "fsdp2"), f"strategy must be zero2|zero3|fsdp2, got {cfg['strategy']!r}")
    need(not cfg["s3_endpoint"] or cfg["s3_endpoint"].startswith(("http://", "https://")),
         f"s3_endpoint must be an http:// or https:// URL (or '' for AWS), got {cfg['s3_endpoint']!r}")
    # the data and the run's folder
    for key in ("data_paths", "val_paths"):
        need(all(isinstance(p, str) and p.strip() for p in cfg[key]),
             f"{key} must be a list of store paths, URLs, glob patterns or @manifests (strings), got {cfg[key]!r}")
    need(len(cfg["data_paths"]) >= 1, "data_paths is empty: list at least one MDIO/Zarr store")
    need(0.0 <= cfg["val_frac"] < 1.0, f"val_frac must be in [0, 1) (0 = no validation), got {cfg['val_frac']}")
    need(cfg["eval_samples"] >= 1, f"eval_samples must be >= 1, got {cfg['eval_samples']} (val_frac=0 and no "
                                   f"val_paths switch validation off)")
    need(not cfg["eval_only"] or cfg["val_paths"] or cfg["val_frac"] > 0,
         "eval_only=True needs a validation set: val_paths, or val_frac > 0 as the run had")
    if cfg["figures"]:
        try:
            importlib.import_module("matplotlib")  # drawn at the first evaluation, after the setup
        except ImportError as e:
            raise ConfigError(f"figures=True needs matplotlib ({e}): pip install matplotlib (it is in "
                                           f"requirements.txt), or set figures=False") from None
    # fine-tuning
    need(cfg["task"] in ("mae", "segment"), f"task must be 'mae' (pretraining) or 'segment' (fine-tuning), got "
                                            f"{cfg['task']!r}")
    need(cfg["classes"] >= 2, f"classes must be >= 2 (2: binary, e.g. fault / no fault), got {cfg['classes']}")
    need(cfg["pos_weight"] > 0, f"pos_weight must be > 0 (1: unweighted), got {cfg['pos_weight']}")
    need(cfg["seg_head"] in ("unetr", "linear"), f"seg_head must be 'unetr' or 'linear', got {cfg['seg_head']!r}")
    need(cfg["task"] != "segment" or cfg["seg_head"] != "unetr" or all(p & (p - 1) == 0 for p in cfg["patch"]),
         f"seg_head='unetr' upsamples tokens to voxels by factors of 2: every patch side must be a power of two, got "
         f"patch {tuple(cfg['patch'])} (or seg_head='linear')")
    need(0 < cfg["layer_decay"] <= 1, f"layer_decay must be in (0, 1] (1: off; MAE fine-tunes with 0.75), got "
                                      f"{cfg['layer_decay']}")
    need(cfg["task"] == "segment" or cfg["freeze_encoder_steps"] == 0,
         f"freeze_encoder_steps={cfg['freeze_encoder_steps']} freezes a fine-tuning's encoder: set task='segment' or "
         f"drop it")
    need(cfg["task"] != "segment" or bool(cfg["label_var"]),
         "task='segment' needs label_var: the stores' class variable (e.g. 'fault')")
    if cfg["tensorboard"]:
        try:
            importlib.import_module("torch.utils.tensorboard")  # fail now, not after hours of training
        except ImportError as e:
            raise ConfigError(f"tensorboard=True but torch.utils.tensorboard cannot be imported ({e}): "
                                           f"pip install tensorboard, or drop tensorboard=True") from None


def check_world(cfg, world):
    """The one check that needs the world size (torchrun's ranks), made before any work: cp groups split it evenly."""
    need(world % cfg["cp"] == 0, f"world size {world} is not divisible by cp={cfg['cp']}: launch a multiple of "
                                 f"{cfg['cp']} ranks (NPROC=...), or change cp")


def check_masking(cfg):
    """mask_ratio in (0, 1), leaving at least one visible token of the crop's (scripts/reconstruct.py asks too)."""
    need(0.0 < cfg["mask_ratio"] < 1.0, f"mask_ratio must be in (0, 1), got {cfg['mask_ratio']}")
    L = math.prod(token_grid(cfg["crop"], cfg["patch"]))
    need(int(L * (1 - cfg["mask_ratio"])) >= 1,
         f"mask_ratio {cfg['mask_ratio']} leaves no visible token out of {L}: lower it or use a larger crop")
