"""Bad input, every command: one line on stderr that names the offending value or option, exit 1 (2 for usage
errors), no traceback, and nothing created at the output path.

Each case is (command line, expected exit code, a regex the message must match, the output path that must not
appear). `{name}` in an argument is a file or folder from the `bad` fixture (or OUT, a path under the case's own
temporary folder)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmopt.cli.main import app

OUT = "{out}"  # the case's output path (never created)
RTN = ["quantize", "{tiny}", "-o", OUT, "--method", "rtn", "--group-size", "32"]  # (quantize cases' defaults)
GPTQ = ["quantize", "{tiny}", "-o", OUT, "--method", "gptq", "--group-size", "32"]
# what commands print before failing: the dtype auto chose, the CPU a bench measures, a recipe's progress
# (`VARIANT: stage ...`, for the one variant, q, of the recipe that fails at run time)
NOTES = ("dtype auto -> ", "CPU: ", "q: ")

CASES = [
    # --- models ---------------------------------------------------------------------------------------------------
    (["models", "info", "no-such-alias"], 1, r"unknown model 'no-such-alias'", None),
    (["models", "info", "{missing}"], 1, r"no such folder or file", None),
    (["models", "info", "{pickle}"], 1, r"only pickle weights", None),
    (["models", "info", "{garbage_header}"], 1, r"not a safetensors file", None),
    (["models", "info", "{truncated}"], 1, r"truncated: it holds \d+ of \d+ bytes", None),
    (["models", "info", "{no_config}"], 1, r"has no config\.json", None),
    (["models", "info", "{missing}.gguf"], 1, r"does not exist", None),
    (["models", "info", "{loop}"], 1, r"loop is a symbolic link to nothing \(or a loop\)", None),
    (["models", "info", "{tiny}", "--bogus"], 2, r"No such option: --bogus.*llmopt models info --help", None),
    (["models"], 2, "Usage", None),
    # --- generate -------------------------------------------------------------------------------------------------
    (["generate", "{tiny}", "-p", "\udcff\udcfehi"], 1, r"--prompt is not valid UTF-8 text \(byte 0xff", None),
    (["generate", "{tiny}", "-p", "hi", "--max-tokens", "2000", "--backend", "hf"], 1,
     r"the prompt \+ --max-tokens is \d+ tokens, beyond the model's context of 1024", None),
    (["generate", "{tiny}", "-p", "hi", "--max-tokens", "2000"], 1, r"exceeds the model's context of 1024", None),
    (["generate", "{tiny}", "-p", "hi", "--device", "banana"], 1, r"--device banana: not a device name", None),
    (["generate", "{tiny}", "-p", "hi", "--device", "cuda:0"], 1, r"--device cuda:0: this machine has no usable CUDA",
     None),
    (["generate", "{tiny}", "-p", "hi", "--device", "mps"], 1, r"--device mps: llmopt runs on cpu or cuda", None),
    (["generate", "{tiny}"], 2, r"Missing option '--prompt'", None),
    (["generate", "{tiny}", "-p", "hi", "--max-tokens", "many"], 2, r"--max-tokens", None),
    (["generate", "{no_tokenizer}", "-p", "hi"], 1, r"has no tokenizer", None),
    (["generate", "{missing_tensors}", "-p", "hi"], 1, r"lacks tensors for its config \(model\.layers\.1\.", None),
    (["generate", "{tiny}", "-p", "hi", "--speculative", "bogus"], 1, r"--speculative", None),
    (["generate", "{tiny}", "-p", "hi", "--stop", "x", "--backend", "hf"], 1, r"--stop needs the runtime", None),
    (["generate", "{no_chat_template}", "-p", "hi", "--chat"], 1, r"--chat: this model's tokenizer has no chat "
     "template", None),
    # a prompt no step could ever take (it waited forever), a flag a one-process command cannot honour (ignored),
    # a KV cache beyond the memory (numpy's allocation traceback), a graph the engine cannot build (silently unused)
    (["generate", "{tiny}", "-p", "hello world " * 16, "--max-num-batched-tokens", "4", "--no-chunked-prefill"], 1,
     r"prompt of \d+ tokens is longer than one step takes without chunked prefill \(--max-num-batched-tokens 4\): "
     r"raise --max-num-batched-tokens", None),
    (["generate", "{tiny}", "-p", "hi", "--disaggregate", "1:1"], 1, r"--disaggregate is for serve and bench", None),
    (["generate", "{tiny}", "-p", "hi", "--kv-cache-bytes", str(10 ** 15)], 1,
     r"--kv-cache-bytes 1,000,000,000,000,000 needs a KV cache of [\d,.]+ GiB, more than the", None),
    (["generate", "{tiny}", "-p", "hi", "--kv-cache-tokens", "99999999999"], 1,
     r"--kv-cache-tokens 99,999,999,999 needs a KV cache of", None),
    (["generate", "{tiny}", "-p", "hi", "--no-fast-path", "--decode-graph"], 1,
     r"--decode-graph: this engine cannot run its decodes as one compiled call", None),
    # --- eval -----------------------------------------------------------------------------------------------------
    (["eval", "ppl", "{tiny}", "--dataset", "{null_text}", "--seqlen", "8"], 1,
     r"null_text\.jsonl:2: field 'text' is null, not text", None),
    (["eval", "ppl", "{tiny}", "--dataset", "{number_text}", "--seqlen", "8"], 1, r":1: field 'text' is int", None),
    (["eval", "ppl", "{tiny}", "--dataset", "{list_record}", "--seqlen", "8"], 1, r":1 is a JSON list, not an object",
     None),
    (["eval", "ppl", "{tiny}", "--dataset", "{no_text_field}", "--seqlen", "8"], 1,
     r"has no field 'text' \(fields: content\): pass --text-field", None),
    (["eval", "ppl", "{tiny}", "--dataset", "{bad_json_line}", "--seqlen", "8"], 1, r":2 is not valid JSON", None),
    (["eval", "ppl", "{tiny}", "--dataset", "{missing}.txt"], 1, r"does not exist", None),
    (["eval", "ppl", "{tiny}", "--seqlen", "5000", "--dataset", "pystdlib"], 1,
     r"--seqlen is 5000 tokens, beyond the model's context of 1024", None),
    (["eval", "ppl", "{tiny}", "--seqlen", "1"], 1, r"--seqlen must be at least 2", None),
    (["eval", "ppl", "{tiny}", "--dtype", "float8"], 2, r"--dtype", None),
    (["eval", "ppl", "{missing_tensors}", "--dataset", "pystdlib"], 1, r"lacks tensors", None),
    (["eval", "ppl", "{truncated}", "--dataset", "pystdlib"], 1, r"truncated", None),
    (["eval", "tasks", "{tiny}", "--tasks", "nosuch"], 1, r"unknown task 'nosuch'", None),
    (["eval", "tasks", "{tiny}", "--limit", "0"], 1, r"--limit must be at least 1", None),
    (["eval", "tasks", "{tiny}", "--batch-size", "0"], 1, r"--batch-size must be at least 1", None),
    # --- quantize -------------------------------------------------------------------------------------------------
    ([*RTN, "--rotate", "R1", "--rotate-seed", str(2 ** 70)], 1, r"seed: .*less than or equal to", OUT),
    ([*RTN, "--max-memory", "lots"], 1, r"--max-memory 'lots': give a size such as 600MB", OUT),
    ([*RTN, "--max-memory", "10KB"], 1, r"--max-memory 10 kB is less than compressing one layer .* give at least \d+",
     OUT),
    (["quantize", "{tiny}", "-o", OUT, "--method", "rtn", "--scheme", "w8a8-int8", "--smoothquant-alpha", "0.5",
      "--max-memory", "1GB"], 1,
     r"--smoothquant-alpha needs a pass of its own .* --max-memory", OUT),
    (["quantize", "{tiny_copy}", "-o", "{tiny_copy}", "--overwrite", "--method", "rtn", "--group-size", "32"], 1,
     r"is the input model or inside it", None),
    (["quantize", "{tiny}", "-o", "{tiny}/sub", "--method", "rtn", "--group-size", "32"], 1,
     r"is the input model or inside it", "{tiny}/sub"),
    (["quantize", "{artifact}", "-o", OUT, "--method", "rtn", "--group-size", "32"], 1,
     r"is already quantized \(compressed-tensors\): quantize its unquantized source model", OUT),
    ([*RTN, "--device", "banana"], 1, r"--device banana", OUT),
    ([*RTN, "--device", "cuda"], 1, r"--device cuda: this machine has no usable CUDA", OUT),
    (["quantize", "{tiny}", "-o", "{a_file}/x", "--method", "rtn", "--group-size", "32"], 1,
     r"a_file is a file, not a folder", None),
    (["quantize", "{tiny}", "-o", "/proc/llmopt-out", "--method", "rtn", "--group-size", "32"], 1,
     r"/proc is not writable", None),
    (["quantize", "{tiny}", "-o", "{loop}", "--method", "rtn", "--group-size", "32"], 1,
     r"loop' is a symbolic link loop: fix or remove the link", None),
    (["quantize", "{tiny}", "-o", "{loop}/out", "--method", "rtn", "--group-size", "32"], 1,
     r"is a symbolic link loop", None),
    ([*GPTQ, "--seqlen", "5000"], 1, r"--seqlen is 5000 tokens, beyond the model's context", OUT),
    ([*GPTQ, "--calib", "{no_text_field}"], 1, r"has no field 'text'.*pass --text-field", OUT),
    ([*GPTQ, "--calib", "{null_text}"], 1, r"field 'text' is null", OUT),
    (["quantize", "{tiny}", "-o", OUT, "--method", "awq", "--group-size", "32", "--awq-search", "{missing}"], 1,
     r"--awq-search .* does not exist", OUT),
    (["quantize", "{tiny}", "-o", OUT, "--bits", "5", "--group-size", "32"], 1, r"bits must be one of", OUT),
    (["quantize", "{tiny}", "-o", OUT, "--method", "rtn"], 1, r"--group-size 128 does not divide", OUT),
    (["quantize", "{tiny}", "-o", "{a_folder}", "--method", "rtn", "--group-size", "32"], 1,
     r"already exists: choose another path or pass --overwrite", None),
    (["quantize", "{tiny}", "-o", OUT, "--method", "foo"], 2, r"'foo' is not one of", OUT),
    (["quantize", "{tiny}", "-o", OUT, "--method", "rtn", "--damp", "0.1"], 1, r"--damp applies to gptq only", OUT),
    (["quantize", "{pickle}", "-o", OUT, "--method", "rtn"], 1, r"only pickle weights", OUT),
    ([*RTN, "--ignore", "mlp.down_prj"], 1, r"--ignore 'mlp\.down_prj' matches no linear", OUT),
    # a value that looks like terminal markup is printed as given
    ([*RTN, "--ignore", "[bold]down"], 1, r"--ignore '\[bold\]down' matches no linear", OUT),
    ([*GPTQ, "--calib", "c4,nosuch"], 1, r"unknown dataset 'nosuch'", OUT),
    (["quantize", "{tiny}", "-o", OUT, "--method", "gptq", "--calib-dtype", "float16"], 2, r"--calib-dtype", OUT),
    # --- prune ----------------------------------------------------------------------------------------------------
    (["prune", "{tiny}", "-o", OUT], 1, r"give --method", OUT),
    (["prune", "{artifact}", "-o", OUT, "--method", "magnitude", "--sparsity", "0.5"], 1,
     r"already quantized.*prune its unquantized source model", OUT),
    (["prune", "{tiny}", "-o", OUT, "--structured", "mlp", "--ratio", "0.25", "--scores", "{missing}"], 1,
     r"--scores .* does not exist", OUT),
    (["prune", "{tiny}", "-o", OUT, "--structured", "mlp", "--ratio", "0.25", "--scores",
      "{garbage_header}/model.safetensors"], 1,
     r"--scores .*not a safetensors file", OUT),
    (["prune", "{tiny}", "-o", OUT, "--method", "magnitude", "--sparsity", "1.5"], 1, r"sparsity", OUT),
    (["prune", "{tiny_copy}", "-o", "{tiny_copy}", "--overwrite", "--method", "magnitude", "--sparsity", "0.5"], 1,
     r"is the input model", None),
    # --- distill --------------------------------------------------------------------------------------------------
    (["distill", "--teacher", "{tiny_copy}", "-o", "{tiny_copy}", "--overwrite", "--max-steps", "1"], 1,
     r"is the input model", None),
    (["distill", "--teacher", "{tiny_copy}", "--medusa-heads", "2", "-o", "{tiny_copy}", "--overwrite",
      "--max-steps", "1"], 1, r"is the input model", None),
    (["distill", "--teacher", "{tiny}", "-o", OUT], 1, r"needs an end", OUT),
    (["distill", "--teacher", "{tiny}", "--student", "{other_vocab}", "-o", OUT, "--max-steps", "1"], 1,
     r"has a vocabulary of 300 tokens, the teacher 259", OUT),
    (["distill", "--teacher", "no-such-model", "-o", OUT, "--max-steps", "1"], 1, r"unknown model", OUT),
    # --- export ---------------------------------------------------------------------------------------------------
    (["export", "{tiny}", "-o", OUT, "--format", "gptq"], 1, r"holds no quantized weights", OUT),
    (["export", "{artifact}", "-o", "{artifact}/x", "--format", "gptq"], 1, r"is the input artifact or inside it",
     "{artifact}/x"),
    (["export", "{missing}", "-o", OUT, "--format", "gptq"], 1, r"not a model folder", OUT),
    (["export", "{artifact}", "-o", "{artifact}/x.gguf", "--format", "gguf"], 1,
     r"is the input artifact or inside it", "{artifact}/x.gguf"),
    (["export", "{artifact}", "-o", OUT, "--format", "bogus"], 2, r"--format", OUT),
    # --- bench ----------------------------------------------------------------------------------------------------
    (["bench", "{tiny}", "--block-size", "0"], 1, r"--block-size must be at least 1 \(got 0\)", None),
    (["bench", "{tiny}", "--max-num-seqs", "0"], 1, r"--max-num-seqs must be at least 1", None),
    (["bench", "{tiny}", "--threads", "-1"], 1, r"--threads must be at least 1 \(got -1\)", None),
    (["bench", "{tiny}", "--num-requests", "0"], 1, r"--num-requests must be at least 1", None),
    (["bench", "{tiny}", "--max-concurrency", "0"], 1, r"--max-concurrency must be at least 1", None),
    (["bench", "{tiny}", "--kv-cache-memory-fraction", "2"], 1,
     r"--kv-cache-memory-fraction 2.0: give a fraction in \(0, 0.95\]", None),
    (["bench", "{tiny}", "--json", "{a_folder}"], 1, r"--json file .* is a folder", None),
    (["bench", "{tiny}", "--json", "{a_file}/x.json"], 1, r"is a file, not a folder", None),
    (["bench", "{tiny}", "--dataset", "nosuch"], 1, r"nosuch", None),
    (["bench", "{tiny_copy}", "--json", "{tiny_copy}/results.json"], 1, r"is the benchmarked model or inside it",
     "{tiny_copy}/results.json"),
    # more processes than the host runs (hundreds started, memory exhausted), cores that do not exist (a rank died
    # and rank 0 waited)
    (["bench", "{tiny}", "--data-parallel-size", "1000"], 1,
     r"--data-parallel-size: 1000 data-parallel replicas is more than 4 processes per core .*--oversubscribe", None),
    (["bench", "{tiny}", "--disaggregate", "100:100"], 1, r"--disaggregate: 100 prefill \+ 100 decode workers is more",
     None),
    (["bench", "{tiny}", "--data-parallel-size", "300", "--oversubscribe"], 1,
     r"300 data-parallel replicas need about [\d,.]+ GiB .* more than the [\d,.]+ GiB of memory available", None),
    (["bench", "{tiny}", "--tensor-parallel-size", "2", "--tp-cores", "0;4095"], 1,
     r"--tp-cores '0;4095': core 4095 is not among the cores this process may run on", None),
    (["bench", "{tiny}", "--data-parallel-size", "2", "--dp-cores", "0;4095"], 1, r"--dp-cores '0;4095': core 4095",
     None),
    (["bench", "{tiny}", "--disaggregate", "1:1", "--pd-cores", "0;4095"], 1, r"--pd-cores '0;4095': core 4095", None),
    (["bench", "{tiny}", "--device", "banana"], 1, r"--device banana", None),
    # --- serve ----------------------------------------------------------------------------------------------------
    (["serve", "no-such-model"], 1, r"unknown model", None),
    (["serve", "{tiny}", "--device", "banana"], 1, r"--device banana", None),
    (["serve", "{tiny}", "--port", "70000"], 1, r"--port 70000: give a port in 0-65535", None),
    (["serve", "{tiny}", "--host", "999.1.1.1"], 1, r"--host 999\.1\.1\.1: cannot resolve it", None),
    (["serve", "{tiny}", "--max-waiting", "-1"], 2, r"--max-waiting", None),
    (["serve", "{tiny}", "--chat-template", "{bad_template}"], 1,
     r"--chat-template .*bad_template\.jinja: Jinja syntax error on line 2", None),
    (["serve", "{tiny}", "--api-key-file", "{a_folder}"], 1, r"--api-key-file .*: cannot read it", None),
    # --- recipe ---------------------------------------------------------------------------------------------------
    (["recipe", "validate", "{duplicate_variant}"], 1,
     r"duplicate_variant\.yaml:6: duplicate key 'a' \(first at line 4\)", None),
    (["recipe", "validate", "{binary}"], 1, r"is not a UTF-8 text file", None),
    (["recipe", "validate", "{a_folder}"], 1, r"is a folder: give a recipe \.yaml file", None),
    (["recipe", "validate", "{zero_requests}"], 1, r"zero_requests\.yaml:5: bench\.num_requests: .*greater than",
     None),
    (["recipe", "validate", "{missing}.yaml"], 1, r"does not exist", None),
    (["recipe", "validate", "{bad_yaml}"], 1, r"bad_yaml\.yaml:\d+: not valid YAML", None),
    (["recipe", "run", "{duplicate_variant}", "-o", OUT], 1, r"duplicate key", OUT),
    (["recipe", "validate", "{requantize}"], 1, r"variant 'qq' stage 1: quantize after quantize", None),
    (["recipe", "run", "{bad_stage}", "-o", OUT], 1,
     r"variant 'q', stage 0 \(quantize\): .*no_text_field.*text", None),
    # what the run would refuse before work, refused before anything runs (validate says the same)
    (["recipe", "run", "{misfit_stage}", "-o", OUT], 1,
     r"misfit_stage\.yaml:5: variants\.q\[0\]\.quantize: --group-size 128 does not divide", OUT),
    (["recipe", "validate", "{misfit_stage}"], 1, r"misfit_stage\.yaml:5: .*--group-size 128 does not divide", None),
    (["recipe", "run", "{zero_variant_ok}", "-o", "{a_file}"], 1, r"run folder .*a_file is a file", None),
    (["recipe", "run", "{zero_variant_ok}", "-o", "{a_file}/run"], 1, r"a_file is a file, not a folder", None),
    # --- report ---------------------------------------------------------------------------------------------------
    (["report", "{run_empty_list}", "-o", OUT], 1, r"results\.json is incomplete", OUT),
    (["report", "{run_empty_object}", "-o", OUT], 1, r"results\.json is incomplete", OUT),
    (["report", "{run_cut_json}", "-o", OUT], 1, r"results\.json is not valid JSON", OUT),
    (["report", "{a_folder}", "-o", OUT], 1, r"has no results\.json", OUT),
    (["report", "{run_empty_list}", "-o", "{a_folder}"], 1, r"report .* is a folder", None),
]


@pytest.fixture(scope="module")
def bad(tmp_path_factory, tiny_llama_dir):
    """The files and folders the cases name."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad")
    paths = {"tiny": tiny_llama_dir, "missing": root / "missing"}

    def folder(name, *files):
        path = root / name
        path.mkdir()
        for file in files:
            shutil.copy(tiny_llama_dir / file, path / file)
        paths[name] = path
        return path

    def text(name, content, mode="w"):
        path = root / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        paths[name.split(".")[0]] = path
        return path

    (folder("pickle", "config.json") / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    (folder("garbage_header", "config.json") / "model.safetensors").write_bytes(b"garbage header " * 3)
    weights = (tiny_llama_dir / "model.safetensors").read_bytes()
    (folder("truncated", "config.json", "tokenizer.json", "tokenizer_config.json") / "model.safetensors"
     ).write_bytes(weights[: len(weights) // 3])
    folder("no_config", "model.safetensors")
    folder("no_tokenizer", "config.json", "model.safetensors")
    missing = folder("missing_tensors", "config.json", "tokenizer.json", "tokenizer_config.json")
    tensors = {k: v for k, v in load_file(tiny_llama_dir / "model.safetensors").items() if ".layers.1." not in k}
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    # no chat template: none in tokenizer_config.json, and chat_template.jinja not copied
    template = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    template.pop("chat_template", None)
    (folder("no_chat_template", "config.json", "model.safetensors", "tokenizer.json") / "tokenizer_config.json"
     ).write_text(json.dumps(template))
    other = folder("other_vocab", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    (other / "config.json").write_text(json.dumps({**json.loads((tiny_llama_dir / "config.json").read_text()),
                                                    "vocab_size": 300}))
    folder("a_folder")
    text("a_file", "not a folder")
    text("bad_template.jinja", "{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    text("null_text.jsonl", '{"text": "fine"}\n{"text": null}\n')
    text("number_text.jsonl", '{"text": 42}\n')
    text("list_record.jsonl", '["text", "here"]\n')
    text("no_text_field.jsonl", '{"content": "hello world"}\n' * 20)
    text("bad_json_line.jsonl", '{"text": "fine"}\n{"text": \n')
    text("duplicate_variant.yaml", "name: x\nmodel: tiny-random-llama\nvariants:\n  a: []\n  b: []\n  a:\n"
                                   "    - cast: {dtype: bfloat16}\n")
    text("zero_variant_ok.yaml", "name: x\nmodel: tiny-random-llama\nvariants:\n  a: []\n")
    text("requantize.yaml", "name: x\nmodel: tiny-random-llama\nvariants:\n  qq:\n"
                            "    - quantize: {method: rtn, group_size: 32}\n    - quantize: {method: rtn, bits: 8}\n")
    text("misfit_stage.yaml", "name: x\nmodel: tiny-random-llama\nvariants:\n  q:\n"
                              "    - quantize: {method: rtn, group_size: 128}\n")
    text("bad_stage.yaml", "name: x\nmodel: tiny-random-llama\nvariants:\n  q:\n"
                           f"    - quantize: {{method: gptq, group_size: 32, calib: {root / 'no_text_field.jsonl'}}}\n")
    loop = root / "loop"
    loop.symlink_to(loop)
    paths["loop"] = loop
    text("zero_requests.yaml", "name: x\nmodel: tiny-random-llama\nvariants:\n  a: []\nbench: {num_requests: 0}\n")
    text("bad_yaml.yaml", "name: x\nvariants: [a\n")
    text("binary.yaml", bytes(range(256)) * 4)
    for name, content in (("run_empty_list", "[]"), ("run_empty_object", "{}"), ("run_cut_json", '{"recipe": "x"')):
        (folder(name) / "results.json").write_text(content)
    copy = root / "tiny_copy"
    shutil.copytree(tiny_llama_dir, copy)
    paths["tiny_copy"] = copy
    artifact = root / "artifact"
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "-o", str(artifact), "--method", "rtn",
                                      "--group-size", "32"])
    assert result.exit_code == 0, result.output
    paths["artifact"] = artifact
    return paths


def fill(arg: str, paths: dict, out: Path) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: str(out if m[1] == "out" else paths[m[1]]), arg)


def snapshot(path: Path) -> dict:
    return {p.relative_to(path): p.stat().st_mtime_ns for p in path.rglob("*")} if path.is_dir() else {}


@pytest.mark.parametrize("args,code,pattern,output", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_one_line(args, code, pattern, output, bad, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMOPT_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    before = {name: snapshot(Path(p)) for name, p in bad.items() if name in ("tiny", "tiny_copy", "artifact")}
    result = CliRunner().invoke(app, [fill(a, bad, out) for a in args])
    text = result.output
    assert result.exit_code == code, text
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # not an exception CliRunner caught
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith(NOTES)]
    if pattern != "Usage":  # (a group without its command prints its help)
        assert len(lines) == 1 and lines[0].startswith("error: "), text
    assert re.search(pattern, text), text
    if output is not None:
        assert not Path(fill(output, bad, out)).exists()
    # the inputs are never changed, and no temporary is left beside them
    for name, files in before.items():
        assert snapshot(Path(bad[name])) == files, f"{name} changed"
    assert not [p for p in Path(bad["tiny"]).parent.iterdir() if ".tmp-" in p.name]


def test_the_table_covers_every_command():
    assert len(CASES) >= 60
    commands = {c[0][0] for c in CASES}
    assert commands >= {"models", "generate", "eval", "quantize", "prune", "distill", "export", "bench", "serve",
                        "recipe", "report"}


def test_quantize_reads_calibration_text_from_another_field(bad, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["quantize", str(bad["tiny"]), "-o", str(out), "--method", "gptq",
                                      "--group-size", "32", "--calib", str(bad["no_text_field"]), "--text-field",
                                      "content", "--num-samples", "2", "--seqlen", "16", "--json"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "llmopt.json").read_text())
    assert manifest["stages"][-1]["settings"]["calibration"]["text_field"] == "content"
