"""train.py with test hooks, monkeypatched from outside (nothing of this is in train.py):

    python -m torch.distributed.run ... tests/train_hooks.py CONFIG --key=value ...

MAE_FAULT=die_in_checkpoint:STEP:RANK   that rank dies (exit 17) right after its checkpoint shard for STEP is
                                        written, before the checkpoint is marked complete: a node lost mid-write.
MAE_FAULT=signal_in_checkpoint:STEP:RANK:SIG   that rank sends itself SIG (TERM, USR1) as its checkpoint shard for
                                        STEP starts being written: a stop signal that arrives mid-write.
MAE_FAULT=die_in_conversion             rank 0 dies (exit 17) once DeepSpeed's ds_to_universal has written the whole
                                        universal checkpoint into universal.tmp/, before it is flushed, marked and
                                        renamed: a crash in the middle of an elastic resume's conversion.
MAE_FAULT=slow_step:STEP:SECONDS        every rank sleeps SECONDS as training step STEP begins: a long step, for a
                                        signal to arrive in the middle of.
MAE_FAULT=no_room_check                  save() does not ask the file system for room first: a disk that fills during
                                        the write itself (someone else's files) is what the run meets.
MAE_FAULT=nan_in_padding                after setup, the padding at the end of every ZeRO-3 partition (and of its fp32
                                        master) is set to NaN: what torch.empty may leave there. It is no weight.
MAE_FAULT=slow_check:RANK:SECONDS      that rank sleeps SECONDS before train.py checks its config: one rank's start
                                        lagging the others' (a loaded node).
MAE_FAULT=interrupt_in:plan|setup       a Ctrl-C (KeyboardInterrupt) during start-up: in the planner run for the lease
                                        (before it is taken, inside infra/ops.py's Operations.__enter__), or in
                                        train.setup (after it is taken).
MAE_SAMPLES=DIR                         every training micro batch read appends its global sample ids to
                                        DIR/rank<R>.jsonl.
MAE_PROBE=DIR                           every forward appends to DIR/rank<R>.jsonl what reached the model: the
                                        batch's dtype and the kept token ids (after any strategy's input cast).
MAE_MASTERS=FILE                        after setup, FILE (rank 0) gets the parameters whose fp32 master copy in
                                        DeepSpeed's optimizer differs from the fp32 init (made again, same seed).
MAE_PROFILE=FILE                        step 2 runs under the CPU profiler; FILE gets every copy (aten::_to_copy)
                                        of a batch-shaped tensor, with the profiler's id of its thread. As a
                                        control, one batch-sized conversion is made on the training thread inside
                                        the profile (under record_function "control"): it names that thread, and
                                        shows that the detector sees a conversion there when there is one.
"""
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from infra import checkpoint  # noqa: E402
import data  # noqa: E402
import model  # noqa: E402
import train  # noqa: E402

fault = os.environ.get("MAE_FAULT", "").split(":")
if fault[0] in ("die_in_checkpoint", "signal_in_checkpoint"):
    die_step, die_rank = int(fault[1]), int(fault[2])
    real_setup = train.setup

    def setup(cfg):
        job = real_setup(cfg)
        real_save = job.engine.save_checkpoint

        def save_checkpoint(ckpt_dir, tag, client_state):
            hit = client_state["step"] == die_step and job.rank == die_rank
            if hit and fault[0] == "signal_in_checkpoint":
                os.kill(os.getpid(), getattr(signal, "SIG" + fault[3]))  # handled before the write below begins
            out = real_save(ckpt_dir, tag=tag, client_state=client_state)
            if hit and fault[0] == "die_in_checkpoint":
                os._exit(17)
            return out
        job.engine.save_checkpoint = save_checkpoint
        return job
    train.setup = setup

if fault[0] == "slow_check":
    import time
    real_check = train.check

    def check(cfg):
        if os.environ.get("RANK", "0") == fault[1]:
            time.sleep(float(fault[2]))
        return real_check(cfg)
    train.check = check

if fault[0] == "slow_step":
    import time
    real_train_step = train.train_step

    def train_step(job, step, batches, *a):
        if step == int(fault[1]):
            time.sleep(float(fault[2]))  # (in Python: a signal's handler runs inside the sleep, as in a long step)
        return real_train_step(job, step, batches, *a)
    train.train_step = train_step

if fault[0] == "no_room_check":
    checkpoint.room = lambda ckpt_dir, need_bytes: None

if fault[0] == "nan_in_padding":
    real_setup_p = train.setup

    def setup(cfg):
        job = real_setup_p(cfg)
        padded = 0
        for p in job.engine.module.parameters():
            part = p.ds_tensor.numel()
            real = max(0, min(part, p.ds_numel - torch.distributed.get_rank(group=p.ds_process_group) * part))
            if real < part:
                p.ds_tensor[real:] = float("nan")
                master, _ = job.engine.optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False)
                master.data[real:] = float("nan")
                padded += 1
        print(f"nan_in_padding: rank {job.rank}: {padded} padded partitions", flush=True)
        return job
    train.setup = setup

if fault[0] == "die_in_conversion":
    real_fsync_tree = checkpoint.fsync_tree

    def fsync_tree(path):
        if path.endswith("universal.tmp"):
            os._exit(17)
        return real_fsync_tree(path)
    checkpoint.fsync_tree = fsync_tree

if fault[0] == "interrupt_in":
    from infra import plan

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    if fault[1] == "plan":
        plan.plan = interrupted
    else:
        train.setup = interrupted

samples = os.environ.get("MAE_SAMPLES")
if samples:
    real_batch = data.Sampler.batch

    def batch(self, step, micro=0):
        x, ids = real_batch(self, step, micro)
        if self.stream == "train":
            with open(os.path.join(samples, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "ids": ids}) + "\n")
        return x, ids
    data.Sampler.batch = batch

probe = os.environ.get("MAE_PROBE")
if probe:
    real_forward = model.MAE.forward  # FSDP2 swaps the class for a subclass: it inherits this

    def forward(self, x, noise=None, ids_keep=None):
        if self.training:
            with open(os.path.join(probe, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
                f.write(json.dumps({"dtype": str(x.dtype), "ids_keep": ids_keep.tolist()}) + "\n")
        return real_forward(self, x, noise, ids_keep)
    model.MAE.forward = forward

masters_to = os.environ.get("MAE_MASTERS")
if masters_to:
    from deepspeed.utils import safe_get_full_fp32_param
    real_setup_m = train.setup

    def setup(cfg):
        job = real_setup_m(cfg)
        torch.manual_seed(cfg["seed"])  # setup's init, again
        init = dict(model.build_model(cfg).named_parameters())
        differ = [n for n, p in job.engine.module.named_parameters()  # (a collective under ZeRO-3: every rank)
                  if not torch.equal(safe_get_full_fp32_param(p).cpu(), init[n].detach())]
        if job.rank == 0:
            with open(masters_to, "w") as f:
                json.dump(differ, f)
        return job
    train.setup = setup

profile_to = os.environ.get("MAE_PROFILE")
if profile_to:
    from torch.profiler import ProfilerActivity, profile, record_function
    real_step = train.train_step

    def train_step(job, step, batches, *a):
        if step != 2:
            return real_step(job, step, batches, *a)
        c = job.cfg
        shape = [c["micro_batch"], 1, c["crop"][0] // job.cp, c["crop"][1], c["crop"][2]]
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out = real_step(job, step, batches, *a)
            with record_function("control"):
                torch.randn(shape).to(torch.bfloat16)
        events = prof.events()
        training_thread = next(e.thread for e in events if e.name == "control")

        def under_control(e):
            while e is not None and e.name != "control":
                e = e.cpu_parent
            return e is not None
        copies = [{"shapes": e.input_shapes, "thread": e.thread, "control": under_control(e)} for e in events
                  if e.name == "aten::_to_copy" and e.input_shapes and list(e.input_shapes[0]) == shape]
        with open(profile_to, "w") as f:
            json.dump({"training_thread": training_thread, "copies": copies}, f)
        return out
    train.train_step = train_step

sys.exit(train.cli(sys.argv[1:]))
