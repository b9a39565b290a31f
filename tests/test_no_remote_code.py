"""The no-pickle and no-remote-code promises hold outside load_model too: every `from_pretrained` in the package
says trust_remote_code (and model loads say use_safetensors), and a folder whose code would write a marker file
is refused with one line naming --trust-remote-code, by `export` as by `models info`."""

import ast
import json
from pathlib import Path

from tests.cli.test_cli import assert_one_line_error, run

PACKAGE = Path(__file__).resolve().parents[1] / "llmopt"


def from_pretrained_calls():
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "from_pretrained":
                yield path, node


def test_every_from_pretrained_says_trust_remote_code_and_models_say_safetensors():
    bad = []
    for path, node in from_pretrained_calls():
        keywords = {k.arg for k in node.keywords}
        owner = ast.unparse(node.func.value)
        if "trust_remote_code" not in keywords:
            bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {owner}.from_pretrained without trust_remote_code")
        is_gguf = "gguf_file" in keywords  # a GGUF holds tensors, not pickle
        if owner == "AutoModelForCausalLM" and "use_safetensors" not in keywords and not is_gguf:
            bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno} model load without use_safetensors=True")
    assert not bad, "\n".join(bad)


def with_remote_tokenizer_code(folder: Path, marker: Path) -> None:
    """Make the folder's tokenizer a custom class whose module writes `marker` when imported."""
    (folder / "evil_tokenizer.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    config["tokenizer_class"] = "EvilTokenizer"
    config_path.write_text(json.dumps(config))


def test_export_refuses_a_folder_with_its_own_code(tiny_llama_dir, tmp_path):
    artifact = tmp_path / "rtn"
    assert run("quantize", tiny_llama_dir, "--method", "rtn", "--group-size", 32, "-o", artifact).exit_code == 0
    marker = tmp_path / "marker"
    with_remote_tokenizer_code(artifact, marker)
    out = tmp_path / "exported"
    result = run("export", artifact, "--format", "gptq", "-o", out)
    assert_one_line_error(result, "--trust-remote-code")
    assert not marker.exists() and not out.exists()
    assert "[y/N]" not in result.output


def test_the_bnb_recipe_stage_runs_no_model_code_and_reads_no_pickle(tiny_llama_dir, tmp_path):
    import shutil

    import pytest

    from llmopt.core.errors import ModelLoadError
    from llmopt.recipe.stages import STAGES

    pytest.importorskip("bitsandbytes")
    bnb = STAGES.get("bnb")
    folder = tmp_path / "remote"
    shutil.copytree(tiny_llama_dir, folder)
    marker = tmp_path / "marker"
    (folder / "evil_model.py").write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "evil_model.EvilConfig",
                                               "AutoModelForCausalLM": "evil_model.EvilModel"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="pass --trust-remote-code if you trust it"):
        bnb.run(str(folder), tmp_path / "out", {"quant_type": "nf4"})
    assert not marker.exists() and not (tmp_path / "out").exists()

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_llama_dir, pickled)
    for weights in pickled.glob("*.safetensors"):
        weights.rename(weights.with_name("pytorch_model.bin"))
    with pytest.raises(ModelLoadError, match="pickle"):
        bnb.run(str(pickled), tmp_path / "out2", {"quant_type": "nf4"})
