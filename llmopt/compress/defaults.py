"""Compression defaults, defined once: the configs use them and the CLI shows them (importing this module
does not import torch, so `--help` stays fast)."""

CALIBRATION = {"calib": "c4", "num_samples": 128, "seqlen": 512, "seed": 0, "batch_size": 8, "device": "cpu",
               "compute_dtype": "auto", "text_field": "text"}
STRUCTURED_NUM_SAMPLES = 32  # structured pruning ranks channels / heads / layers: fewer samples suffice
QUANTIZE = {"bits": 4, "group_size": 128, "sym": True}
ROTATION_SEED = 0  # seeds --rotate's random orthogonal matrices
SPARSEGPT_DAMP = 0.01  # fraction of the Hessian's mean diagonal
# The pre-passes a scheme runs when neither --smoothquant-alpha nor --rotate is given: the settings measured best for
# it on SmolLM2 (wikitext2 perplexity with GPTQ, docs/results/lowprec.md): W8A8 int8 +0.68% with both against +2.82%
# with neither; W8A8 FP8 +1.43% with SmoothQuant's search against +3.72% (RTN) without. "none" turns one off.
SCHEME_PREPASSES = {
    "w8a8-int8": {"rotate": "R1,R2", "smoothquant_alpha": "search"},
    "w8a8-fp8": {"smoothquant_alpha": "search"},
}

# Tensors an artifact keeps for a later re-run (not *.safetensors: loaders must not take them for weights):
# AWQ's searched scales / clips, structured pruning's importance scores.
SEARCH_FILE = "llmopt_search.safetensors.bin"
SCORES_FILE = "llmopt_scores.safetensors.bin"
