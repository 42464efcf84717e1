"""
The run's log: out_dir/log.jsonl (one JSON record per training step and per evaluation), tensorboard, and the log
line on rank 0's stdout.

    check_log(path, repair, log)   setup: log.jsonl as a relaunch finds it (a crash's torn last line dropped)
    describe(job)                  the run's first line: the model, its tokens and mask, the layout, the batch
    runlog = RunLog(job)           the loop: step() per step, line() at log steps, evaluate() at evaluations,
                                   end() after the last step, close() always

It only logs. The lease, the stop signals and the checkpoints are infra/ops.py's; the evaluation itself is
infra/evaluate.py's.
"""
import importlib
import json
import math
import os
import resource
import time

import torch

from configurator import ConfigError
from infra import evaluate, plan



def describe(job):
    """The run's first line: the model, its tokens and mask, the layout, the batch, the lr, the dtype."""
    cfg, model = job.cfg, job.model
    visible = (f"{model.n_keep()} visible (mask ratio {1 - model.n_keep() / model.L:.4f} realised, "
               f"{cfg['mask_ratio']} asked)" if cfg["task"] == "mae"
               else f"all visible, {cfg['classes']} classes of {cfg['label_var']!r}")
    return (f"model {cfg['model_size']}{' (fine-tuning: segment)' if cfg['task'] == 'segment' else ''}: "
            f"{job.n_params / 1e6:.2f} M params | grid {job.grid} = {model.L} tokens, {visible} | "
            f"world {job.world} = dp {job.dp_size} x cp {job.cp} ({cfg['cp_impl'] if job.cp > 1 else 'no cp'}) | "
            f"global batch {job.global_batch} | peak lr {job.peak_lr:.3g} | {job.dtype} on {job.device.type}")


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
        raise ConfigError(
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
        time to queue the step's work. This line spans a read-back, a sync, so it is the device's time too.)"""
        job, cfg = self.job, self.job.cfg
        loss = self.read_back()
        dt = (time.time() - self.t_last) / self.since
        sps = job.global_batch / dt
        flops = plan.flops_per_sample(job.model) * sps  # achieved FLOP/s, whole job
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
        record, fig = evaluate.validate(self.job, done, self.file)
        if self.tb:
            self.tb.add_scalar("loss/val", record["val_loss"], done)
            for c, iou in enumerate(record.get("val_iou", [])):
                self.tb.add_scalar(f"iou/class_{c}", iou, done)
            if fig is not None:
                self.tb.add_figure("reconstruction", fig, done)
            self.tb.flush()
        self.eval_s += time.time() - t0
        self.t_last += time.time() - t0  # the next log line's ms/step and samples/s are training's alone

    def end(self, t_run):
        """After the last step: its losses to the log, and the evaluations' share of the loop (started at t_run)."""
        self.read_back()
        if self.job.val_sampler is not None:
            wall = time.time() - t_run
            self.job.log(f"evaluation took {self.eval_s:.1f} s of the loop's {wall:.1f} s "
                         f"({100 * self.eval_s / wall:.1f}%)")

    def close(self):
        if self.tb:
            self.tb.close()
