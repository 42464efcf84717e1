"""
The training strategies behind one engine: DeepSpeed ZeRO-2, DeepSpeed ZeRO-3, PyTorch FSDP2 (fully_shard).

    engine, optimizer = build(model, cfg, dtype, device, make_optimizer)

make_optimizer(model) builds the optimizer (train.py passes model.configure_optimizers at the run's peak lr): a
function, not an optimizer, because FSDP2 replaces the model's parameters with DTensor shards, and its optimizer
must be built over those, after sharding. The strategies only wrap the model and the optimizer they are given.

The engine is DeepSpeed's, or FSDP2Engine with the same few calls (engine(x, ids_keep=...), backward(loss),
step(), save_checkpoint / load_checkpoint, .module), so train.py's loop and infra/checkpoint.py are one code path
for every strategy. What each strategy keeps on a rank (infra/plan.py counts the same bytes):
    zero2  weights replicated; fp32 masters, AdamW moments and gradients partitioned over all ranks
    zero3  the weights partitioned too, gathered layer by layer for forward and backward
    fsdp2  like zero3, with PyTorch's DTensor shards: one all-gather per transformer block
Gradient semantics are the same under all three: the mean over the whole world (train.py's docstring says
why that is the mean over samples with context parallelism too).
"""
import os
import sys
import threading

import torch

ZERO3_PERSIST = int(1e5)  # ZeRO-3 never partitions parameters of at most this many elements (DeepSpeed's default)
LOCK_SAY_S = 5.0  # a wait for another process's build of DeepSpeed's CPU op says so after this long (a build: a minute)


def build(model, cfg, dtype, device, make_optimizer):
    """Wrap `model` (built and seeded identically on every rank) for cfg["strategy"], with the optimizer
    make_optimizer(model) builds (train.py sets each step's lr in its groups). torch.distributed must be
    initialised."""
    strategy, on_gpu = cfg["strategy"], device.type == "cuda"
    if strategy == "fsdp2":
        engine = FSDP2Engine(model, cfg, dtype, device, make_optimizer)
        return engine, engine.optimizer
    import deepspeed  # (train.py imported it first, after choosing DeepSpeed's accelerator)
    optimizer = make_optimizer(model)
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg["micro_batch"],
        "gradient_accumulation_steps": cfg["grad_accum"],
        "gradient_clipping": cfg["grad_clip"],
        "bf16": {"enabled": dtype == torch.bfloat16},
        # gradients in fp32, as FSDP2 keeps them here (reduce_dtype) and Megatron does: reduced in fp32
        # (communication_data_type) AND accumulated and kept in fp32 (grad_accum_dtype). Without the latter,
        # ZeRO-2/3 allocate the gradient partition in the model dtype and round the fp32-reduced result back
        # to bf16 (stage_1_and_2.py, stage3.py): with an earlier DeepSpeed that strayed far further from the fp32
        # run than FSDP2 (0.19.8 gives the same losses without it: tests/test_bf16.py). `python -m bench bf16
        # config/quickstart.py` measures each strategy's distance from fp32 beside FSDP2's (docs/measurements.md).
        "communication_data_type": "fp32",
        "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {
            # ZeRO-2: optimizer state and gradients partitioned over all ranks, weights replicated.
            # ZeRO-3: the weights too, gathered layer by layer for forward and backward.
            "stage": 2 if strategy == "zero2" else 3,
            # reduce_scatter + contiguous_gradients also keep the gradient all-reduce on for CPU tensors.
            "contiguous_gradients": True, "reduce_scatter": True, "overlap_comm": on_gpu,
            # buckets: gradients are copied into a reduce bucket of this many elements (ZeRO-2: two with
            # overlap_comm, in the compute dtype; ZeRO-3: one, in fp32) and reduced a bucket at a time; ZeRO-3
            # prefetches the next layers' weights up to a tenth of it (DeepSpeed's defaults: 5e8 and 5e7).
            # infra/plan.py counts the same bytes (state_bytes).
            "reduce_bucket_size": cfg["zero_bucket"], "allgather_bucket_size": cfg["zero_bucket"],
            "stage3_prefetch_bucket_size": cfg["zero_bucket"] // 10,
            # ZeRO-3 does not release a gathered weight that the forward+backward trace uses again within
            # max_reuse_distance elements (so a model under half of it stays whole on every rank from forward
            # to backward), and prefetches no further than max_live_parameters resident (DeepSpeed's defaults:
            # 1e9 both). Parameters of at most 1e5 elements (norms, biases) are never partitioned at all.
            "stage3_max_live_parameters": cfg["zero3_max_live"], "stage3_max_reuse_distance": cfg["zero3_max_live"],
            "stage3_param_persistence_threshold": ZERO3_PERSIST,
            # ZeRO-3 normally swaps F.linear for its own function, which (for 3D inputs) does a matmul and then
            # adds the bias: in bf16 two roundings where addmm makes one, so bf16 ZeRO-3 drifted further from fp32
            # than ZeRO-2 and FSDP2 (`python -m bench bf16 config/quickstart.py`). It saves the same tensors as
            # F.linear, whose backward works under ZeRO-3 too (the weights are gathered before each module's
            # backward).
            # Off: the same linear as the other strategies, and the same bf16 losses as ZeRO-2 (the same bench).
            "memory_efficient_linear": False,
        },
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 9,  # we print our own log line
    }
    # DeepSpeed casts the module to bf16 in place, then makes its fp32 master weights FROM that bf16 copy: the
    # init's low bits would be gone. They matter: an early update (lr x 1 during warmup) is far below a bf16
    # weight's spacing, so round(round(init) + update) = round(init) and the weights do not move for many
    # steps, while round(init + update) moves by the update on average (FSDP2 keeps the fp32 init as its
    # master: on the quickstart, bf16 ZeRO-2 strayed far further from the fp32 run than FSDP2, as `python -m bench
    # bf16 config/quickstart.py` measures; docs/measurements.md keeps the figures from before this fix).
    # So the fp32 init goes into the masters, through DeepSpeed's own setter.
    init = {n: p.detach().clone() for n, p in model.named_parameters()} if dtype != torch.float32 else None
    if not on_gpu:
        load_cpu_comm_op()
    import_muon_uncompiled()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    if init is not None:
        for n, p in engine.module.named_parameters():
            set_fp32_master(engine.optimizer, p, init[n].to(device))
    return engine, optimizer


def import_muon_uncompiled():
    """DeepSpeed's ZeRO engine imports its Muon optimizer module as it starts (and at every ZeRO-2 gradient
    reduction) for isinstance checks. That module wraps three functions in torch.compile at import, and a
    torch.compile call imports torch._dynamo and torch._inductor: seconds at every rank's start (`python -X
    importtime train.py ...`), for an optimizer this project never builds. So it is imported here first, with each
    torch.compile deferred to its function's first call: the same module and functions, compiled when (never,
    here) they first run. Under compile=True train.py imports the compiler itself."""
    import functools
    import sys
    name = "deepspeed.runtime.zero.muon.muon_optimizer"
    if name in sys.modules:
        return
    compile_now = torch.compile

    def compile_later(fn=None, **kw):  # torch.compile(fn, **kw) or @torch.compile(**kw)
        if fn is None:
            return lambda f: compile_later(f, **kw)
        compiled = []

        @functools.wraps(fn)
        def first_call_compiles(*a, **k):
            if not compiled:
                compiled.append(compile_now(fn, **kw))
            return compiled[0](*a, **k)
        return first_call_compiles

    torch.compile = compile_later
    try:
        __import__(name)
    except ImportError:  # (a DeepSpeed without Muon: nothing to import)
        pass
    finally:
        torch.compile = compile_now


def load_cpu_comm_op():
    """On CPU, DeepSpeed's start (init_distributed) JIT-builds, or re-checks with ninja, its shared-memory comm op
    inside torch's file baton: a bare lock file in the op's build folder, which nothing removes when its holder is
    killed there (a scancel, a launcher's kill -9, a timeout). Every later CPU run on the machine then waits on it
    forever, silently. So each rank loads the op here first, holding an flock of its own beside the baton (the
    kernel drops an flock when its holder dies): while it is held no process of ours is inside the baton, and a
    baton found then is a dead holder's, removed with a warning. DeepSpeed finds the op loaded (its builder keeps
    it per process). Waiting for that flock (another rank or run building the op: a minute of g++; or a holder
    stopped with Ctrl-Z, or hung) says so after LOCK_SAY_S, once, naming the holder (flock_holders).
    One ninja for every run (one_ninja): torch runs the `ninja` first on PATH, and two of them disagree about the
    folder's build log (pip's ninja 1.13, a deepspeed dependency in the venv, hashes its commands otherwise than a
    system ninja 1.11), so each rebuilt what the other had built: a minute of g++ for every run that followed one
    started the other way (`bash launch.sh`, which puts the venv first on PATH, after `python train.py`, which need
    not), with every other run waiting on the lock meanwhile."""
    import fcntl

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return  # DeepSpeed goes on without it, as it would
    folder = _get_build_directory(builder.name, False)  # (torch's own rule: TORCH_EXTENSIONS_DIR or ~/.cache)
    path = os.path.join(folder, "lock.holder")
    with open(path, "a") as guard:  # (closing it drops the flock)
        def say():
            pids = ", ".join(f"pid {p}" for p in flock_holders(path) if p != os.getpid()) or "another process"
            print(f"waiting for {path}: {pids} holds it while building DeepSpeed's CPU comm op there (a minute of "
                  f"g++); this run goes on when it is done. A holder that died has let go already; one stopped or "
                  f"hung keeps it until it ends: `fuser -v {path}` names it", flush=True)
        timer = threading.Timer(LOCK_SAY_S, say)
        timer.daemon = True
        timer.start()
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
        finally:
            timer.cancel()
        baton = os.path.join(folder, "lock")
        if os.path.exists(baton):
            print(f"WARNING: removing {baton}, left by a process killed while it built DeepSpeed's CPU comm op "
                  f"(every CPU run would wait on it forever)", flush=True)
            os.remove(baton)
        one_ninja()
        builder.load(verbose=False)


def one_ninja():
    """The ninja installed beside this interpreter (the venv's, a deepspeed dependency) first on PATH, where there
    is one: every run builds with the same ninja however it was started (load_cpu_comm_op says why)."""
    here = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if os.path.exists(os.path.join(here, "ninja")) and path.split(os.pathsep)[0] != here:
        os.environ["PATH"] = here + os.pathsep + path


def flock_holders(path):
    """The pids holding an flock on `path`, from /proc/locks (Linux; elsewhere, or unreadable: [])."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return sorted({int(r[4]) for r in rows if len(r) > 5 and r[1] == "FLOCK" and r[5] == dev and r[4].isdigit()})


def set_fp32_master(opt, p, value):
    """Write `value` (the whole parameter, fp32) into this rank's fp32 master copy of parameter p. ZeRO-2:
    DeepSpeed's own setter. ZeRO-3: its setter cuts this rank's slice with narrow(), which runs past the end on
    the last rank when p's size does not divide by the world size (the partitions are padded): 24 ranks and a
    1024-wide layer, say. So the slice is cut here, clipped to the parameter, the padding left alone."""
    from deepspeed.utils import safe_set_full_fp32_param
    if not hasattr(p, "ds_id"):
        return safe_set_full_fp32_param(p, value)
    part, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False)
    flat = value.flatten()
    lo = opt._get_param_partition_rank(p) * p.partition_numel()  # every rank's partition: the padded size
    hi = min(lo + part.numel(), flat.numel())
    if hi > lo:
        part.data[: hi - lo].copy_(flat[lo:hi])


class FSDP2Engine:
    """PyTorch FSDP2 (fully_shard) behind the few calls of the DeepSpeed engine that this file uses:
    engine(x, ids_keep=...), backward(loss), step(), save_checkpoint / load_checkpoint, .module. So the training
    loop is the same for every strategy, and so are the gradient semantics: FSDP2 reduce-scatters the mean
    over the whole world, as ZeRO does; backward divides by grad_accum, as DeepSpeed's engine does."""

    def __init__(self, model, cfg, dtype, device, make_optimizer):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for blk in list(model.blocks) + list(model.decoder_blocks):  # one all-gather per block
            fully_shard(blk, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)  # the rest: embeddings, tokens, norms, heads
        self.module, self.cfg, self.micro = model, cfg, 0
        self.optimizer = make_optimizer(model)  # after sharding: it steps the local shards

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()

    def backward(self, loss):
        (loss / self.cfg["grad_accum"]).backward()

    def step(self):
        self.micro += 1
        if self.micro % self.cfg["grad_accum"]:
            return  # gradients accumulate until the last micro step
        if self.cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg["grad_clip"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.module, self.optimizer)
        return {"model": msd, "optim": osd}

    def save_checkpoint(self, ckpt_dir, tag, client_state):
        import torch.distributed.checkpoint as dcp
        path = os.path.join(ckpt_dir, tag)
        dcp.save(self._state(), checkpoint_id=path)  # every rank writes its shards
        if torch.distributed.get_rank() == 0:
            torch.save(client_state, os.path.join(path, "client_state.pt"))

    def load_checkpoint(self, ckpt_dir, tag):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict
        path = os.path.join(ckpt_dir, tag)
        state = self._state()
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return path, torch.load(os.path.join(path, "client_state.pt"), weights_only=False)
