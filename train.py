"""
Pretrain a 3D ViT-MAE on seismic volumes with DeepSpeed ZeRO-2 (or ZeRO-3, or FSDP2).

    bash launch.sh config/quickstart.py                 # one machine: all GPUs, or 2 CPU ranks
    python train.py config/quickstart.py --max_steps=20 # one process, no launcher

Read top to bottom: the config check (every key, its default and meaning are in configurator.py; every bad
input fails here, before any work), setup (distributed, data, model, the strategy's engine), one training
step, the run's log, main() (the config, its check, the dry run or setup) and run(): resume, then the loop with its
evaluations, checkpoints and stop signals.
One training step is grad_accum micro steps of micro_batch samples on each of the dp_size data-parallel
ranks, and each sample is split over the cp ranks of a context-parallel group:
    world        = dp_size * cp                                 (CP groups: contiguous ranks, one node)
    global_batch = micro_batch * grad_accum * dp_size          (samples per optimizer step)
    lr           = blr * global_batch / 256                     (the MAE scaling rule)
Gradient semantics with cp > 1: each rank's loss is its share of the sample's masked error divided by
the masked count of the whole sample, multiplied by cp before backward; ZeRO averages gradients over
the whole world, so the result is the mean over the dp_size samples, exactly as with cp = 1.
"""

import dataclasses
import importlib
import json
import math
import os
import resource
import signal
import sys
import threading
import time

if __name__ == "__main__":  # a Ctrl-C while the imports below run (seconds) ends the process with one line: under
    # launch.sh the ranks inherit torchrun's ignored SIGINT and launch.sh passes each Ctrl-C on; from cli() on,
    # infra/stop.py's handler has it (0 under launch.sh, which then says how the run ended; else the shell's 130)
    def _interrupted_at_start(*_):
        if os.environ.get("RANK", "0") == "0":
            os.write(2, b"interrupted (Ctrl-C) during start-up, before anything was written\n")
        os._exit(0 if os.environ.get("MAE_LAUNCHER") == "launch.sh" else 130)
    signal.signal(signal.SIGINT, _interrupted_at_start)

import torch

import configurator
import data
import ring_attention
from infra import checkpoint, distributed, dryrun, evaluate, lease, modelfile, outputs, plan, strategies
from infra import stop as stop_signals
from infra.cli import need, run as run_cli
from infra.stop import INTERRUPTED, RESUMABLE, Interrupted, StopRequest, write_stopped
from model import SIZES, aligned_heads, build_model, token_grid

# -----------------------------------------------------------------------------
# the config check: everything that can be checked before any work is done


# The numeric keys' ranges: (least, most, whether the least itself is allowed); None: no bound. Every int or float
# key is here or checked below with a message of its own (tests/test_errors.py holds every key to a bad value).
BOUNDS = {k: (1, None, True) for k in ("max_steps", "micro_batch", "grad_accum", "log_interval", "ckpt_interval",
                                       "keep_ckpts", "in_flight", "prefetch", "zero_bucket", "zero3_max_live",
                                       "max_open_stores", "eval_interval", "nodes", "seg_features")}
BOUNDS.update({k: (0, None, True) for k in ("read_retries", "warmup_steps", "min_lr", "weight_decay", "grad_clip",
                                            "stop_step", "seed", "gpus_per_node", "stop_lead_s", "lease_min_s")})
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
    """Raise ConfigError naming the problem and the fix; data-dependent checks live in data.Sampler."""
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
                raise configurator.ConfigError(f"model_size {cfg['model_size']!r} ({blk.heads} heads of {d}) with "
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
    outputs.check_dir(cfg["out_dir"], "out_dir")
    outputs.refuse_inside(cfg["out_dir"], [p for p in cfg["data_paths"] + cfg["val_paths"] if not p.startswith("@")],
                          "out_dir")
    need(0.0 <= cfg["val_frac"] < 1.0, f"val_frac must be in [0, 1) (0 = no validation), got {cfg['val_frac']}")
    need(cfg["eval_samples"] >= 1, f"eval_samples must be >= 1, got {cfg['eval_samples']} (val_frac=0 and no "
                                   f"val_paths switch validation off)")
    need(not cfg["eval_only"] or cfg["val_paths"] or cfg["val_frac"] > 0,
         "eval_only=True needs a validation set: val_paths, or val_frac > 0 as the run had")
    if cfg["figures"]:
        try:
            importlib.import_module("matplotlib")  # drawn at the first evaluation, after the setup
        except ImportError as e:
            raise configurator.ConfigError(f"figures=True needs matplotlib ({e}): pip install matplotlib (it is in "
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
    need(cfg["task"] != "segment" or bool(cfg["label_var"]),
         "task='segment' needs label_var: the stores' class variable (e.g. 'fault')")
    if cfg["tensorboard"]:
        try:
            importlib.import_module("torch.utils.tensorboard")  # fail now, not after hours of training
        except ImportError as e:
            raise configurator.ConfigError(f"tensorboard=True but torch.utils.tensorboard cannot be imported ({e}): "
                                           f"pip install tensorboard, or drop tensorboard=True") from None


def check_masking(cfg):
    """mask_ratio in (0, 1), leaving at least one visible token of the crop's (scripts/reconstruct.py asks too)."""
    need(0.0 < cfg["mask_ratio"] < 1.0, f"mask_ratio must be in (0, 1), got {cfg['mask_ratio']}")
    L = math.prod(token_grid(cfg["crop"], cfg["patch"]))
    need(int(L * (1 - cfg["mask_ratio"])) >= 1,
         f"mask_ratio {cfg['mask_ratio']} leaves no visible token out of {L}: lower it or use a larger crop")


def get_lr(step, peak_lr, cfg):
    """Linear warmup over warmup_steps (non-zero at step 0), then half-cosine from peak_lr to min_lr,
    reaching min_lr at the last step (max_steps - 1)."""
    warm, last = cfg["warmup_steps"], cfg["max_steps"] - 1
    if step < warm:
        return peak_lr * (step + 1) / warm
    progress = (step - warm) / max(1, last - warm)
    return cfg["min_lr"] + (peak_lr - cfg["min_lr"]) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# -----------------------------------------------------------------------------
# setup: distributed, data, model, the strategy's engine


@dataclasses.dataclass
class Job:
    """Everything a training step needs, built once by setup() (bench/ builds the same)."""
    cfg: dict
    rank: int  # this rank, of `world`; cp_rank within its context-parallel group, dp_rank its group
    world: int
    device: torch.device
    dtype: torch.dtype  # the compute dtype
    cp: int
    cp_rank: int
    dp_rank: int
    dp_size: int
    cp_group: object  # this rank's context-parallel process group (None when cp = 1)
    global_batch: int
    peak_lr: float
    log: object  # print on rank 0, silence elsewhere
    sampler: data.Sampler = None
    val_sampler: data.Sampler = None  # None: no validation
    stores_digest: str = ""  # which stores the training stream draws from, and how (data.samplers)
    model: torch.nn.Module = None  # the plain MAE (the engine wraps it, or shards it in place)
    grid: tuple = ()  # tokens per sample along (inline, crossline, time)
    n_params: int = 0
    engine: object = None  # strategies.build: forward, backward, step, save/load for every strategy
    optimizer: torch.optim.Optimizer = None
    lease: object = None  # lease.Lease: rank 0's hold on out_dir (infra/lease.py); None on the other ranks
    ckpt_bytes: int = 0  # the planner's size of one checkpoint: the room save() asks the file system for
    floor: dict = None  # evaluate.floor_of's, once per process: the validation's floor (rank 0; {} elsewhere)
    pinned: data.PinnedBuffers = None  # on a GPU: the batches' page-locked host buffers, reused (prepare_batch)
    copy_stream: object = None  # on a GPU: the side stream the batches are copied to the device on (to_device)

    @property
    def on_gpu(self):
        return self.device.type == "cuda"


def setup(cfg):
    """Distributed init, data, model, optimizer, the strategy's engine. Returns a Job."""
    rank, world, device = distributed.init()  # torchrun's ranks, or a world of 1
    if world % cfg["cp"]:  # the one check that needs the world size, before any work
        raise configurator.ConfigError(f"world size {world} is not divisible by cp={cfg['cp']}: launch a multiple of "
                                       f"{cfg['cp']} ranks (NPROC=...), or change cp")
    cp_rank, dp_rank, dp_size, cp_group = distributed.cp_groups(cfg["cp"])
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[cfg["dtype"]]
    global_batch = cfg["micro_batch"] * cfg["grad_accum"] * dp_size
    job = Job(cfg, rank, world, device, dtype, cfg["cp"], cp_rank, dp_rank, dp_size, cp_group, global_batch,
              peak_lr=cfg["blr"] * global_batch / 256, log=print if rank == 0 else (lambda *a, **k: None))
    if job.on_gpu:
        job.pinned, job.copy_stream = data.PinnedBuffers(), torch.cuda.Stream()
    # ---- one run per out_dir, before anything is written there: rank 0 takes its lease (or takes over a stale one),
    # and a live one held by another run is refused on every rank (infra/lease.py). The planner's step, evaluation and
    # checkpoint times let another run judge this lease stale from another host before any step is logged.
    p = plan.plan(cfg, world, gpus_per_node=max(1, world // cfg["nodes"]))
    job.ckpt_bytes = int(p["ckpt_bytes"])
    held = distributed.on_rank_0(lambda: lease.acquire(cfg, job.log, cfg["log_interval"] * p["step_s"] + p["eval_s"]
                                                       + p["ckpt_s"], p["eval_s"] + p["ckpt_s"]))
    job.lease = held if rank == 0 else None
    if job.lease:  # (a kill -9 of the launcher: the rank ends at once, out_dir free)
        distributed.at_launcher_gone = job.lease.release
    try:
        build_job(job)
    except BaseException:  # (bad data, a model that does not fit): out_dir is free at once for the corrected relaunch
        if job.lease:
            job.lease.release()
        raise
    return job


def build_job(job):
    """setup's second half, under the lease: the data streams, the model (seeded), its initial weights, the engine."""
    cfg, device, dtype = job.cfg, job.device, job.dtype
    # ---- the run's log as a crash may have left it (rank 0 reads it; a damaged one refused on every rank)
    distributed.on_rank_0(lambda: check_log(os.path.join(cfg["out_dir"], "log.jsonl"), not cfg["eval_only"], job.log))
    # ---- data: the training stream and the held-out one (data.samplers)
    job.sampler, job.val_sampler, job.stores_digest = data.samplers(cfg, job.cp_rank, job.dp_rank,
                                                                    job.dp_size, job.log)
    # ---- model. Same init on every rank (seeded), as data parallelism requires.
    torch.manual_seed(cfg["seed"])
    job.model = model = build_model(cfg, train=True)
    job.grid = model.grid
    model.set_context_parallel(job.cp_group, cfg["cp_impl"])
    if job.cp > 1 and cfg["cp_impl"] == "torch":  # PyTorch's ring against ours on this machine, before any work
        for blk in (*model.blocks[:1], *model.decoder_blocks[:1]):  # the encoder's head dim and the decoder's
            ring_attention.verify_torch_cp(job.cp_group, device, dtype, blk.qkv.in_features // blk.heads)
    job.n_params = sum(p.numel() for p in model.parameters())  # before any sharding hides them
    if cfg["init_from"]:  # trained weights, before a strategy shards the model or copies them into its masters
        modelfile.init_from(model, cfg, job.log)
    if cfg["compile"]:  # each block, before any strategy wraps or shards it (blocks of a stack share one graph)
        for blk in list(model.blocks) + list(model.decoder_blocks):
            blk.compile()
    job.engine, job.optimizer = strategies.build(model, cfg, job.peak_lr, dtype, device)


# -----------------------------------------------------------------------------
# one training step


def prepare_batch(job, x, ids):
    """A micro batch made ready in a prefetch thread (data.Prefetcher), so that the training thread does no
    conversion and only starts an asynchronous copy:
      ids_keep (B, n) int64: the kept tokens, from the fp32 masking noise of the samples `ids` (integers: no
                            strategy's cast of the model's inputs can change them, so every strategy, dtype
                            and dp/cp layout trains on the same masks);
      x (B, 1, Z/cp, Y, X): cast to the compute dtype, on GPU straight into pinned memory (the copy to the
                            device can then overlap compute: a pageable source makes it synchronous, and a
                            cast on the way makes it a CPU conversion on the training thread).
    On GPU both go into page-locked buffers of job.pinned, taken back by to_device once their copy is queued.
    Fine-tuning (task="segment"): no mask (ids_keep None), and x is (B, 2, ...), the labels as channel 1."""
    ids_keep = None
    if job.cfg["task"] == "mae":
        noise = data.mask_noise(job.cfg["seed"], ids, job.model.L, job.cp_rank, job.cp)  # (B, L / cp) fp32
        ids_keep = job.model.keep_ids(noise, job.cp_rank, job.cp)
    if job.on_gpu:
        buf = job.pinned.take(x.shape, job.dtype).copy_(x)
        return buf, None if ids_keep is None else job.pinned.take(ids_keep.shape, ids_keep.dtype).copy_(ids_keep)
    return x.to(job.dtype), ids_keep


def to_device(job, x, ids_keep):
    """A prepared micro batch (prepare_batch) onto the device without blocking the training thread. On a GPU the
    copies run on a side stream (job.copy_stream): they start at once on the copy engine, while the GPU still
    runs the previous step's work, instead of queueing behind it on the compute stream; the compute stream waits
    for them (an event) before anything reads the batch. Their pinned buffers go back to job.pinned with that
    event, to be refilled only once the copy has read them. The device tensors are allocated on the side stream
    and used on the compute stream: record_stream keeps the allocator from handing their memory to the side
    stream's next copy before the compute stream is done with them (so the side stream's pool keeps up to two
    batches' worth of device memory: the one in use and the next one's copy). On CPU: the batch as it is."""
    if not job.on_gpu:
        return x, ids_keep
    compute = torch.cuda.current_stream()
    with torch.cuda.stream(job.copy_stream):
        out = [None if t is None else t.to(job.device, non_blocking=True) for t in (x, ids_keep)]
        done = torch.cuda.Event()
        done.record()
    compute.wait_event(done)
    for on_device, host in zip(out, (x, ids_keep)):
        if on_device is not None:
            on_device.record_stream(compute)
            job.pinned.give_back(host, done)
    return tuple(out)


def micro_batches(job, start, end, depth=None):
    """The micro batches of steps [start, end), prepared and read ahead (prepare_batch); depth: how many
    (default: the config's prefetch)."""
    return data.Prefetcher(job.sampler, start, end, depth=depth or job.cfg["prefetch"],
                           prepare=lambda x, ids: prepare_batch(job, x, ids))


def train_step(job, step, batches, stop=0.0):
    """One optimizer step: grad_accum micro steps. `batches` yields prepared (x, ids_keep) micro batches; `stop`:
    this rank's stop flag (stop.StopRequest), summed over the ranks in the loss's all-reduce.
    Returns (mean loss over the whole job as a 1-element device tensor: reading it is a host sync, which the
    loop does only every log_interval steps; lr; seconds the training thread waited for data; the summed stop
    flags, a 1-element device tensor)."""
    cfg, engine = job.cfg, job.engine
    lr = get_lr(step, job.peak_lr, cfg)
    for group in job.optimizer.param_groups:  # ZeRO wraps this optimizer; its groups stay the ones it steps
        group["lr"] = lr * group.get("lr_scale", 1.0)  # (lr_scale: layer_decay's, strategies.make_optimizer)
    # on the device: NCCL reduces only CUDA tensors
    acc, wait = torch.zeros(2, device=job.device), 0.0  # [loss, stop flag]: one all-reduce carries both
    if stop:
        acc[1] = stop  # (a fill on the device: no host sync)
    for micro in range(cfg["grad_accum"]):
        t0 = time.time()
        x, ids_keep = next(batches)  # (micro_batch, 1, crop[0] / cp, crop[1], crop[2]) in the compute dtype
        x, ids_keep = to_device(job, x, ids_keep)  # pinned -> device, not blocking this thread (CPU: as it is)
        wait += time.time() - t0
        loss = engine(x, ids_keep=ids_keep)[0]  # (MAE: loss, pred, mask; segmenter: loss, logits)
        acc[0] += loss.detach().float() / cfg["grad_accum"]
        engine.backward(loss * job.cp)  # see the docstring: x cp, then ZeRO averages over the world
        engine.step()  # DeepSpeed steps the optimizer at the last micro step only
    # every rank learns the mean loss: the sum over a CP group is the sample's loss, then mean over dp
    torch.distributed.all_reduce(acc)
    return acc[:1] / job.dp_size, lr, wait, acc[1:]


# -----------------------------------------------------------------------------
# the run's log: log.jsonl, tensorboard, the log line


def check_log(path, repair, log):
    """log.jsonl as a relaunch finds it. Records are appended whole, so a crash can only cut its end short: whatever
    follows the last record that parses (half a line, a power loss's zeros) is dropped with a WARNING (repair; an
    eval_only run leaves it and read_losses skips it), and the steps after the checkpoint resumed from are logged
    again. A line that does not parse with records after it is no crash's doing: refused, naming the line."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")  # (the last item: what follows the last newline, b"" in a whole file)

    def record(line):
        try:
            return isinstance(json.loads(line), dict)
        except ValueError:
            return False
    good = [i for i, line in enumerate(lines[:-1]) if record(line)]
    keep = good[-1] + 1 if good else 0  # whole lines up to the last record
    ok = set(good)
    bad = next((i for i in range(keep) if i not in ok), None)
    if bad is not None:
        raise configurator.ConfigError(
            f"{path} line {bad + 1} is not a JSON record ({lines[bad][:80]!r}) and records follow it: a crash cuts only "
            f"the last line, so something else changed the file; repair or delete that line (log.jsonl is the run's "
            f"record, not its state: the checkpoints are), then run again")
    cut = b"\n".join(lines[keep:])
    if cut.strip(b"\n\0 "):
        size = sum(len(line) + 1 for line in lines[:keep])
        if repair:
            os.truncate(path, size)
        log(f"WARNING: {path} ends with {len(cut)} bytes that are not a whole record ({cut[:60]!r}: a line cut short "
            f"by a crash): {'dropped' if repair else 'skipped'}; the steps after the checkpoint are logged again")


class RunLog:
    """Rank 0 writes out_dir/log.jsonl (one record per step, per evaluation) and tensorboard; every rank reads the
    step losses back from the device in batches (a read-back is a host sync: only at log lines, evaluations and
    checkpoints), and a non-finite one stops all ranks together (all hold the same reduced value), before any
    checkpoint of those weights is written."""

    def __init__(self, job):
        self.job, out = job, job.cfg["out_dir"]
        self.file = open(os.path.join(out, "log.jsonl"), "a") if job.rank == 0 else None
        self.tb = (importlib.import_module("torch.utils.tensorboard").SummaryWriter(os.path.join(out, "tb"))
                   if job.cfg["tensorboard"] and job.rank == 0 else None)
        self.pending = []  # (step, loss tensor, lr, seconds, data wait) of the steps not yet read back
        self.since, self.t_last, self.wait, self.bytes_last = 0, time.time(), 0.0, job.sampler.bytes_read()
        self.eval_s = 0.0

    def step(self, step, loss, lr, seconds, wait):
        self.pending.append((step, loss, lr, seconds, wait))
        self.wait += wait
        self.since += 1

    def read_back(self):
        """One host sync for every pending step: their losses to log.jsonl. Returns the last loss."""
        losses = torch.cat([p[1] for p in self.pending]).tolist() if self.pending else []
        for (st, _, lr, t, w), loss in zip(self.pending, losses):
            if not math.isfinite(loss):
                raise FloatingPointError(f"non-finite loss ({loss}) at step {st}: stopping; no checkpoint of these "
                                         f"weights is written. Lower blr or raise warmup_steps, and check the data "
                                         f"for NaN/inf outside dead traces.")
            if self.file:
                self.file.write(json.dumps({"step": st, "loss": loss, "lr": lr, "step_s": round(t, 5),
                                            "wait_s": round(w, 5)}) + "\n")
            if self.tb:
                self.tb.add_scalar("loss/train", loss, st)
                self.tb.add_scalar("lr", lr, st)
        if self.file:
            self.file.flush()
        self.pending.clear()
        return losses[-1] if losses else float("nan")

    def line(self, step, lr):
        """The log line: loss, speed (samples/s, tokens/s, MFU on a GPU), data rate and wait, peak memory, over
        the steps since the last line. (step_s in log.jsonl is host time: on a GPU, without a sync per step, the
        time to queue the step's work. This line spans a read-back, a sync, so it is the device's time too.)
        Also the lease's refresh: out_dir is still this run's."""
        job, cfg = self.job, self.job.cfg
        loss = self.read_back()
        if job.lease:
            job.lease.refresh()
        dt = (time.time() - self.t_last) / self.since
        sps = job.global_batch / dt
        flops = job.model.flops_per_sample() * sps  # achieved FLOP/s, whole job
        mem = (torch.cuda.max_memory_allocated() if job.on_gpu
               else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2 ** 30
        speed = (f"MFU {100 * flops / (job.world * cfg['gpu_peak_flops']):.1f}%" if job.on_gpu
                 else f"{flops / job.world / 1e9:.2f} GFLOP/s/rank")
        gbps = (job.sampler.bytes_read() - self.bytes_last) / (dt * self.since) / 1e9  # this rank's reads
        job.log(f"step {step:5d} | loss {loss:.4f} | lr {lr:.3e} | {sps:.2f} samples/s | "
                f"{sps * job.model.L:,.0f} tok/s | {1000 * dt:.0f} ms/step | {speed} | data {gbps:.3f} GB/s/rank, "
                f"wait {100 * self.wait / (dt * self.since):.1f}% | peak mem {mem:.2f} GB")
        self.since, self.t_last, self.wait, self.bytes_last = 0, time.time(), 0.0, job.sampler.bytes_read()

    def evaluate(self, done):
        """Evaluate the weights after `done` optimizer steps (the weights training step `done` starts from, and
        checkpoint step_{done} holds): val_loss to the log, figures, tensorboard (infra/evaluate.py)."""
        if self.job.val_sampler is None:
            return
        self.read_back()  # the training records up to here are in log.jsonl before loss.png reads it
        t0 = time.time()
        record, fig = evaluate.on_job(self.job, done, self.file)
        if self.tb:
            self.tb.add_scalar("loss/val", record["val_loss"], done)
            for c, iou in enumerate(record.get("val_iou", [])):
                self.tb.add_scalar(f"iou/class_{c}", iou, done)
            if fig is not None:
                self.tb.add_figure("reconstruction", fig, done)
            self.tb.flush()
        self.eval_s += time.time() - t0
        self.t_last += time.time() - t0  # the next log line's ms/step and samples/s are training's alone
        if self.job.lease:
            self.job.lease.refresh()

    def close(self):
        if self.tb:
            self.tb.close()


# -----------------------------------------------------------------------------
# the run


def main(argv, stop=None):
    """The run; `stop`: a StopRequest (cli installs it: SIGTERM / SIGUSR1 / a Ctrl-C stop at a step boundary with a
    checkpoint, and main then returns RESUMABLE, or INTERRUPTED for a Ctrl-C; a second Ctrl-C stops at once)."""
    cfg = configurator.defaults()
    configurator.apply(cfg, argv)
    if cfg["task"] == "segment" and cfg["init_from"] and \
            os.path.abspath(cfg["init_from"]).rstrip("/") == os.path.abspath(cfg["out_dir"]).rstrip("/"):
        cfg["out_dir"] = cfg["out_dir"].rstrip("/") + "_segment"  # fine-tuning never writes into the run it starts from
    check_config(cfg)
    if cfg["dry_run"]:
        return dryrun.check_launch(cfg)
    job = None
    try:
        job = setup(cfg)
        return run(job, stop)
    except KeyboardInterrupt:  # a Ctrl-C that stops at once (infra/stop.py): where the run stands, as the last line
        raise Interrupted(where_it_stands(cfg, started=job is not None)) from None
    except Exception:
        if stop_signals.interrupted:  # a peer stopped at once by the same Ctrl-C, before this rank's own came
            raise Interrupted(where_it_stands(cfg, started=job is not None)) from None
        raise
    finally:  # the run is over on rank 0 (done, stopped, or failed here): out_dir is free for the next one
        if job and job.lease:
            job.lease.release()


def where_it_stands(cfg, started):
    """The last line of a run a Ctrl-C stopped at once: its newest complete checkpoint and how to go on."""
    ckpt_dir = os.path.join(cfg["out_dir"], "ckpt")
    done = checkpoint.complete_checkpoints(ckpt_dir)
    then = (f"{ckpt_dir}/{done[-1][1]} is the newest complete checkpoint: run the same command again to resume "
            f"from it" if done else "no checkpoint was written: the same command starts the run again from step 0")
    return (f"interrupted (Ctrl-C) at once, without a checkpoint of the steps since the last one; {then}" if started
            else f"interrupted (Ctrl-C) during start-up, before any step; {then}")


def run(job, stop):
    """Resume, then the loop with its evaluations, checkpoints and stop signals. Returns the exit code."""
    cfg, model, log = job.cfg, job.model, job.log
    seen = (f"{model.n_keep()} visible (mask ratio {1 - model.n_keep() / model.L:.4f} realised, {cfg['mask_ratio']} "
            f"asked)" if cfg["task"] == "mae" else f"all visible, {cfg['classes']} classes of {cfg['label_var']!r}")
    log(f"model {cfg['model_size']}{' (fine-tuning: segment)' if cfg['task'] == 'segment' else ''}: "
        f"{job.n_params / 1e6:.2f} M params | grid {job.grid} = {model.L} tokens, "
        f"{seen} | "
        f"world {job.world} = dp {job.dp_size} x cp {job.cp} ({cfg['cp_impl'] if job.cp > 1 else 'no cp'}) | "
        f"global batch {job.global_batch} | peak lr {job.peak_lr:.3g} | {job.dtype} on {job.device.type}")

    # ---- resume from the newest complete checkpoint (infra/checkpoint.py)
    ckpt_dir = os.path.join(cfg["out_dir"], "ckpt")
    start, seen = checkpoint.resume(job.engine, cfg, ckpt_dir, job.world, job.dtype, log)
    if start:
        job.sampler.offset = seen - start * job.global_batch  # 0 unless the global batch changed (allow_batch_change)
        was = (checkpoint.read_marker(os.path.join(ckpt_dir, f"step_{start:07d}")) or {}).get("stores")
        if was and was != job.stores_digest:
            log(f"WARNING: the training stores or sample_weighting differ from those of step_{start:07d} (a glob that "
                f"finds more stores now, another manifest): the run goes on, but not on the samples it would have had")
    if cfg["eval_only"]:
        if not start:
            raise configurator.ConfigError(f"eval_only=True but {ckpt_dir} holds no complete checkpoint to evaluate")
        record, _ = evaluate.on_job(job, start, None)  # redraws that step's figure; log.jsonl is the run's, left alone
        log(json.dumps(record))  # the last line: the values, as log.jsonl holds them
        return 0
    if start is None:
        return 0  # the run is already complete

    # ---- the training loop. The prefetcher reads the next micro batches in threads while we compute.
    os.makedirs(cfg["out_dir"], exist_ok=True)
    if job.rank == 0 and os.path.exists(os.path.join(cfg["out_dir"], "STOPPED")):
        os.remove(os.path.join(cfg["out_dir"], "STOPPED"))  # an earlier stop's: this run is going on from it
    runlog, t_run = RunLog(job), time.time()
    end = cfg["max_steps"] if cfg["stop_step"] <= 0 else min(cfg["max_steps"], cfg["stop_step"])
    batches = micro_batches(job, start, end)
    stopped, step = None, start  # the signal that stopped the run, if one did
    try:
        if stop:
            stop.armed = True  # from here a stop signal is a checkpoint at the next step boundary (infra/stop.py)
        if start == 0:
            runlog.evaluate(0)  # the untrained model: where the curve starts
        for step in range(start, end):
            t_step = time.time()
            loss, lr, wait, stop_flags = train_step(job, step, batches, stop.local() if stop else 0.0)
            runlog.step(step, loss, lr, time.time() - t_step, wait)
            stop_now = stop is not None and stop.agreed(stop_flags)  # the same answer on every rank
            if step % cfg["log_interval"] == 0 or step == end - 1 or stop_now:
                runlog.line(step, lr)
            if (step + 1) % cfg["eval_interval"] == 0 or step + 1 == cfg["max_steps"]:
                runlog.evaluate(step + 1)  # before the checkpoint: a resume from it does not evaluate it again
            if (step + 1) % cfg["ckpt_interval"] == 0 or step + 1 == end or stop_now:
                runlog.read_back()  # no checkpoint after a non-finite loss
                save(job, ckpt_dir, step + 1)
                # a signal that arrived during the write stops here, at this checkpoint
                stop_now = stop_now or (stop is not None and step + 1 < end and stop.agree_now(job.device))
            if stop_now:  # which signals the ranks got (once, at the stop): launch.sh requeues only after SIGUSR1
                names = [None] * job.world
                torch.distributed.all_gather_object(names, stop.signal)
                stopped = " and ".join(sorted({n for n in names if n}))
                break
        runlog.read_back()
        if job.val_sampler is not None:
            wall = time.time() - t_run
            log(f"evaluation took {runlog.eval_s:.1f} s of the loop's {wall:.1f} s ({100 * runlog.eval_s / wall:.1f}%)")
    finally:
        if stop and not stopped:
            stop.armed = False  # the end (or an error): a signal now just ends the process. (After a stop it stays
            # armed, so that a repeat of the signal cannot kill a rank before STOPPED is written.)
        batches.close()
        job.sampler.close()
        if job.val_sampler is not None:
            job.val_sampler.close()
        runlog.close()
    if stopped and step + 1 < cfg["max_steps"]:  # (a stop at the last step is just the end of the run)
        code = INTERRUPTED if "SIGINT" in stopped else RESUMABLE
        msg = (f"stopped by {stopped} after {step + 1} steps: checkpoint {ckpt_dir}/step_{step + 1:07d} is complete; "
               f"run the same command again to continue (exit code {code}: "
               f"{'interrupted by Ctrl-C' if code == INTERRUPTED else 'stopped'}, resumable)")
        if job.rank == 0:
            write_stopped(cfg["out_dir"], msg)
        log(msg)
        torch.distributed.barrier()  # no rank (no node's launch.sh) ends before STOPPED exists
        stop.finished()
        return code
    return 0


def save(job, ckpt_dir, done):
    """The checkpoint of the weights after `done` steps, with what a resume needs (infra/checkpoint.py)."""
    n_seen = job.sampler.offset + done * job.global_batch  # (offset: see data.Sampler)
    if job.lease:  # never write (nor rotate) checkpoints in an out_dir that another run has taken over
        job.lease.refresh()
    checkpoint.save(job.engine, ckpt_dir, done, {"step": done, "config": job.cfg, "dtype": str(job.dtype),
                                                 "samples_seen": n_seen, "stores": job.stores_digest},
                    job.cfg["keep_ckpts"], job.rank, job.ckpt_bytes)
    if job.lease:
        job.lease.refresh()
    job.log(f"checkpoint step_{done:07d} written to {ckpt_dir}")


def cli(argv):
    """`python train.py ...`: main() through infra/cli.py (bad input or a diverged run as one clear line and an exit
    code), with stop signals turned into a checkpoint and exit code RESUMABLE (75), or INTERRUPTED (130: Ctrl-C)."""
    stop = StopRequest() if threading.current_thread() is threading.main_thread() else None
    rc = run_cli(lambda a: main(a, stop), argv)
    if rc in (RESUMABLE, INTERRUPTED) and os.environ.get("MAE_LAUNCHER") == "launch.sh":
        rc = 0  # launch.sh finds STOPPED (or its Ctrl-C) and ends with the code itself; a non-zero rank would make
        # torchrun report a failure
    return rc


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
