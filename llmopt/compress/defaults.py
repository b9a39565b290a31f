"""Compression defaults, defined once: the configs use them and the CLI shows them (importing this module
does not import torch, so `--help` stays fast)."""

CALIBRATION = {"calib": "c4", "num_samples": 128, "seqlen": 512, "seed": 0, "batch_size": 8, "device": "cpu",
               "compute_dtype": "auto", "text_field": "text"}
STRUCTURED_NUM_SAMPLES = 32  # structured pruning ranks channels / heads / layers: fewer samples suffice
QUANTIZE = {"bits": 4, "group_size": 128, "sym": True}
ROTATION_SEED = 0  # seeds --rotate's random orthogonal matrices
SPARSEGPT_DAMP = 0.01  # fraction of the Hessian's mean diagonal

# Tensors an artifact keeps for a later re-run (not *.safetensors: loaders must not take them for weights):
# AWQ's searched scales / clips, structured pruning's importance scores.
SEARCH_FILE = "llmopt_search.safetensors.bin"
SCORES_FILE = "llmopt_scores.safetensors.bin"
