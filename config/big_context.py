# The headline run: one sample = 1536 x 1536 x 2048 voxels, split over the 8 H200s of a node by ring
# attention; 16 P5 nodes. Launch: bash launch.sh config/big_context.py (DRY_RUN=1 first: it prints what each
# node will run and the planner's memory per GPU). Numbers below are from `python plan.py
# config/big_context.py` (the planner; `python bench.py plan config/big_context.py` prints it with the checks
# of its FLOP, activation and per-strategy memory terms against measurements).
#
# tokens:   (1536/16) x (1536/16) x (2048/16) = 96 x 96 x 128 = 1,179,648 tokens of 16^3 voxels
# visible:  mask 0.75 -> int(1,179,648 x 0.25) + 1 = 294,913 -> rounded so that visible + cls divides by 8:
#           294,912 encoder tokens = 294,911 visible + cls, i.e. 36,864 per CP rank (ratio 0.7500008)
# decoder:  1,179,648 / 8 = 147,456 tokens per CP rank; each rank reads only its slab of 1536/8 = 192
#           inline planes: 192 x 1536 x 2048 x 4 B = 2.4 GB of float32 per rank (19.3 GB the whole sample)
# cluster:  16 nodes x 8 GPUs = 128 ranks = dp 16 x cp 8 (a CP group is one node: the ring stays on NVLink)
# model:    ViT-G encoder (1664 wide, 48 deep, 16 heads of 104) = 1.63 B params with the 512 x 8 decoder
# memory:   per GPU, bf16: 134 GB of activations without checkpointing (would not fit), 23 GB with every block
#           checkpointed (36.5 GB per GPU in all, 0.25 samples/s: each block's forward again in backward).
#           The planner's least checkpointing that fits with a 15 % margin on the activations: 18 blocks (the
#           encoder's first 18: they free the most memory per recomputed FLOP, model.ckpt_order), 101 GB of
#           activations, 114 GB per GPU, 0.31 samples/s (+25 %). Not yet measured on a GPU; the breakdown
#           below is for every block checkpointed:
#           + 8.5 GB ZeRO-2 state: bf16 weights 2 B x 1.63 B = 3.3 GB (replicated), fp32 master + Adam
#             12 B x 1.63 B / 128 = 0.15 GB, fp32 gradient share 4 B x 1.63 B / 128 = 0.05 GB, 2 reduce buckets
#             x 5e8 x 2 B = 2 GB, and while a bucket is reduced its flat copy and fp32 cast 5e8 x (2 + 4) B =
#             3 GB (gradients are reduced and kept in fp32)
#           + ring buffers + 3 GB workspace = ~36.5 GB of 141 GB
#           Time binds: 155 PFLOP per sample (attention over 1.18 M tokens), so at 40 % of peak the 128 GPUs
#           make ~0.31 samples/s with 18 blocks recomputed (~52 s per step of 16 samples). G is the largest of
#           model.py's sizes; the planner says that larger ones would fit too, and be slower still.
# data:     0.31 samples/s x 19.3 GB / 16 nodes = ~0.37 GB/s per node from S3 (float32, uncompressed)
out_dir = "out/big_context"
data_paths = ["s3://your-bucket/survey.mdio"]  # MDIO stores, >= 1536 x 1536 x 2048 each
crop = (1536, 1536, 2048)
patch = (16, 16, 16)
model_size = "G"  # shapes (python plan.py config/big_context.py): heads of 104 (encoder) and 32 (decoder) run
#                   the fused attention at ~301 and ~162 TFLOP/s by the planner's documented rates, 816 GPU-s of
#                   attention per sample; "G_h128" (same widths and parameters, 13 and 4 heads of 128) ~479. Kept
#                   until bench_gpu.py measures the kernels (a new function: no resume across the change)
mask_ratio = 0.75
norm_pix_loss = True
grad_ckpt = True
ckpt_blocks = 18  # of 56: the least that fits (above)
dtype = "bfloat16"
strategy = "zero2"  # the published comparison: zero2 1,974 > fsdp2 1,833 > zero3 869 samples/s (smaller crops)
cp = 8
cp_impl = "ring"
nodes = 16
gpus_per_node = 8

# global batch = micro_batch x grad_accum x dp = 1 x 1 x 16 = 16; lr = 1.5e-4 x 16 / 256 = 9.4e-6
micro_batch = 1
grad_accum = 1
blr = 1.5e-4
max_steps = 20000
warmup_steps = 500
log_interval = 1
ckpt_interval = 100

# streaming: a rank's slab is 2.4 GB = 12 x 12 x 16 = 2,304 chunks of 128^3 (MDIO's default); 64 in flight
in_flight = 64
prefetch = 1
align_crops = True
min_live = 0.5
