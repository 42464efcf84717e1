# The embedded default: a tiny 3D MAE learning a small synthetic seismic volume, on a 2-core CPU in a
# few minutes (bash launch.sh config/quickstart.py). Everything is small but nothing is faked: the same
# model, data path, DeepSpeed ZeRO-2 and checkpoints as the 16-node configs.
out_dir = "out/quickstart"
data_paths = ["data/quickstart.mdio"]
make_synthetic = True  # written on first run: 128 x 128 x 256 voxels = 16 MB float32
synthetic_shape = (128, 128, 256)
# 32 x 32 x 128 chunks (512 KiB) and aligned crops: every crop lies inside one chunk, so a sample is one
# request (unaligned, a 16 x 16 x 64 crop can touch 2 x 2 x 2 chunks: 8 requests)
synthetic_chunks = (32, 32, 128)
align_crops = True

# sample: 16 x 16 x 64 voxels in 2 x 2 x 16 patches -> 8 x 8 x 4 = 256 tokens, 64 visible at mask
# ratio 0.75. Narrow, tall patches suit seismic: reflectors run laterally, so a masked patch is
# predictable from its lateral neighbours two traces away; with 8^3 patches a tiny model needs far
# more than a few CPU minutes to get below the predict-the-mean loss (~1.0).
crop = (16, 16, 64)
patch = (2, 2, 16)
model_size = "tiny"  # 96 wide, 4 deep encoder; 64 wide, 2 deep decoder
mask_ratio = 0.75
# the loss on each masked patch normalised by its own mean and std, as the 16-node configs train (and MAE's
# paper, whose features improved with it): the encoder learns waveform and structure, not amplitude, which
# varies with gain and processing from survey to survey. It shows downstream: `python -m scripts.probe
# out/quickstart` scores this model's features against a random encoder's (docs/after_training.md; the runs with
# and without it: experiments/LOG.md, 2026-11-30)
norm_pix_loss = True

# 2 CPU ranks x micro_batch 8 = global batch 16; lr = blr * 16 / 256 = 1.5e-3; 500 steps = 8,000 samples, a
# few minutes on 2 cores (`python -m bench step config/quickstart.py` measures the step; docs/measurements.md)
micro_batch = 8
max_steps = 500
blr = 2.4e-2
warmup_steps = 20
log_interval = 20
ckpt_interval = 100

# validation: the last quarter of the inlines (96..127: one 32-inline chunk) is held out; training crops lie
# in inlines 0..95. 16 fixed validation samples (one micro batch per rank) at steps 0, 250 and 500: an
# evaluation's time goes mostly to drawing the two figures (out/quickstart/figures/); the run's log says how
# much of the loop the evaluations took
val_frac = 0.25
eval_interval = 250
eval_samples = 16
