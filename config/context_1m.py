# Growing the context, stage 2 of 2: the 1.18 M-token run of config/big_context.py (every setting of it, read from
# that file), warm-started from stage 1's model (config/context_102k.py: the same ViT-G, the same 16^3 patches)
# instead of a random init. Launch, once stage 1 has a complete checkpoint:
#     DRY_RUN=1 bash launch.sh config/context_1m.py     # checks that init_from exists and fits this model
#     bash launch.sh config/context_1m.py
# At start-up rank 0 exports stage 1's newest checkpoint into out/context_1m/init_from.pt (DeepSpeed's zero_to_fp32:
# 1.63 B fp32 weights = 6.5 GB), every rank loads it memory-mapped, and training starts at step 0 with a fresh
# optimizer and a new warmup. A requeued or resumed stage 2 continues its own checkpoints; init_from is then unused.
#
# tokens:   96 x 96 x 128 = 1,179,648 per sample, 11.5 x stage 1's; 155 PFLOP per sample, 110 x stage 1's 1.41
#           (attention grows with the square of the length); dp 16 x cp 8 on the same 128 GPUs: global batch 16.
#           Samples/s of each stage: run `python -m scripts.plan config/context_102k.py` and `... config/context_1m.py`
import os

exec(open(os.path.join(os.path.dirname(__file__), "big_context.py")).read())  # stage 2 is the headline run ...
out_dir = "out/context_1m"
init_from = "out/context_102k"  # ... from stage 1's weights (its out_dir: the newest complete checkpoint)
warmup_steps = 500  # a fresh optimizer: warm up again (the weights are not fresh: a short warmup is enough)
