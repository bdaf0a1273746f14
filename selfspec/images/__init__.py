"""The image side: class-conditional image-token GPTs over a patch codebook (data, tokenizer,
model, training, quality metrics), HB-SJD batched rollouts with classifier-free guidance and
their engine, on-policy distillation, the compaction-cost calibration, `generate-image` and
the rollout benchmark.
"""
