"""
The dry run (DRY_RUN=1 bash launch.sh CONFIG, or train.py --dry_run=True): every check that needs neither GPUs nor
data, before paying for the cluster. Another live run in out_dir (its lease), the world size for the configured
nodes x gpus_per_node, the SLURM allocation, the checkpoint a relaunch would resume from (or the init_from weights)
against this config, the batch arithmetic, and the planner's verdict (infra/plan.py): memory per GPU, the least
activation checkpointing that fits, samples/s, the stop lead SLURM's warning needs, the S3 requests per second
against the rate S3 documents per prefix (and what lowers them). Prints LAUNCH lines that launch.sh reads; a config
that cannot run is a ConfigError (exit 2), the last thing the user sees.
"""

import math
import os

import torch

import configurator
from infra import checkpoint, lease, modelfile, plan, stop


def check_launch(cfg):
    """DRY_RUN=1 bash launch.sh ...: every check that needs neither GPUs nor data, for the configured cluster
    of nodes x gpus_per_node, and the planner's verdict on memory. Prints a LAUNCH line that launch.sh reads."""
    gpn = cfg["gpus_per_node"] or torch.cuda.device_count() or int(os.environ.get("NPROC", "2"))
    world, cp = cfg["nodes"] * gpn, cfg["cp"]
    print(f"LAUNCH nodes={cfg['nodes']} gpus_per_node={gpn} world={world} config_gpus={cfg['gpus_per_node']}")
    print(f"LAUNCH_OUT_DIR={cfg['out_dir']}")  # where launch.sh looks for STOPPED after the ranks exit
    if os.environ.get("MAE_LAUNCH_NODE") != "1":  # (a node of this job: its rank 0 may hold the lease already)
        lease.check(cfg)  # another live run in out_dir: refused here, before torchrun starts a rank (again in them)
    allocated = os.environ.get("SLURM_JOB_NUM_NODES")
    if allocated and cfg["nodes"] > int(allocated):
        raise configurator.ConfigError(f"the config asks for nodes={cfg['nodes']} but this SLURM allocation has "
                                       f"{allocated}: allocate more nodes, or set --nodes={allocated}")
    if world % cp:
        raise configurator.ConfigError(f"world size {world} = {cfg['nodes']} nodes x {gpn} is not divisible by cp={cp}")
    # the checkpoint this run would resume from must fit it: refused here, before torchrun starts any rank (dtype
    # 'auto' is left to the ranks: this host may not be the kind of machine they run on)
    ckpt_dir = os.path.join(cfg["out_dir"], "ckpt")
    for _, tag in checkpoint.torn_checkpoints(ckpt_dir) if cfg["resume"] else []:
        print(f"warning: {ckpt_dir}/{tag}'s COMPLETE marker does not parse (torn since it was written): the ranks move "
              f"it aside to damaged_{tag} and resume from the newest complete checkpoint before it")
    done = checkpoint.check_resumable(cfg, ckpt_dir)
    if done:
        meta = checkpoint.read_marker(os.path.join(ckpt_dir, done[-1][1]))
        dt = None if cfg["dtype"] == "auto" else str(getattr(torch, cfg["dtype"]))
        checkpoint.check_compatible(meta, cfg, world, dt, f"{ckpt_dir}/{done[-1][1]}")
        print(f"resume: {ckpt_dir}/{done[-1][1]} fits this run" + (
            "" if meta["world"] == world else f" (written by {meta['world']} rank{'s' * (meta['world'] != 1)}: " + (
                "DCP reshards it on load)" if cfg["strategy"] == "fsdp2" else
                "its universal checkpoint, which any number of ranks loads, " + (
                    "is there)" if os.path.exists(os.path.join(ckpt_dir, done[-1][1], "universal", "COMPLETE")) else
                    "is made once, at start-up)"))))
    elif cfg["init_from"]:
        src, what = modelfile.init_source(cfg["init_from"])
        modelfile.check_init(src, cfg, cfg["init_from"])
        print(f"init_from: {what}, a {src['model_size']} MAE trained on {tuple(src['crop'])} crops: fits this run "
              f"({tuple(cfg['crop'])} crops); a warm start at step 0 with a fresh optimizer")
    if cp > gpn:
        print(f"warning: cp={cp} spans more than one node ({gpn} GPUs each): the ring would cross the network")
    dp = world // cp
    gb = cfg["micro_batch"] * cfg["grad_accum"] * dp
    print(f"cluster: {cfg['nodes']} nodes x {gpn} ranks = world {world} = dp {dp} x cp {cp}")
    print(f"batch: micro_batch {cfg['micro_batch']} x grad_accum {cfg['grad_accum']} x dp {dp} = global batch {gb}; "
          f"lr = {cfg['blr']} x {gb} / 256 = {cfg['blr'] * gb / 256:.3g}")
    p = plan.plan(cfg, world, "H200", gpus_per_node=gpn)
    print(f"plan (H200): {p['params'] / 1e6:.1f} M params, {p['tokens']:,} tokens ({p['visible']:,} visible), "
          f"{p['flops_per_sample'] / 1e12:,.1f} TFLOP per sample, ~{p['samples_per_s']:.2f} samples/s")
    print(f"step: ~{p['step_s']:.1f} s, the longer of {p['flop_bound_s_per_step']:.1f} s (every FLOP at "
          f"{100 * p['mfu']:.0f} % of peak) and {p['attention_s_per_step']:.1f} s of attention at the fused kernel's "
          f"rates by head dim + {p['other_s_per_step']:.1f} s of the rest at {100 * p['mfu']:.0f} %")
    print(f"memory per GPU ({cfg['strategy']}, {p['ckpt_blocks']} of {p['blocks']} blocks checkpointed): "
          f"{p['mem_per_gpu_gb']:.1f} GB of {p['limit_gb']} GB usable (activations {p['activations_gb']:.1f} GB) -> "
          f"{'fits' if p['fits'] else 'DOES NOT FIT'}")
    fit = p["ckpt_blocks_fit"]
    print("checkpointing: " + (f"the least that fits with {plan.ACT_MARGIN:.2f} x the activations is {fit} blocks "
                               f"(grad_ckpt={fit > 0}" + (f", ckpt_blocks={fit}" if 0 < fit < p['blocks'] else "") +
                               f"): ~{p['samples_per_s_ckpt_fit']:.2f} samples/s; every block: "
                               f"~{p['samples_per_s_full_ckpt']:.2f}" if fit is not None else
                               "none fits, even with every block checkpointed"))
    s3_requests(cfg, p)
    lead = cfg["stop_lead_s"] or p["stop_lead_s"]
    print(f"stop: under SLURM, SIGUSR1 {lead} s before the time limit -> checkpoint, exit {stop.RESUMABLE}"
          f"{' (stop_lead_s)' if cfg['stop_lead_s'] else ''}; the planner's need: 60 s + 1.5 x (2 steps of "
          f"{p['step_s']:.1f} s + an evaluation of {p['eval_s']:.1f} s + a {p['ckpt_gb']:.1f} GB checkpoint in "
          f"{p['ckpt_s']:.1f} s at {cfg['ckpt_write_gbps']} GB/s) = {p['stop_lead_s']} s")
    print(f"LAUNCH_STOP_LEAD_S={lead}")
    if not p["fits"] and (torch.cuda.is_available() or os.environ.get("DRY_RUN") == "1"):
        raise configurator.ConfigError(
            f"does not fit in GPU memory: the planner needs {p['mem_per_gpu_gb']:.1f} GB per GPU under "
            f"{cfg['strategy']} (activations {p['activations_gb']:.1f} GB; by strategy {p['mem_by_strategy_gb']}) and "
            f"{p['limit_gb']} GB is usable: "
            + (f"checkpoint {p['ckpt_blocks_fit']} blocks (grad_ckpt=True, ckpt_blocks={p['ckpt_blocks_fit']})"
               if p["ckpt_blocks_fit"] is not None else "raise cp, lower micro_batch or the model size"))
    return 0


def s3_requests(cfg, p):
    """The S3 request rate of plan p (infra/plan.py: one GET a chunk) and, where it is over the rate S3 documents per
    prefix (plan.S3_GET_PER_PREFIX) and the stores are on S3, a warning naming what each fix does to it."""
    limit, n, sps = plan.S3_GET_PER_PREFIX, p["s3_prefixes"], p["samples_per_s"]
    shape = " x ".join(map(str, p["s3_chunks"]))
    on_s3 = any(str(x).lstrip("@").startswith("s3://") for x in cfg["data_paths"])
    print(f"S3 requests: {p['s3_gets_per_sample']:,.1f} GETs per sample (chunks of {shape} touched, "
          f"{'aligned' if p['s3_aligned'] else 'unaligned'}) x ~{sps:.2f} samples/s = "
          f"~{p['s3_gets_per_s_per_node']:,.0f} GET/s per node, ~{p['s3_gets_per_s']:,.0f} in all, " +
          (f"~{p['s3_gets_per_s_per_prefix']:,.0f} on each of {n} store prefix{'es' * (n > 1)}" if n else
           "over the stores that data_paths' patterns or manifests name (not counted here)") +
          f"; S3 documents {limit:,} GET/s per prefix" + ("" if on_s3 else " (data_paths are not on S3 here)"))
    need = p["s3_prefixes_needed"]
    if not on_s3 or need <= (n or 1):
        return
    if n is None:  # a library: its stores are counted only by listing it
        print(f"S3 requests: at least {need} stores on prefixes of their own, drawn about evenly, keep each under "
              f"{limit:,} GET/s (a store drawn more often, as a larger one is under sample_weighting='volume', "
              f"takes more)")
        return
    per = p["s3_gets_per_s_per_prefix"]
    rate = lambda chunks, align: (sps * plan.chunk_gets(cfg["crop"], chunks, cfg["cp"], align)  # noqa: E731
                                  * (2 if cfg["task"] == "segment" else 1) / n)
    print(f"warning: S3 request rate: ~{per:,.0f} GET/s on each store's prefix is {per / limit:.1f} x the {limit:,} "
          f"S3 documents per partitioned prefix: expect 503 SlowDown answers, which the reader backs off from and "
          f"goes on (infra/reader.py), so the run slows to the rate S3 gives. A chunk is one GET whatever its size; "
          f"what lowers the rate:")
    c = tuple(p["s3_chunks"])
    if not p["s3_aligned"]:
        print(f"  align_crops=True: crops on chunk boundaries touch no partial chunk at their borders: "
              f"~{rate(c, True):,.0f} GET/s per prefix")
    bigger = [(c[0], c[1], 2 * c[2]), (c[0], c[1], 4 * c[2]), (2 * c[0], 2 * c[1], 2 * c[2]),
              (2 * c[0], 2 * c[1], 4 * c[2])]
    fit = min((b for b in bigger if rate(b, True) <= limit), key=math.prod, default=None)
    if fit:
        print(f"  larger chunks: stores written in chunks of {' x '.join(map(str, fit))} (and align_crops=True) give "
              f"~{rate(fit, True):,.0f} GET/s per prefix, each chunk {math.prod(fit) * 4 / 2 ** 20:,.0f} MiB as "
              f"float32 (docs/data.md: which chunks for which config; store_chunks={fit} tells the planner)")
    else:
        print(f"  larger chunks: not enough alone (chunks of {' x '.join(map(str, bigger[-1]))}, aligned: "
              f"~{rate(bigger[-1], True):,.0f} GET/s per prefix)")
    print(f"  more stores, each on a prefix of its own (s3://bucket/PREFIX/survey.mdio): S3 gives every partitioned "
          f"prefix its own {limit:,} GET/s, so {need} stores drawn about evenly stay under it (S3 partitions a new "
          f"prefix as its load grows, with 503s meanwhile)")
    print(f"  (fewer in_flight does not lower the rate, which is GETs per sample x samples/s: it lowers each rank's "
          f"burst, at most in_flight={cfg['in_flight']} GETs on the wire at once, and below what training needs it slows the "
          f"reads and so the run)")
