# The published system's starting point: 640 x 640 x 1024 voxels per sample, one sample per GPU.
# Not run in CI (it needs GPUs and a real survey). Launch: bash launch.sh config/base_102k.py
#
# tokens:   (640/16) x (640/16) x (1024/16) = 40 x 40 x 64 = 102,400 tokens of 16^3 voxels
# visible:  int(102,400 x (1 - 0.75)) = 25,600, + 1 cls = 25,601 encoder tokens
# model:    ViT-L encoder (1024 wide, 24 deep, 16 heads) = 306.5 M params; decoder 512 x 8 -> 334.4 M total
# FLOPs:    per sample, forward: encoder 24 x (24 N D^2 + 4 N^2 D), N = 25,601, D = 1024  =  80 TFLOP
#                                decoder  8 x (24 L d^2 + 4 L^2 d),  L = 102,400, d = 512  = 177 TFLOP
#           (attention is 90 % of it: 4 N^2 D dominates at this length); x3 for backward = 772 TFLOP
#           -> about 2 s per sample per H200 at 40 % MFU of 989 TFLOP/s
# sample:   640 x 640 x 1024 x 4 B = 1.56 GiB of float32 read per sample (200 chunks of 128^3 when aligned)
out_dir = "out/base_102k"
data_paths = ["data/survey.mdio"]  # point at your MDIO v1 stores (local paths here; s3:// in a later issue)
crop = (640, 640, 1024)
patch = (16, 16, 16)
model_size = "large"
mask_ratio = 0.75
norm_pix_loss = True
grad_ckpt = True  # activations of 24 + 8 blocks at these lengths are tens of GB without it

# per GPU 1 sample; global batch = 1 x world (128 on 16 x 8 GPUs); lr = 1.5e-4 x 128 / 256 = 7.5e-5
# planner (python plan.py config/base_102k.py): 22.6 GB per GPU with ZeRO-2 and grad_ckpt (47 GB of
# activations without it), 66 samples/s on 128 H200 at 40 % MFU, 6.9 GB/s per node from S3 (float32)
micro_batch = 1
grad_accum = 1
blr = 1.5e-4
max_steps = 20000
warmup_steps = 1000
log_interval = 10
ckpt_interval = 500
nodes = 16
gpus_per_node = 8
