# The published system's starting point: 640 x 640 x 1024 voxels per sample, one sample per GPU.
# Not run in CI (it needs GPUs and a real survey). Launch: bash launch.sh config/base_102k.py
#
# tokens:   (640/16) x (640/16) x (1024/16) = 40 x 40 x 64 = 102,400 tokens of 16^3 voxels
# visible:  int(102,400 x (1 - 0.75)) = 25,600, + 1 cls = 25,601 encoder tokens
# model:    ViT-L encoder (1024 wide, 24 deep) = 306.5 M params; decoder 512 x 8 -> 334.4 M total; heads of 128
#           (1024 / 8 and 512 / 4: the widths, and so the parameters, are ViT-L's; only the split differs)
# FLOPs:    per sample, forward: encoder 24 x (24 N D^2 + 4 N^2 D), N = 25,601, D = 1024  =  80 TFLOP
#                                decoder  8 x (24 L d^2 + 4 L^2 d),  L = 102,400, d = 512  = 177 TFLOP
#           (attention is 90 % of it: 4 N^2 D dominates at this length); x3 for backward = 772 TFLOP; the
#           fused kernel runs that attention well below peak (plan.ATTN_TFLOPS: at heads of 128 fastest, at ViT-L's
#           decoder heads of 32 about half of that), so it sets the step time: run `python -m scripts.plan
#           config/base_102k.py`
# sample:   640 x 640 x 1024 x 4 B = 1.56 GiB of float32 read per sample (200 chunks of 128^3 when aligned)
out_dir = "out/base_102k"
data_paths = ["data/survey.mdio"]  # point at your MDIO v1 stores (local paths or s3:// URLs)
crop = (640, 640, 1024)
patch = (16, 16, 16)
model_size = "large"
heads = 8  # 1024 / 8 = 128 per head (ViT-L's own: 16 of 64)
dec_heads = 4  # 512 / 4 = 128 per head (ViT-L's own: 16 of 32, the slowest head dim of plan.ATTN_TFLOPS). Both
#                layouts' step time, samples/s and MFU: python -m scripts.plan config/base_102k.py
mask_ratio = 0.75
norm_pix_loss = True
grad_ckpt = False  # the planner: no checkpointing needed here (below); every block would cost its forward again

# per GPU 1 sample; global batch = 1 x world (128 on 16 x 8 GPUs); lr = 1.5e-4 x 128 / 256 = 7.5e-5
# planner: memory per GPU with and without checkpointing, samples/s and S3 GB/s per node: run `python -m scripts.plan
#   config/base_102k.py`. Its least checkpointing that fits with a 15 % margin on the activations is 0 blocks.
#   Not yet measured on a GPU: if it runs out of memory, grad_ckpt = True and ckpt_blocks = a few
#   (infra/plan.py's ckpt_order: encoder blocks first).
micro_batch = 1
grad_accum = 1
blr = 1.5e-4
max_steps = 20000
warmup_steps = 1000
log_interval = 10
ckpt_interval = 500
nodes = 16
gpus_per_node = 8
