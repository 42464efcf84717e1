"""
Pretrain a 3D ViT-MAE on seismic volumes with DeepSpeed ZeRO-2 (or ZeRO-3, or FSDP2).

    bash launch.sh config/quickstart.py                 # one machine: all GPUs, or 2 CPU ranks
    python train.py config/quickstart.py --max_steps=20 # one process, no launcher

Read top to bottom: check() (every key, its default, meaning and check are in configurator.py; every bad input
fails here, before any work), the lr schedule, setup (distributed, data, the model and its optimizer from model.py,
the strategy's engine), one training step, main() (the config, its check, the dry run or setup) and run(): resume,
then the loop. The run's operations are infra/ops.py's: main() enters them once (out_dir's lease, how a Ctrl-C
ends), and the loop asks them at each step boundary whether to checkpoint and whether to stop (the stop signals,
the checkpoint writes); infra/runlog.py writes the log.
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
import json
import math
import os
import sys
import threading
import time

if __name__ == "__main__":  # a Ctrl-C during the imports below (seconds): one line, not a traceback
    from infra.stop import interruptible_start
    interruptible_start()

import torch

import configurator
import data
import ring_attention
from infra import checkpoint, distributed, dryrun, evaluate, modelfile, outputs, plan, strategies, torch_cp
from infra.cli import run as run_cli
from infra.ops import Operations
from infra.runlog import RunLog, check_log, describe
from infra.stop import StopRequest, launched
from model import build_model, configure_optimizers, mask_noise

# -----------------------------------------------------------------------------
# the config check and the lr schedule


def check(cfg):
    """Every bad input that can be found before any work: each key's value (configurator.check_config), then the
    folder the run writes into and its ckpt/ (an existing file, a read-only one, a store it reads: infra/outputs.py)."""
    configurator.check_config(cfg)
    outputs.check_run_dir(cfg["out_dir"])
    outputs.refuse_inside(cfg["out_dir"], [p for p in cfg["data_paths"] + cfg["val_paths"] if not p.startswith("@")],
                          "out_dir")


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
    floor: dict = None  # evaluate.floor_of's, once per process: the validation's floor (rank 0; {} elsewhere)
    pinned: data.PinnedBuffers = None  # on a GPU: the batches' page-locked host buffers, reused (prepare_batch)
    copy_stream: object = None  # on a GPU: the side stream the batches are copied to the device on (to_device)

    @property
    def on_gpu(self):
        return self.device.type == "cuda"


def setup(cfg):
    """Distributed init, data, model, optimizer, the strategy's engine. Returns a Job."""
    rank, world, device = distributed.init()  # torchrun's ranks, or a world of 1
    configurator.check_world(cfg, world)  # (the world splits into cp groups)
    cp_rank, dp_rank, dp_size, cp_group = distributed.cp_groups(cfg["cp"])
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16}[cfg["dtype"]]
    global_batch = cfg["micro_batch"] * cfg["grad_accum"] * dp_size
    job = Job(cfg, rank, world, device, dtype, cfg["cp"], cp_rank, dp_rank, dp_size, cp_group, global_batch,
              peak_lr=cfg["blr"] * global_batch / 256, log=print if rank == 0 else (lambda *a, **k: None))
    if job.on_gpu:
        job.pinned, job.copy_stream = data.PinnedBuffers(), torch.cuda.Stream()
    # ---- the run's log as a crash may have left it (rank 0 reads it; a damaged one refused on every rank)
    distributed.on_rank_0(lambda: check_log(os.path.join(cfg["out_dir"], "log.jsonl"), not cfg["eval_only"], job.log))
    # ---- data: the training stream and the held-out one (data.samplers)
    job.sampler, job.val_sampler, job.stores_digest = data.samplers(cfg, cp_rank, dp_rank, dp_size, job.log)
    # ---- model. Same init on every rank (seeded), as data parallelism requires.
    torch.manual_seed(cfg["seed"])
    job.model = model = build_model(cfg)
    model.set_grad_ckpt(plan.checkpointed(model, cfg))  # grad_ckpt, ckpt_blocks: the blocks the planner ranks first
    job.grid = model.grid
    model.set_context_parallel(job.cp_group, torch_cp.torch_cp_attention if cfg["cp_impl"] == "torch"
                               else ring_attention.ring_attention)
    if job.cp > 1 and cfg["cp_impl"] == "torch":  # PyTorch's ring against ours on this machine, before any work
        for blk in (*model.blocks[:1], *model.decoder_blocks[:1]):  # the encoder's head dim and the decoder's
            torch_cp.verify_torch_cp(job.cp_group, device, dtype, blk.qkv.in_features // blk.heads)
    job.n_params = sum(p.numel() for p in model.parameters())  # before any sharding hides them
    if cfg["init_from"]:  # trained weights, before a strategy shards the model or copies them into its masters
        modelfile.init_from(model, cfg, job.log)
    if cfg["compile"]:  # each block, before any strategy wraps or shards it (blocks of a stack share one graph)
        for blk in list(model.blocks) + list(model.decoder_blocks):
            blk.compile()
    job.engine, job.optimizer = strategies.build(model, cfg, dtype, device,
                                                 lambda m: configure_optimizers(m, cfg, job.peak_lr))
    return job


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
        noise = mask_noise(job.cfg["seed"], ids, job.model.L, job.cp_rank, job.cp)  # (B, L / cp) fp32
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


def train_step(job, step, batches):
    """One optimizer step: grad_accum micro steps. `batches` yields prepared (x, ids_keep) micro batches.
    Returns (the mean loss over the whole job, a 1-element device tensor: reading it is a host sync, which the
    loop does only every log_interval steps; the lr; the seconds the training thread waited for data)."""
    cfg, engine = job.cfg, job.engine
    lr = get_lr(step, job.peak_lr, cfg)
    frozen = step < cfg["freeze_encoder_steps"]  # (fine-tuning: the head learns alone first, model.py says why)
    for group in job.optimizer.param_groups:  # ZeRO wraps this optimizer; its groups stay the ones it steps
        scale = 0.0 if frozen and group.get("encoder") else group.get("lr_scale", 1.0)  # (model.configure_optimizers)
        group["lr"] = lr * scale
    total, wait = torch.zeros(1, device=job.device), 0.0  # (on the device: NCCL reduces only CUDA tensors)
    for micro in range(cfg["grad_accum"]):
        t0 = time.time()
        x, ids_keep = next(batches)  # (micro_batch, 1, crop[0] / cp, crop[1], crop[2]) in the compute dtype
        x, ids_keep = to_device(job, x, ids_keep)  # pinned -> device, not blocking this thread (CPU: as it is)
        wait += time.time() - t0
        loss = engine(x, ids_keep=ids_keep)[0]  # (MAE: loss, pred, mask; segmenter: loss, logits)
        total += loss.detach().float() / cfg["grad_accum"]
        engine.backward(loss * job.cp)  # see the docstring: x cp, then ZeRO averages over the world
        engine.step()  # at the last micro step only (the engine counts them): the gradients' global norm clipped to
        #                grad_clip, one AdamW step (the lr set above), the gradients zeroed; before it, nothing
        #                (DeepSpeed's engine; FSDP2's in infra/strategies.py does the same in five lines)
    # every rank learns the mean loss: the sum over a CP group is the sample's loss, then mean over dp
    torch.distributed.all_reduce(total)
    return total / job.dp_size, lr, wait


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
    check(cfg)
    if cfg["dry_run"]:
        return dryrun.check_launch(cfg)
    with Operations(cfg, stop) as ops:  # out_dir's lease, the stop signals, checkpoints, a Ctrl-C's last line
        ops.job = setup(cfg)
        return run(ops.job, ops)


def run(job, ops):
    """Resume, then the loop: a step, its log line, evaluation, checkpoint, and whether to stop (ops: infra/ops.py).
    Returns the exit code: 0, or a stopped run's."""
    cfg = job.cfg
    job.log(describe(job))  # the run's first line: the model, its tokens and mask, the layout, the batch
    start = resume(job)
    if cfg["eval_only"]:
        return evaluate_only(job, start)
    if start is None:  # the run is already complete: nothing to train; every rank leaves together, as at a run's end
        torch.distributed.barrier()  # (ranks that left at once could abort in gloo's teardown)
        return 0
    end = cfg["max_steps"] if cfg["stop_step"] <= 0 else min(cfg["max_steps"], cfg["stop_step"])
    ops.begin(end)  # an earlier stop's STOPPED removed, stop signals armed
    runlog, t_run = RunLog(job), time.time()
    batches = micro_batches(job, start, end)  # read ahead in threads while we compute
    done = start  # optimizer steps done
    try:
        if start == 0:
            runlog.evaluate(0)  # the untrained model: where the curve starts
        for step in range(start, end):
            t_step = time.time()
            loss, lr, wait = train_step(job, step, batches)
            runlog.step(step, loss, lr, time.time() - t_step, wait)
            done = step + 1
            stopping = ops.should_stop(step)  # a stop signal reached a rank: every rank stops after this step
            if step % cfg["log_interval"] == 0 or done == end or stopping:
                runlog.line(step, lr)
            if done % cfg["eval_interval"] == 0 or done == cfg["max_steps"]:
                runlog.evaluate(done)  # before the checkpoint: a resume from it does not evaluate it again
            if stopping or ops.should_checkpoint(done):
                runlog.read_back()  # no checkpoint after a non-finite loss
                stopping = ops.checkpoint(done) or stopping  # (a signal during the write stops here too)
            if stopping:
                break
        runlog.end(t_run)
    finally:
        ops.close()
        for closing in (batches, runlog):
            closing.close()
    return ops.finish(done)


def resume(job):
    """Load the newest complete checkpoint (weights, optimizer, the data stream's position: infra/checkpoint.py).
    Returns the step to go on from: 0 for a new run, None for a run that is already complete."""
    ckpt_dir = os.path.join(job.cfg["out_dir"], "ckpt")
    start, samples_seen = checkpoint.resume(job.engine, job.cfg, ckpt_dir, job.world, job.dtype, job.log,
                                            job.stores_digest)  # (a WARNING if the stream's stores have changed)
    if start:  # the data stream goes on where it was: 0 unless the global batch changed (allow_batch_change)
        job.sampler.offset = samples_seen - start * job.global_batch
    return start


def evaluate_only(job, start):
    """eval_only=True: evaluate the newest checkpoint (and redraw its figure); log.jsonl is the run's, left alone."""
    if not start:
        raise configurator.ConfigError(f"eval_only=True but {job.cfg['out_dir']}/ckpt holds no complete checkpoint "
                                       f"to evaluate")
    record, _ = evaluate.validate(job, start, None)
    job.log(json.dumps(record))  # the last line: the values, as log.jsonl holds them
    return 0


def cli(argv):
    """`python train.py ...`: main() through infra/cli.py (bad input or a diverged run as one clear line and an exit
    code), with stop signals turned into a checkpoint and exit code RESUMABLE (75), or INTERRUPTED (130: Ctrl-C)."""
    stop = StopRequest() if threading.current_thread() is threading.main_thread() else None
    return launched(run_cli(lambda a: main(a, stop), argv))  # (under launch.sh a stop's code is launch.sh's to say)


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
