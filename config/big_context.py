# The headline run: one sample = 1536 x 1536 x 2048 voxels, split over the 8 H200s of a node by ring
# attention; 16 P5 nodes. Launch: bash launch.sh config/big_context.py (DRY_RUN=1 first: it prints what each
# node will run and the planner's memory per GPU). Its memory, step time and samples/s: run `python -m scripts.plan
# config/big_context.py` (the planner; `python -m bench plan config/big_context.py` prints it with the checks
# of its FLOP, activation, ring and per-strategy memory terms against measurements).
#
# tokens:   (1536/16) x (1536/16) x (2048/16) = 96 x 96 x 128 = 1,179,648 tokens of 16^3 voxels
# visible:  mask 0.75 -> int(1,179,648 x 0.25) + 1 = 294,913 -> rounded so that visible + cls divides by 8:
#           294,912 encoder tokens = 294,911 visible + cls, i.e. 36,864 per CP rank (ratio 0.7500008)
# decoder:  1,179,648 / 8 = 147,456 tokens per CP rank; each rank reads only its slab of 1536/8 = 192
#           inline planes: 192 x 1536 x 2048 x 4 B = 2.4 GB of float32 per rank (19.3 GB the whole sample)
# cluster:  16 nodes x 8 GPUs = 128 ranks = dp 16 x cp 8 (a CP group is one node: the ring stays on NVLink)
# model:    ViT-G encoder (1664 wide, 48 deep) = 1.63 B params with the 512 x 8 decoder; heads of 128 in both
#           (1664 / 13, 512 / 4: ViT-G's widths and parameters; its own 16 heads of 104 and the decoder's of 32
#           run the fused attention below 128's rate on an H200, plan.ATTN_TFLOPS)
# memory:   per GPU, bf16: the activations without checkpointing would not fit; with every block checkpointed
#           they shrink to each block's input, at the price of each block's forward again in backward. ckpt_blocks
#           below is the planner's least checkpointing that fits with a 15 % margin on the activations (the
#           encoder's first blocks: they free the most memory per recomputed FLOP, plan.ckpt_order). Besides the
#           activations: the ZeRO-2 state (bf16 weights replicated; fp32 master, Adam and the fp32 gradient share
#           partitioned over 128; 2 reduce buckets of zero_bucket elements and, while one is reduced, its flat
#           copy and fp32 cast), the ring's buffers (plan.ring_bytes) and 3 GB of workspace. Not yet measured
#           on a GPU.
# time:     155 PFLOP per sample, ~98 % of it attention over 1.18 M tokens, which the fused kernel runs at its
#           rate for heads of 128 (plan.ATTN_TFLOPS, measured on an H200): attention sets the step time (the
#           planner's step_s and attention_s_per_step; with ViT-G's own heads, much longer: scripts.plan prints both).
#           G is the largest of model.py's sizes; the planner says that larger ones would fit too, and be slower.
# data:     samples/s x 19.3 GB / 16 nodes from S3 per node (float32, uncompressed; the planner prints it)
out_dir = "out/big_context"
data_paths = ["s3://your-bucket/survey.mdio"]  # MDIO stores, >= 1536 x 1536 x 2048 each
crop = (1536, 1536, 2048)
patch = (16, 16, 16)
model_size = "G"
heads = 13  # 1664 / 13 = 128 per head (ViT-G's own: 16 of 104)
dec_heads = 4  # 512 / 4 = 128 (the decoder's own: 16 of 32). A run cannot switch heads mid-way (another function
#                of the same weights: resume and init_from refuse it); the two layouts side by side, step time,
#                samples/s and MFU: python -m scripts.plan config/big_context.py
mask_ratio = 0.75
norm_pix_loss = True
grad_ckpt = True
ckpt_blocks = 19  # of 56: the least that fits (above)
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

# streaming: a rank's slab is 2.4 GB: 192 inlines of 1536 x 2048, which touch 2 x 12 x 16 = 384 chunks of 128^3 (MDIO's
#            default; a chunk two slabs share is read by both ranks); 64 in flight
in_flight = 64
prefetch = 1
align_crops = True
min_live = 0.5
