"""
Pretrain a 3D ViT-MAE on seismic volumes with DeepSpeed ZeRO-2.

    bash launch.sh config/quickstart.py                 # one machine: all GPUs, or 2 CPU ranks
    python train.py config/quickstart.py --max_steps=20 # one process, no launcher

Read top to bottom: the config (every key with its default), validation (every bad input fails here,
before any work), then main(): distributed setup, data, model, the strategy's engine (strategies.py),
resume, the training loop, checkpoints. One training step is grad_accum micro steps of micro_batch samples
on each of the dp_size data-parallel ranks, and each sample is split over the cp ranks of a context-parallel
group:
    world        = dp_size * cp                                 (CP groups: contiguous ranks, one node)
    global_batch = micro_batch * grad_accum * dp_size          (samples per optimizer step)
    lr           = blr * global_batch / 256                     (the MAE scaling rule)
Gradient semantics with cp > 1: each rank's loss is its share of the sample's masked error divided by
the masked count of the whole sample, multiplied by cp before backward; ZeRO averages gradients over
the whole world, so the result is the mean over the dp_size samples, exactly as with cp = 1.
"""

import hashlib
import importlib
import json
import math
import os
import resource
import sys
import threading
import time

import torch

import checkpoint
import configurator
import data
import dryrun
import evaluate
import export
import library
import plan
import reader
import ring_attention
import strategies
import synthetic
from model import MODELS

# -----------------------------------------------------------------------------
# config: defaults (config/*.py files and --key=value override them; see configurator.py)
# I/O
out_dir = "out/quickstart"  # logs and checkpoints
data_paths = ["data/quickstart.mdio"]  # MDIO v1/v0 stores or 3D Zarr arrays (local, s3://, any fsspec URL), glob
#                                        patterns (s3://bucket/library/*.mdio) and @manifests (python library.py index)
sample_weighting = "volume"  # volume: a store drawn by its live voxels | uniform | manifest (each line's "weight")
max_open_stores = 64  # stores kept open per rank (least recently used closed first): flat memory for any library
make_synthetic = False  # create a synthetic volume at data_paths[0] if it does not exist (quickstart)
synthetic_shape = (128, 128, 256)  # (inline, crossline, time) of that synthetic volume
synthetic_chunks = (64, 64, 64)  # its Zarr chunks
# data streaming (reader.py, data.py)
in_flight = 16  # requests in flight per rank (on one event loop; also sizes the S3 connection pool)
read_threads = 0  # decompression threads per rank (0: the CPUs this rank may use / the ranks on its node)
prefetch = 2  # micro batches read ahead of compute
align_crops = False  # crop origins on chunk boundaries: fewest chunks (and bytes) per crop
min_live = 0.0  # skip crops whose live-trace fraction is below this
read_retries = 6  # retries of a failing chunk request (exponential backoff, jitter), then an error
read_timeout_s = 30.0  # a request that has not answered by then is retried
s3_anon = False  # anonymous S3 (public buckets); else the normal AWS credential chain
s3_endpoint = ""  # S3-compatible endpoint URL (MinIO, a loopback test server); "" = AWS
# sample and model
crop = (64, 64, 128)  # voxels per sample, (inline, crossline, time)
patch = (16, 16, 16)  # voxels per token
model_size = "tiny"  # tiny | small | base | large | huge (model.py)
mask_ratio = 0.75  # fraction of tokens hidden from the encoder
norm_pix_loss = False  # normalise each target patch by its own mean / std
compile = False  # torch.compile each block (the ring stays one opaque op); off until measured on a GPU
grad_ckpt = False  # activation checkpointing: keep a block's input only, recompute the block in backward
ckpt_blocks = -1  # with grad_ckpt: how many blocks (-1 every one; model.ckpt_order which; plan.py: the least)
# context parallelism: each sample's tokens split over cp ranks (contiguous inline slabs)
cp = 1  # ranks per sample; world size must be a multiple; at most one node (8) in practice
cp_impl = "ring"  # ring (ring_attention.py) | torch (PyTorch's own ring functions, checked against ours at start)
mask_strata = 0  # masking strata (a multiple of cp; 0 = cp). Fix it to make masks independent of cp
# optimisation
max_steps = 200  # optimizer steps in the whole run
micro_batch = 2  # samples per rank per micro step
grad_accum = 1  # micro steps per optimizer step
blr = 1.5e-4  # base learning rate; lr = blr * global_batch / 256
min_lr = 0.0  # lr at the last step (half-cosine decay after warmup)
warmup_steps = 20  # linear warmup from lr/warmup_steps to lr
weight_decay = 0.05  # AdamW, on weight matrices only (not biases, norms, cls/mask tokens)
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0  # max global gradient norm; 0 = off
dtype = "auto"  # auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
strategy = "zero2"  # zero2 (DeepSpeed ZeRO-2) | zero3 (DeepSpeed ZeRO-3) | fsdp2 (PyTorch fully_shard)
zero_bucket = int(5e8)  # DeepSpeed's gradient bucket, in elements (its default): GPU memory vs. fewer collectives
zero3_max_live = int(1e9)  # ZeRO-3: weights reused within this many elements stay gathered; caps prefetch too
# validation (evaluate.py) and figures (reconstruct.py)
val_paths = []  # held-out stores (as data_paths; also manifest lines with split "val"); none: the last val_frac
val_frac = 0.1  # inline fraction of each training volume held out (when val_paths is empty); 0 = no validation
eval_interval = 100  # steps between evaluations (also one before the first step and one after the last)
eval_samples = 16  # fixed validation samples: crops and masks are functions of (seed, validation index) only
eval_only = False  # evaluate the newest complete checkpoint (val_loss and its figure), then exit
figures = True  # rank 0 writes out_dir/figures/recon_step_N.png and loss.png at each evaluation (matplotlib)
tensorboard = False  # also send scalars and figures to torch.utils.tensorboard, in out_dir/tb
# logging and checkpoints
log_interval = 10  # steps between log lines
ckpt_interval = 100  # steps between checkpoints (one is also written at the end)
keep_ckpts = 2  # complete checkpoints kept; keep >= 2: the newest may be mid-write when a job dies
resume = True  # continue from the newest complete checkpoint in out_dir, if any (on any world size: checkpoint.py)
allow_batch_change = False  # resume with another global batch: the stream goes on at the next unseen sample
init_from = ""  # a new run starts from these weights (export.py's model file, or an out_dir): warm start, step 0
ckpt_write_gbps = 2.0  # out_dir's write bandwidth, GB/s: the planner's checkpoint time (and stop_lead_s's)
stop_step = 0  # > 0: stop after this step as if interrupted (checkpoint, exit); tests use it
seed = 0  # data, mask and init randomness
gpu_peak_flops = 989e12  # dense bf16 FLOP/s of one GPU for MFU (H100/H200 SXM)
# the cluster (launch.sh and the planner read these)
nodes = 1  # nodes the job runs on
gpus_per_node = 0  # ranks per node; 0 = every GPU of the machine (or NPROC / 2 CPU ranks without GPU)
stop_lead_s = 0  # SLURM sends SIGUSR1 this long before the time limit: a checkpoint, exit 75; 0 = the planner's
dry_run = False  # validate and plan for nodes x gpus_per_node, print, exit (DRY_RUN=1 bash launch.sh ...)

CONFIG_KEYS = [k for k, v in list(globals().items())
               if not k.startswith("_") and isinstance(v, (int, float, bool, str, tuple, list))]


# -----------------------------------------------------------------------------
# validation: everything that can be checked before any work is done


def validate(cfg):
    """Raise ConfigError naming the problem and the fix; data-dependent checks live in data.Sampler."""

    def need(ok, msg):
        if not ok:
            raise configurator.ConfigError(msg)

    need(cfg["model_size"] in MODELS, f"model_size {cfg['model_size']!r} unknown; choose one of {list(MODELS)}")
    for key in ("crop", "patch"):
        v = cfg[key]
        need(len(v) == 3 and all(isinstance(a, int) and a > 0 for a in v),
             f"{key} must be 3 positive ints (inline, crossline, time), got {v!r}")
    need(all(c % p == 0 for c, p in zip(cfg["crop"], cfg["patch"])),
         f"crop {cfg['crop']} is not divisible by patch {cfg['patch']} along every axis: choose a crop that is a "
         f"multiple of the patch, e.g. {tuple(max(p, c // p * p) for c, p in zip(cfg['crop'], cfg['patch']))}")
    need(0.0 < cfg["mask_ratio"] < 1.0, f"mask_ratio must be in (0, 1), got {cfg['mask_ratio']}")
    grid = tuple(c // p for c, p in zip(cfg["crop"], cfg["patch"]))
    L = math.prod(grid)
    need(int(L * (1 - cfg["mask_ratio"])) >= 1,
         f"mask_ratio {cfg['mask_ratio']} leaves no visible token out of {L}: lower it or use a larger crop")
    # context parallelism
    cp, strata = cfg["cp"], cfg["mask_strata"] or cfg["cp"]
    need(cp >= 1, f"cp must be >= 1, got {cp}")
    need(cfg["cp_impl"] in ("ring", "torch"), f"cp_impl must be 'ring' or 'torch', got {cfg['cp_impl']!r}")
    need(grid[0] % cp == 0,
         f"the token grid {grid} cannot be split evenly over cp={cp} ranks: each rank holds grid[0]/cp inline "
         f"slabs, so crop[0]/patch[0] = {grid[0]} must be a multiple of cp (e.g. crop[0] = "
         f"{cfg['patch'][0] * cp * max(1, round(grid[0] / cp))})")
    need(strata % cp == 0 and L % strata == 0,
         f"mask_strata {strata} must be a multiple of cp={cp} and divide the {L} tokens")
    need(cfg["mask_strata"] >= 0, "mask_strata must be >= 0 (0 = cp)")
    with torch.device("meta"):  # (shapes only: the head dims and block count below)
        m = MODELS[cfg["model_size"]](grid=grid, patch=cfg["patch"], mask_ratio=cfg["mask_ratio"])
    if cp > 1:  # the ring runs on the fused attention kernels: check their head dims now
        for blk in (m.blocks[0], m.decoder_blocks[0]):
            d = blk.qkv.in_features // blk.heads
            try:
                ring_attention.check_head_dim(d)
            except ValueError as e:
                raise configurator.ConfigError(f"model_size {cfg['model_size']!r} with cp={cp}: {e}") from None
    n_blocks = len(m.blocks) + len(m.decoder_blocks)
    need(-1 <= cfg["ckpt_blocks"] <= n_blocks, f"ckpt_blocks={cfg['ckpt_blocks']}: -1 (every block) or a number "
                                               f"of blocks up to the {n_blocks} of model_size {cfg['model_size']!r}")
    need(0.0 <= cfg["min_live"] <= 1.0, f"min_live must be in [0, 1], got {cfg['min_live']}")
    need(cfg["sample_weighting"] in ("volume", "uniform", "manifest"),
         f"sample_weighting must be 'volume', 'uniform' or 'manifest', got {cfg['sample_weighting']!r}")
    need(cfg["ckpt_write_gbps"] > 0 and cfg["stop_lead_s"] >= 0, "ckpt_write_gbps must be > 0 and stop_lead_s >= 0")
    need(cfg["read_threads"] >= 0, f"read_threads must be >= 0 (0: one per CPU of this rank), got {cfg['read_threads']}")
    for key in ("max_steps", "micro_batch", "grad_accum", "log_interval", "ckpt_interval", "keep_ckpts", "in_flight",
                "prefetch", "zero_bucket", "zero3_max_live", "max_open_stores"):
        need(cfg[key] >= 1, f"{key} must be >= 1, got {cfg[key]}")
    need(cfg["dtype"] in ("auto", "float32", "bfloat16"), f"dtype must be auto|float32|bfloat16, got {cfg['dtype']!r}")
    need(cfg["strategy"] in ("zero2", "zero3", "fsdp2"), f"strategy must be zero2|zero3|fsdp2, got {cfg['strategy']!r}")
    need(len(cfg["data_paths"]) >= 1, "data_paths is empty: list at least one MDIO/Zarr store")
    need(cfg["blr"] > 0 and cfg["min_lr"] >= 0, "blr must be > 0 and min_lr >= 0")
    need(0.0 <= cfg["val_frac"] < 1.0, f"val_frac must be in [0, 1) (0 = no validation), got {cfg['val_frac']}")
    need(cfg["eval_samples"] >= 1, f"eval_samples must be >= 1, got {cfg['eval_samples']} (val_frac=0 and no "
                                   f"val_paths switch validation off)")
    need(cfg["eval_interval"] >= 1, f"eval_interval must be >= 1, got {cfg['eval_interval']}")
    need(not cfg["eval_only"] or cfg["val_paths"] or cfg["val_frac"] > 0,
         "eval_only=True needs a validation set: val_paths, or val_frac > 0 as the run had")
    if cfg["figures"]:
        try:
            importlib.import_module("matplotlib")  # drawn at the first evaluation, after the setup
        except ImportError as e:
            raise configurator.ConfigError(f"figures=True needs matplotlib ({e}): pip install matplotlib (it is in "
                                           f"requirements.txt), or set figures=False") from None
    if cfg["tensorboard"]:
        try:
            importlib.import_module("torch.utils.tensorboard")  # fail now, not after hours of training
        except ImportError as e:
            raise configurator.ConfigError(f"tensorboard=True but torch.utils.tensorboard cannot be imported ({e}): "
                                           f"pip install tensorboard, or drop tensorboard=True") from None


def get_lr(step, peak_lr, cfg):
    """Linear warmup over warmup_steps (non-zero at step 0), then half-cosine from peak_lr to min_lr,
    reaching min_lr at the last step (max_steps - 1)."""
    warm, last = cfg["warmup_steps"], cfg["max_steps"] - 1
    if step < warm:
        return peak_lr * (step + 1) / warm
    progress = (step - warm) / max(1, last - warm)
    return cfg["min_lr"] + (peak_lr - cfg["min_lr"]) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# -----------------------------------------------------------------------------


class Job:
    """Everything a training step needs, built once by setup() (bench.py builds the same)."""


def dist_env():
    """The environment torch.distributed reads: torchrun's, or a world of 1 on a free local port (a bare python)."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def setup(cfg):
    """Distributed init, data, model, optimizer, DeepSpeed engine. Returns a Job."""
    job = Job()
    job.cfg = cfg
    # ---- distributed setup. torchrun sets RANK/WORLD_SIZE; a bare `python train.py` is a world of 1.
    dist_env()
    job.on_gpu = on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must precede `import deepspeed`
    elif os.environ.get("DS_ACCELERATOR") == "cpu":
        del os.environ["DS_ACCELERATOR"]  # inherited from a CPU machine (a login node): wrong here
    import deepspeed
    import torch.distributed as dist

    job.rank, job.world = rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    cp = cfg["cp"]
    # checks that need the world size, before any work
    if world % cp:
        raise configurator.ConfigError(f"world size {world} is not divisible by cp={cp}: launch a multiple of "
                                       f"{cp} ranks (NPROC=...), or change cp")
    if on_gpu:
        torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    job.device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    job.dtype = dtype = {"auto": torch.bfloat16 if on_gpu else torch.float32, "float32": torch.float32,
                         "bfloat16": torch.bfloat16}[cfg["dtype"]]
    # ranks [i*cp, (i+1)*cp) share sample stream i: contiguous, so a CP group stays on one node's NVLink.
    # Every rank creates every group, in the same order (new_group is collective).
    job.cp, job.cp_rank, job.dp_rank, job.dp_size = cp, rank % cp, rank // cp, world // cp
    dp_rank, dp_size = job.dp_rank, job.dp_size
    job.cp_group = None
    if cp > 1:
        for i in range(dp_size):
            g = dist.new_group(list(range(i * cp, (i + 1) * cp)))
            if i == dp_rank:
                job.cp_group = g
    job.global_batch = cfg["micro_batch"] * cfg["grad_accum"] * dp_size
    job.peak_lr = cfg["blr"] * job.global_batch / 256
    job.log = print if rank == 0 else (lambda *a, **k: None)

    # ---- data. Rank 0 creates the quickstart's synthetic store; everyone waits, then opens it.
    if cfg["make_synthetic"] and rank == 0:
        synthetic.ensure_synthetic(cfg["data_paths"][0], cfg["synthetic_shape"], seed=cfg["seed"],
                              chunks=cfg["synthetic_chunks"])
    dist.barrier()
    opts = reader.ReadOptions(in_flight=cfg["in_flight"], retries=cfg["read_retries"], timeout_s=cfg["read_timeout_s"],
                            anon=cfg["s3_anon"], endpoint_url=cfg["s3_endpoint"] or None, threads=cfg["read_threads"])
    # the stores: globs expanded, manifests read, plain URLs opened and described, by rank 0 alone; every rank gets
    # the records and opens a store only when a sample needs it (library.py, data.Sampler)
    t0 = time.time()
    stores, val_stores = checkpoint.on_rank_0(
        lambda: (library.index(cfg["data_paths"], opts, in_flight=cfg["in_flight"]),
                 library.index(cfg["val_paths"], opts, in_flight=cfg["in_flight"]) if cfg["val_paths"] else []))
    # held out: the val_paths stores and the manifests' split="val" ones, or else the last val_frac of every
    # training volume's inline axis
    val_stores += [r for r in stores if r.get("split") == "val"]
    stores = [r for r in stores if r.get("split") != "val"]
    if not stores:
        raise data.DataError(f"data_paths {cfg['data_paths']} hold only split='val' stores: nothing to train on")
    job.log(f"data: {len(stores)} training store(s), {len(val_stores)} held-out; indexed in {time.time() - t0:.1f} s")
    held_out = not val_stores and cfg["val_frac"] > 0
    sampling = dict(crop=cfg["crop"], seed=cfg["seed"], micro_batch=cfg["micro_batch"], cp_rank=job.cp_rank,
                    cp_size=cp, align=cfg["align_crops"], min_live=cfg["min_live"], opts=opts,
                    weighting=cfg["sample_weighting"], max_open=cfg["max_open_stores"])
    job.sampler = data.Sampler(stores, dp_rank=dp_rank, dp_size=dp_size, grad_accum=cfg["grad_accum"],
                               part=("train", cfg["val_frac"]) if held_out else None, **sampling)
    # what the training stream depends on besides the seed: which stores, in which order, drawn how (a glob
    # re-expanded at a relaunch may have found more; main() warns when a resumed run's differs)
    job.stores_digest = hashlib.sha256(json.dumps([[r["url"] for r in stores], cfg["sample_weighting"]])
                                       .encode()).hexdigest()[:16]
    job.val_sampler = None
    if val_stores or held_out:
        val = val_stores or stores
        if cfg["sample_weighting"] == "manifest" and not all("weight" in r for r in val):
            sampling["weighting"] = "volume"  # held-out stores without weights (val_paths, split "val"): by volume
        job.val_sampler = data.Sampler(val, part=("val", cfg["val_frac"]) if held_out else None, stream="val",
                                       **sampling)

    # ---- model and optimizer. Same init on every rank (seeded), as data parallelism requires.
    torch.manual_seed(cfg["seed"])
    job.grid = grid = tuple(c // p for c, p in zip(cfg["crop"], cfg["patch"]))
    job.model = model = MODELS[cfg["model_size"]](grid=grid, patch=cfg["patch"], mask_ratio=cfg["mask_ratio"],
                                                  norm_pix_loss=cfg["norm_pix_loss"], grad_ckpt=plan.ckpt_arg(cfg),
                                                  mask_strata=cfg["mask_strata"] or cp)
    model.set_context_parallel(job.cp_group, cfg["cp_impl"])
    if cp > 1 and cfg["cp_impl"] == "torch":  # PyTorch's ring against ours on this machine, before any work
        for blk in (model.blocks[0], model.decoder_blocks[0]):  # the encoder's head dim and the decoder's
            ring_attention.verify_torch_cp(job.cp_group, job.device, dtype, blk.qkv.in_features // blk.heads)
    job.n_params = sum(p.numel() for p in model.parameters())  # before any sharding hides them
    # ---- warm start (init_from): trained weights into the plain model, before a strategy shards it or copies them
    # into its fp32 masters. Only a new run: one with checkpoints of its own resumes them (a requeued job goes on).
    if cfg["init_from"]:
        # rank 0's view of out_dir, so that every rank takes the same branch (and resume=False is refused first)
        if checkpoint.on_rank_0(lambda: checkpoint.check_resumable(cfg, os.path.join(cfg["out_dir"], "ckpt"))):
            job.log(f"init_from={cfg['init_from']} not used: {cfg['out_dir']} has checkpoints of its own to resume")
        else:
            src = cfg["init_from"]
            export.check_init(export.init_source(src)[0], cfg, src)  # before any work: a wrong patch or width
            if os.path.isdir(src):  # a run's out_dir: its newest checkpoint as one model file, exported by rank 0
                path = checkpoint.on_rank_0(
                    lambda: export.export(src, out=os.path.join(cfg["out_dir"], "init_from.pt")))
                job.log(export.warm_start(model, path, cfg, name=src))
            else:
                job.log(export.warm_start(model, src, cfg))
    if cfg["compile"]:  # each block, before any strategy wraps or shards it (blocks of a stack share one graph)
        for blk in list(model.blocks) + list(model.decoder_blocks):
            blk.compile()
    job.engine, job.optimizer = strategies.build(model, cfg, job.peak_lr, dtype, job.device)
    return job


def prepare_batch(job, x, ids):
    """A micro batch made ready in a prefetch thread (data.Prefetcher), so that the training thread does no
    conversion and only starts an asynchronous copy:
      ids_keep (B, n) int64: the kept tokens, from the fp32 masking noise of the samples `ids` (integers: no
                            strategy's cast of the model's inputs can change them, so every strategy, dtype
                            and dp/cp layout trains on the same masks);
      x (B, 1, Z/cp, Y, X): cast to the compute dtype, on GPU straight into pinned memory (the copy to the
                            device can then overlap compute: a pageable source makes it synchronous, and a
                            cast on the way makes it a CPU conversion on the training thread)."""
    noise = data.mask_noise(job.cfg["seed"], ids, job.model.L, job.cp_rank, job.cp)  # (B, L / cp) fp32
    ids_keep = job.model.keep_ids(noise, job.cp_rank, job.cp)
    if job.on_gpu:
        buf = torch.empty(x.shape, dtype=job.dtype, pin_memory=True)
        return buf.copy_(x), ids_keep.pin_memory()
    return x.to(job.dtype), ids_keep


def micro_batches(job, start, end, depth=None):
    """The micro batches of steps [start, end), prepared and read ahead (prepare_batch); depth: how many
    (default: the config's prefetch)."""
    return data.Prefetcher(job.sampler, start, end, depth=depth or job.cfg["prefetch"],
                           prepare=lambda x, ids: prepare_batch(job, x, ids))


def train_step(job, step, batches, stop=0.0):
    """One optimizer step: grad_accum micro steps. `batches` yields prepared (x, ids_keep) micro batches; `stop`:
    this rank's stop flag (checkpoint.StopRequest), summed over the ranks in the loss's all-reduce.
    Returns (mean loss over the whole job as a 1-element device tensor: reading it is a host sync, which the
    loop does only every log_interval steps; lr; seconds the training thread waited for data; the summed stop
    flags, a 1-element device tensor)."""
    cfg, engine = job.cfg, job.engine
    lr = get_lr(step, job.peak_lr, cfg)
    for group in job.optimizer.param_groups:  # ZeRO wraps this optimizer; its groups stay the ones it steps
        group["lr"] = lr
    # on the device: NCCL reduces only CUDA tensors
    acc, wait = torch.zeros(2, device=job.device), 0.0  # [loss, stop flag]: one all-reduce carries both
    if stop:
        acc[1] = stop  # (a fill on the device: no host sync)
    for micro in range(cfg["grad_accum"]):
        t0 = time.time()
        x, ids_keep = next(batches)  # (micro_batch, 1, crop[0] / cp, crop[1], crop[2]) in the compute dtype
        # pinned -> device without blocking this thread (a no-op on CPU); the copy is queued on the stream
        # ahead of the forward that reads it
        x, ids_keep = x.to(job.device, non_blocking=True), ids_keep.to(job.device, non_blocking=True)
        wait += time.time() - t0
        loss, _, _ = engine(x, ids_keep=ids_keep)
        acc[0] += loss.detach().float() / cfg["grad_accum"]
        engine.backward(loss * job.cp)  # see the docstring: x cp, then ZeRO averages over the world
        engine.step()  # DeepSpeed steps the optimizer at the last micro step only
    # every rank learns the mean loss: the sum over a CP group is the sample's loss, then mean over dp
    torch.distributed.all_reduce(acc)
    return acc[:1] / job.dp_size, lr, wait, acc[1:]


def main(argv, stop=None):
    """The run; `stop`: a checkpoint.StopRequest (cli installs it: SIGTERM / SIGUSR1 stop at a step boundary with a
    checkpoint, and main then returns checkpoint.RESUMABLE)."""
    cfg = {k: globals()[k] for k in CONFIG_KEYS}
    configurator.apply(cfg, argv)
    validate(cfg)
    if cfg["dry_run"]:
        return dryrun.check_launch(cfg)
    job = setup(cfg)
    engine, model, log, rank, world = job.engine, job.model, job.log, job.rank, job.world
    n_params = job.n_params
    flops_per_sample = model.flops_per_sample()
    log(f"model {cfg['model_size']}: {n_params / 1e6:.2f} M params | grid {job.grid} = {model.L} tokens, "
        f"{model.n_keep()} visible (mask ratio {1 - model.n_keep() / model.L:.4f} realised, {cfg['mask_ratio']} asked) | "
        f"world {world} = dp {job.dp_size} x cp {job.cp} ({cfg['cp_impl'] if job.cp > 1 else 'no cp'}) | "
        f"global batch {job.global_batch} | "
        f"peak lr {job.peak_lr:.3g} | {job.dtype} on {job.device.type}")

    # ---- resume from the newest complete checkpoint (checkpoint.py)
    ckpt_dir = os.path.join(cfg["out_dir"], "ckpt")
    start, seen = checkpoint.resume(engine, cfg, ckpt_dir, world, job.dtype, log)
    if start:
        job.sampler.offset = seen - start * job.global_batch  # 0 unless the global batch changed (allow_batch_change)
        with open(os.path.join(ckpt_dir, f"step_{start:07d}", "COMPLETE")) as f:
            was = json.load(f).get("stores")
        if was and was != job.stores_digest:
            log(f"WARNING: the training stores or sample_weighting differ from those of step_{start:07d} (a glob that "
                f"finds more stores now, another manifest): the run goes on, but not on the samples it would have had")
    if cfg["eval_only"]:
        if not start:
            raise configurator.ConfigError(f"eval_only=True but {ckpt_dir} holds no complete checkpoint to evaluate")
        val, _ = evaluate.on_job(job, start, None)  # redraws that step's figure; log.jsonl is the run's, left alone
        log(json.dumps({"step": start, "val_loss": val}))  # the last line: the value, as log.jsonl holds it
        return 0
    if start is None:
        return 0  # the run is already complete

    # ---- the training loop. The prefetcher reads the next micro batches in threads while we compute.
    os.makedirs(cfg["out_dir"], exist_ok=True)
    if rank == 0 and os.path.exists(os.path.join(cfg["out_dir"], "STOPPED")):
        os.remove(os.path.join(cfg["out_dir"], "STOPPED"))  # an earlier stop's: this run is going on from it
    log_file = open(os.path.join(cfg["out_dir"], "log.jsonl"), "a") if rank == 0 else None
    tb = (importlib.import_module("torch.utils.tensorboard").SummaryWriter(os.path.join(cfg["out_dir"], "tb"))
          if cfg["tensorboard"] and rank == 0 else None)
    t_run, eval_time = time.time(), 0.0
    end = cfg["max_steps"] if cfg["stop_step"] <= 0 else min(cfg["max_steps"], cfg["stop_step"])
    batches = micro_batches(job, start, end)
    t_last, data_time, steps_since, bytes_last = time.time(), 0.0, 0, job.sampler.bytes_read()
    pending = []  # (step, loss tensor, lr, seconds, data wait) of the steps not yet read back from the device

    def read_back():
        """One host sync for all pending steps: their losses to the log, and a non-finite one stops all ranks
        together (all hold the same reduced value), before any checkpoint of those weights is written."""
        losses = torch.cat([p[1] for p in pending]).tolist() if pending else []
        for (st, _, lr_, t_, w_), loss_ in zip(pending, losses):
            if not math.isfinite(loss_):
                raise FloatingPointError(f"non-finite loss ({loss_}) at step {st}: stopping; no checkpoint of these "
                                         f"weights is written. Lower blr or raise warmup_steps, and check the data "
                                         f"for NaN/inf outside dead traces.")
            if log_file:
                log_file.write(json.dumps({"step": st, "loss": loss_, "lr": lr_, "step_s": round(t_, 5),
                                           "wait_s": round(w_, 5)}) + "\n")
            if tb:
                tb.add_scalar("loss/train", loss_, st)
                tb.add_scalar("lr", lr_, st)
        if log_file:
            log_file.flush()
        pending.clear()
        return losses[-1] if losses else float("nan")

    def validate_at(done):
        """Evaluate the weights after `done` optimizer steps (the weights training step `done` starts from, and
        checkpoint step_{done} holds): val_loss to the log, figures, tensorboard."""
        nonlocal eval_time, t_last
        if job.val_sampler is None:
            return
        read_back()  # the training records up to here are in log.jsonl before loss.png reads it
        t0 = time.time()
        val, fig = evaluate.on_job(job, done, log_file)
        if tb:
            tb.add_scalar("loss/val", val, done)
            if fig is not None:
                tb.add_figure("reconstruction", fig, done)
            tb.flush()
        eval_time += time.time() - t0
        t_last += time.time() - t0  # the next log line's ms/step and samples/s are training's alone

    stopped = None  # the signal that stopped the run, if one did
    try:
        if stop:
            stop.armed = True  # from here a stop signal is a checkpoint at the next step boundary (checkpoint.py)
        if start == 0:
            validate_at(0)  # the untrained model: where the curve starts
        for step in range(start, end):
            t_step = time.time()
            step_loss, lr, wait, stop_flags = train_step(job, step, batches, stop.local() if stop else 0.0)
            # (step_s in log.jsonl: host time; on GPU, without a sync per step, the time to queue the step's work.
            # The log line's ms/step spans a read-back, a sync, so it is the device's time too.)
            pending.append((step, step_loss, lr, time.time() - t_step, wait))
            data_time += wait
            steps_since += 1
            stop_now = stop is not None and stop.agreed(stop_flags)  # the same answer on every rank
            ckpt_now = (step + 1) % cfg["ckpt_interval"] == 0 or step + 1 == end or stop_now
            if step % cfg["log_interval"] == 0 or step == end - 1 or stop_now:
                loss_now = read_back()
                dt = (time.time() - t_last) / steps_since
                sps = job.global_batch / dt
                flops = flops_per_sample * sps  # achieved FLOP/s, whole job
                mem = (torch.cuda.max_memory_allocated() if job.on_gpu
                       else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2 ** 30
                speed = (f"MFU {100 * flops / (world * cfg['gpu_peak_flops']):.1f}%" if job.on_gpu
                         else f"{flops / world / 1e9:.2f} GFLOP/s/rank")
                gbps = (job.sampler.bytes_read() - bytes_last) / (dt * steps_since) / 1e9  # this rank's reads
                log(f"step {step:5d} | loss {loss_now:.4f} | lr {lr:.3e} | {sps:.2f} samples/s | "
                    f"{sps * model.L:,.0f} tok/s | {1000 * dt:.0f} ms/step | {speed} | data {gbps:.3f} GB/s/rank, "
                    f"wait {100 * data_time / (dt * steps_since):.1f}% | peak mem {mem:.2f} GB")
                t_last, data_time, steps_since, bytes_last = time.time(), 0.0, 0, job.sampler.bytes_read()
            if (step + 1) % cfg["eval_interval"] == 0 or step + 1 == cfg["max_steps"]:
                validate_at(step + 1)  # before the checkpoint: a resume from it does not evaluate it again
            if ckpt_now:
                read_back()  # no checkpoint after a non-finite loss
                n_seen = job.sampler.offset + (step + 1) * job.global_batch  # (offset: see data.Sampler)
                checkpoint.save(engine, ckpt_dir, step + 1, {"step": step + 1, "config": cfg, "dtype": str(job.dtype),
                                                            "samples_seen": n_seen, "stores": job.stores_digest},
                                cfg["keep_ckpts"], rank)
                log(f"checkpoint step_{step + 1:07d} written to {ckpt_dir}")
                # a signal that arrived during the write stops here, at this checkpoint
                stop_now = stop_now or (stop is not None and step + 1 < end and stop.agree_now(job.device))
            if stop_now:  # which signals the ranks got (once, at the stop): launch.sh requeues only after SIGUSR1
                names = [None] * world
                torch.distributed.all_gather_object(names, stop.signal)
                stopped = " and ".join(sorted({n for n in names if n}))
                break
        read_back()
        wall = time.time() - t_run
        if job.val_sampler is not None:
            log(f"evaluation took {eval_time:.1f} s of the loop's {wall:.1f} s ({100 * eval_time / wall:.1f}%)")
    finally:
        if stop and not stopped:
            stop.armed = False  # the end (or an error): a signal now just ends the process. (After a stop it stays
            # armed, so that a repeat of the signal cannot kill a rank before STOPPED is written.)
        batches.close()
        job.sampler.close()
        if job.val_sampler is not None:
            job.val_sampler.close()
        if tb:
            tb.close()
    if stopped and step + 1 < cfg["max_steps"]:  # (a stop at the last step is just the end of the run)
        msg = (f"stopped by {stopped} after {step + 1} steps: checkpoint {ckpt_dir}/step_{step + 1:07d} is complete; "
               f"run the same command again to continue (exit code {checkpoint.RESUMABLE}: stopped, resumable)")
        if rank == 0:
            checkpoint.write_stopped(cfg["out_dir"], msg)
        log(msg)
        torch.distributed.barrier()  # no rank (no node's launch.sh) ends before STOPPED exists
        stop.finished()
        return checkpoint.RESUMABLE
    return 0


def cli(argv):
    """`python train.py ...`: main(), with bad input or a diverged run as one clear line and an exit code: 0 done,
    2 bad input, 3 diverged, checkpoint.RESUMABLE (75) stopped by a signal at a complete checkpoint.
    Under launch.sh (MAE_ERROR_FILE set), each failing rank also appends its first line there, so that
    launch.sh can end with the first rank's reason rather than with torchrun's traceback."""
    rank = os.environ.get("RANK", "0")
    stop = checkpoint.StopRequest() if threading.current_thread() is threading.main_thread() else None
    try:
        rc = main(argv, stop)
    except (configurator.ConfigError, data.DataError, FloatingPointError, ring_attention.CPMismatchError) as e:
        # bad input or a diverged run: one clear line, non-zero exit, nothing half-written
        if rank == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        note_error(f"error: {e}" if rank == "0" else f"error: (rank {rank}) {e}")
        rc = 2 if not isinstance(e, FloatingPointError) else 3
    except Exception as e:  # a bug, or a failure of a peer: the traceback follows; launch.sh names the first
        note_error(f"error: (rank {rank}) {type(e).__name__}: {' '.join(str(e).split())[:300]}")
        raise
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if rc == checkpoint.RESUMABLE and os.environ.get("MAE_LAUNCHER") == "launch.sh":
        rc = 0  # launch.sh finds STOPPED and exits 75 itself; a non-zero rank would make torchrun report a failure
    return rc


def note_error(line):
    """One line appended to launch.sh's MAE_ERROR_FILE (O_APPEND: the ranks' lines do not interleave)."""
    path = os.environ.get("MAE_ERROR_FILE")
    if path:
        with open(path, "a") as f:
            f.write(line.replace("\n", " ") + "\n")


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
