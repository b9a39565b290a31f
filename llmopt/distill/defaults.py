"""Distillation defaults, defined once (the config uses them, the CLI shows them; no torch import here)."""

DISTILL = {
    "data": "c4", "seqlen": 256, "batch_size": 4, "grad_accum": 1, "lr": 1e-4, "warmup": 10,
    "schedule": "cosine", "weight_decay": 0.0, "max_grad_norm": 1.0, "loss": "forward_kl", "temperature": 1.0,
    "beta": 0.5, "alpha": 1.0, "hidden_weight": 1.0, "on_policy_prompt_len": 64, "eval_windows": 8,
    "max_train_tokens": 2_000_000,
}
CHECKPOINT_SUFFIX = ".ckpt"  # checkpoints of OUT live in OUT.ckpt/ beside it
