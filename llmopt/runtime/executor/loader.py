"""Load a MODEL for the runtime: each quantized linear of an artifact becomes the linear method the registry
chooses for its scheme, the engine's input-activation setting and the device (runtime.executor.linear)."""

from __future__ import annotations

from llmopt.export.load import load_model
from llmopt.runtime.engine.config import ACTIVATION_SCHEMES
from llmopt.runtime.executor.linear import make_linear


def load_runtime_model(name: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False,
                       activations: str = "float"):
    """(model, tokenizer, source) as export.load.load_model gives, with the runtime's linear methods; numerics
    then follow those kernels. activations: EngineConfig.activations ("int8": 8-bit dynamic inputs where a method
    has them)."""
    input_activations = ACTIVATION_SCHEMES[activations]

    def factory(qweight, torch_dtype, torch_device):
        return make_linear(qweight, torch_dtype, torch_device, input_activations)

    model, tokenizer, source = load_model(name, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                          linear_factory=factory)
    model.llmopt_activations = activations  # what the engine checks its config against
    return model, tokenizer, source
