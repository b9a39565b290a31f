"""Runtime defaults that the CLI shows in its help without importing torch (defined here once)."""

# The KV cache's default size: this fraction of the memory available when the engine starts (CPU: the host's
# available memory; CUDA: the device's free memory after the weights), as vLLM's VLLM_CPU_KVCACHE_SPACE /
# gpu_memory_utilization size it from the machine. On CPU the cache is zero pages that the OS commits as blocks
# are first written, so an unused budget costs address space, not memory.
KV_CACHE_MEMORY_FRACTION = 0.25
