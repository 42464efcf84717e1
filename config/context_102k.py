# Growing the context, stage 1 of 2: ViT-G at 102,400 tokens per sample, the published team's starting length,
# on the same model as the 1.18 M-token run (config/big_context.py), so that stage 2 starts from these weights
# (init_from). Launch: bash launch.sh config/context_102k.py, then bash launch.sh config/context_1m.py.
#
# tokens:   (640/16) x (640/16) x (1024/16) = 40 x 40 x 64 = 102,400 tokens of 16^3 voxels; 25,599 visible
#           (mask_strata 8: 8 strata x 3,200 encoder tokens, one of them the cls token)
# model:    ViT-G encoder (1664 wide, 48 deep, 13 heads of 128) + 512 x 8 decoder (4 heads of 128) = 1.63 B
#           params, as stage 2.
#           Positions are fixed sin-cos of each token's grid coordinates: nothing learned depends on the grid, so
#           the same weights run on stage 2's 96 x 96 x 128 grid (tokens there reach coordinates 96 and 128, which
#           stage 1 never saw: the sin-cos of a larger coordinate is well defined, and stage 2 trains on them).
# cluster:  16 nodes x 8 GPUs = 128 ranks, dp 128, no context parallelism (102,400 tokens fit one H200)
# batch:    1 sample per GPU: global batch 128; lr = 1.5e-4 x 128 / 256 = 7.5e-5
# planner: FLOPs per sample, memory per GPU and samples/s with and without checkpointing: run `python -m
#           scripts.plan config/context_102k.py`. The least checkpointing that fits with a 15 % margin on the
#           activations is 0 blocks (not yet measured on a GPU: ckpt_blocks is the fallback)
# schedule: 20,000 steps x 128 = 2.56 M samples, in max_steps x the planner's step_s; a checkpoint every 500 steps
out_dir = "out/context_102k"
data_paths = ["s3://your-bucket/survey.mdio"]  # MDIO stores, >= 640 x 640 x 1024 each
crop = (640, 640, 1024)
patch = (16, 16, 16)
model_size = "G"  # as stage 2, with its heads (config/big_context.py): stage 2 starts from these weights, and
heads = 13  #       init_from refuses another split of them
dec_heads = 4
mask_ratio = 0.75
norm_pix_loss = True
grad_ckpt = False  # the planner: fits without (above)
dtype = "bfloat16"
strategy = "zero2"
cp = 1
mask_strata = 8  # masks stratified as under cp 8: a resume of this run on cp up to 8 keeps its masks (elastic resume)
nodes = 16
gpus_per_node = 8

micro_batch = 1
grad_accum = 1
blr = 1.5e-4
max_steps = 20000
warmup_steps = 1000
log_interval = 10
ckpt_interval = 500

in_flight = 64
prefetch = 2
align_crops = True
min_live = 0.5
