"""Tuning for one model: `--shapes-from` (a Hugging Face config.json read as plain JSON, `tuner/model_shapes.py`),
the user table in the lookup chain (`kernels/select/table_chain.py`), `normtune emit --user` and `normtune where`.

Configs are small hand-written dicts with the keys the real models' configs carry; the one sweep is an interpreted
sweep of a tiny Gemma-3-like model, one trial per problem.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, default_config, kernel_1_config
from normtune.kernels.device import interpret_mode
from normtune.kernels.select.select import clear_caches, explain, select_config
from normtune.kernels.select.table_chain import ENV_VAR, HOME_VAR, choose_table, table_for, user_dir
from normtune.kernels.select.tables import TableError, load_table, parse_table
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.model_shapes import model_shapes, parse_tokens
from normtune.tuner.store.database import Store

CONFIGS = Path(str(resources.files("normtune.configs")))
H100_NAME = "NVIDIA H100 80GB HBM3"
runner = CliRunner()

LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
QWEN3 = {"model_type": "qwen3", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 128, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
GEMMA2 = {"model_type": "gemma2", "hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4,
          "head_dim": 256, "rms_norm_eps": 1e-6, "torch_dtype": "float32"}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
GPT2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "layer_norm_epsilon": 1e-5}
OLMO2 = {"model_type": "olmo2", "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4,
         "rms_norm_eps": 1e-6, "torch_dtype": "float16"}
# A multimodal config: the language model under text_config (whose attention shape Gemma 3 configs often omit).
GEMMA3_VLM = {"model_type": "gemma3", "torch_dtype": "bfloat16", "vision_config": {"hidden_size": 1152},
              "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "rms_norm_eps": 1e-6}}
LLAMA4_VLM = {"model_type": "llama4", "text_config": {"model_type": "llama4_text", "hidden_size": 5120,
                                                      "num_attention_heads": 40, "num_key_value_heads": 8,
                                                      "head_dim": 128, "use_qk_norm": True, "rms_norm_eps": 1e-5}}


def write_config(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder / "config.json"


def shapes(problems) -> list[tuple]:
    return [(p.norm, p.M, p.N, p.dtype, p.has_weight, p.has_bias, p.zero_centered) for p in problems]


@pytest.fixture(autouse=True)
def _fresh_selection(monkeypatch, tmp_path):
    """No $NORMTUNE_CONFIG, an empty user dir, nothing loaded or warned yet."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv(HOME_VAR, str(tmp_path / "home"))
    clear_caches()
    yield
    clear_caches()


# ------------------------------------------------------------------------------------------- model configs


@pytest.mark.parametrize("cfg, kind, zc, dtype, norms", [
    (LLAMA, "rms_norm", False, "bf16", [("hidden", 4096, 1, True)]),
    (QWEN3, "rms_norm", False, "bf16", [("hidden", 4096, 1, True), ("q_norm", 128, 32, True),
                                        ("k_norm", 128, 8, True)]),
    (GEMMA2, "rms_norm", True, "fp32", [("hidden", 2304, 1, True)]),
    (DEEPSEEK_V3, "rms_norm", False, "bf16", [("hidden", 7168, 1, True), ("q_a_layernorm", 1536, 1, True),
                                              ("kv_a_layernorm", 512, 1, True)]),
    (GPT2, "layer_norm", False, "bf16", [("hidden", 768, 1, True)]),
    (OLMO2, "rms_norm", False, "fp16", [("hidden", 2048, 1, True), ("q_norm", 2048, 1, True),
                                        ("k_norm", 512, 1, True)]),
    (GEMMA3_VLM, "rms_norm", True, "bf16", [("hidden", 2560, 1, True), ("q_norm", 256, 8, True),
                                            ("k_norm", 256, 4, True)]),
    (LLAMA4_VLM, "rms_norm", False, "bf16", [("hidden", 5120, 1, True), ("q_norm", 128, 40, False),
                                             ("k_norm", 128, 8, False)]),
], ids=["llama", "qwen3", "gemma2", "deepseek-v3", "gpt2", "olmo2", "gemma3-multimodal", "llama4-multimodal"])
def test_config_gives_the_models_norms(tmp_path, cfg, kind, zc, dtype, norms):
    model = model_shapes(write_config(tmp_path, cfg))
    assert (model.norm, model.zero_centered, model.activation_dtype()) == (kind, zc, dtype)
    assert [(n.name, n.N, n.rows_per_token, n.has_weight) for n in model.norms] == norms
    assert model_shapes(tmp_path) == dataclasses.replace(model, path=str(tmp_path))  # the folder reads the same


def test_problems_are_every_norm_at_every_token_count(tmp_path):
    qwen3 = model_shapes(write_config(tmp_path, QWEN3))
    # hidden at each count; q on tokens x 32 heads, k on tokens x 8 (16384 x 8 is 4096 x 32: one problem).
    assert [(p.M, p.N) for p in qwen3.problems([4096, 16384])] == [
        (4096, 4096), (16384, 4096), (4096 * 32, 128), (16384 * 32, 128), (4096 * 8, 128)]
    assert {shapes([p])[0][3:] for p in qwen3.problems([4096])} == {("bf16", True, False, False)}
    gpt2 = model_shapes(write_config(tmp_path / "gpt2", GPT2))
    assert shapes(gpt2.problems([8])) == [("layer_norm", 8, 768, "bf16", True, True, False)]
    assert shapes(gpt2.problems([8], bias=False)) == [("layer_norm", 8, 768, "bf16", True, False, False)]
    # Given explicitly, the norm kinds, dtype and zero-centering replace the model's.
    gemma = model_shapes(write_config(tmp_path / "gemma", GEMMA2))
    assert shapes(gemma.problems([8])) == [("rms_norm", 8, 2304, "fp32", True, False, True)]
    assert shapes(gemma.problems([8], norms=["layer_norm", "rms_norm"], dtype="fp16", zero_centered=False)) == [
        ("layer_norm", 8, 2304, "fp16", True, True, False), ("rms_norm", 8, 2304, "fp16", True, False, False)]
    # Weightless q/k norms (Llama 4's L2 norm) are never zero-centered; repeated shapes are one problem.
    llama4 = model_shapes(write_config(tmp_path / "llama4", LLAMA4_VLM))
    assert shapes(llama4.problems([2, 2], zero_centered=True))[1:] == [
        ("rms_norm", 80, 128, "bf16", False, False, False), ("rms_norm", 16, 128, "bf16", False, False, False)]
    assert parse_tokens("4096, 16384,4096") == [4096, 16384]


@pytest.mark.parametrize("make, needles", [
    (lambda d: d / "missing.json", ["missing.json", "no such file"]),
    (lambda d: d, ["holds no config.json"]),
    (lambda d: write_config(d, {"model_type": "llama", "num_attention_heads": 8}), ["no hidden_size", "n_embd"]),
    (lambda d: (d / "c.json", (d / "c.json").write_text("{oops")), ["not valid JSON"]),
    (lambda d: write_config(d, {"model_type": "qwen3", "hidden_size": 64}), ["head_dim", "num_attention_heads"]),
], ids=["missing", "folder-without-config", "no-hidden-size", "not-json", "qk-without-heads"])
def test_unreadable_configs_are_refused_naming_the_file(tmp_path, make, needles):
    made = make(tmp_path)
    path = made[0] if isinstance(made, tuple) else made
    with pytest.raises(ValueError) as info:
        model_shapes(path)
    assert str(path) in str(info.value) and all(n in str(info.value) for n in needles), str(info.value)


def test_what_a_config_leaves_open_needs_an_option(tmp_path):
    fp8 = model_shapes(write_config(tmp_path / "a", {**LLAMA, "torch_dtype": "float8_e4m3fn"}))
    with pytest.raises(ValueError, match="float8_e4m3fn.*pass --dtype"):
        fp8.problems([8])
    assert fp8.problems([8], dtype="bf16")[0].dtype == "bf16"
    unknown = model_shapes(write_config(tmp_path / "b", {"model_type": "mystery", "hidden_size": 64}))
    with pytest.raises(ValueError, match="pass --norm rms_norm or --norm layer_norm"):
        unknown.problems([8])
    assert unknown.problems([8], norms=["rms_norm"])[0].norm == "rms_norm"
    for bad in ("", "0", "4096,x", "-8"):
        with pytest.raises(ValueError, match="positive token counts"):
            parse_tokens(bad)


def one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 1, result.output
    lines = [line for line in (result.stderr or result.output).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


@pytest.mark.parametrize("args, needles", [
    (["--shapes-from", "{tmp}/none.json"], ["--shapes-from", "none.json", "no such file"]),
    (["--shapes-from", "{tmp}/gpt2", "--tokens", "0"], ["--tokens '0'", "positive token counts"]),
    (["--tokens", "8"], ["--tokens 8", "--shapes-from"]),
    (["--shapes-from", "{tmp}/gpt2", "--shapes", "8x64"], ["--shapes 8x64", "--shapes-from", "give one"]),
    (["--shapes-from", "{tmp}/empty"], ["--shapes-from", "no hidden_size"]),
])
def test_sweep_refuses_bad_model_options_in_one_line(tmp_path, args, needles):
    write_config(tmp_path / "gpt2", GPT2)
    write_config(tmp_path / "empty", {"model_type": "llama"})
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    one_line_error(runner.invoke(app, ["sweep", "--interpret", "--trials", "1", "--db",
                                       f"sqlite:///{tmp_path / 'r.db'}", *args]), *needles)


def test_sweep_shapes_from_a_model(tmp_path):
    """A tiny Gemma-3-like model: hidden 64 and per-head q/k norms over 32 (2 heads, 1 KV head), zero-centered,
    at 8 and 16 tokens: five distinct problems (k at 16 tokens is q at 8), one trial each."""
    if not interpret_mode():
        pytest.skip("runs `normtune sweep --interpret`: set TRITON_INTERPRET=1")
    cfg = write_config(tmp_path / "model", {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 2,
                                            "num_key_value_heads": 1, "head_dim": 32, "rms_norm_eps": 1e-6})
    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    result = runner.invoke(app, ["sweep", "--interpret", "--shapes-from", str(cfg), "--tokens", "8,16", "--trials", "1",
                                 "--sampler", "random", "--compile-workers", "0", "--db", url])
    assert result.exit_code == 0, result.output
    assert "5 problems" in result.output and "gemma3_text, rms_norm zero-centered" in result.output
    want = {("rms_norm", M, N, "bf16", True, False, True) for M, N in ((8, 64), (16, 64), (16, 32), (32, 32), (8, 32))}
    with Store(url, read_only=True) as store:
        made = store.problems(interpret=True)
        assert set(shapes(made)) == want and len(made) == 5
        assert all(store.count_measurements(problem=p, interpret=True) == 1 for p in made)


# ---------------------------------------------------------------------------------------------- user tables


def h100_table(folder: Path, name: str = "h100.json", **changes) -> Path:
    data = json.loads((CONFIGS / "h100.json").read_text())
    data.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(data))
    return folder / name


PROBLEM = Problem("rms_norm", 4096, 8192, "bf16")


def test_user_dir_is_normtune_home_else_xdg_else_dot_config(monkeypatch, tmp_path):
    assert user_dir() == tmp_path / "home"
    monkeypatch.delenv(HOME_VAR)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert user_dir() == tmp_path / "xdg" / "normtune"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative")  # not absolute: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    assert user_dir() == tmp_path / "me" / ".config" / "normtune"


def test_user_table_wins_over_shipped_and_env_wins_over_user(monkeypatch, tmp_path):
    user = h100_table(user_dir())
    for name in (H100_NAME, "NVIDIA H100 PCIe"):  # keyed by GPU family, exact name or not
        choice = choose_table(name, (9, 0))
        assert choice.table.path == str(user) and choice.warning is None
        assert [(s.source, s.taken) for s in choice.steps] == [("env", False), ("user", True)]
    assert select_config(PROBLEM, H100_NAME, (9, 0)) == load_table(str(user)).lookup(PROBLEM)
    assert choose_table(None).table is None  # no GPU: no user table
    env = h100_table(tmp_path / "env", "mine.json")
    monkeypatch.setenv(ENV_VAR, str(env))
    clear_caches()
    choice = choose_table(H100_NAME, (9, 0))
    assert choice.table.path == str(env) and [s.source for s in choice.steps] == ["env"]


@pytest.mark.parametrize("text, needle", [("{not json", "not valid JSON"), ('{"schema_version": 1}', "no gpu.name")])
def test_malformed_user_table_is_refused_naming_the_file(text, needle):
    path = user_dir() / "h100.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with pytest.raises(TableError) as info:
        select_config(PROBLEM, H100_NAME, (9, 0))
    message = str(info.value)
    assert str(path) in message and needle in message and "normtune emit --gpu h100 --user" in message, message


def test_another_gpus_table_saved_as_the_user_table_is_skipped_with_a_warning_naming_it():
    """An H200 table saved as h100.json: its configs were never timed on an H100, so the chain goes on to the
    shipped table and says why, once."""
    h200 = json.loads((CONFIGS / "h200.json").read_text())
    path = user_dir() / "h100.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(h200))
    choice = choose_table(H100_NAME, (9, 0))
    assert choice.table is not None and choice.table.path != str(path) and choice.table.gpu_key == "h100"
    assert str(path) in choice.warning and h200["gpu"]["name"] in choice.warning
    assert [s.source for s in choice.steps] == ["env", "user", "shipped"] and "skipped" in choice.steps[1].detail
    with pytest.warns(UserWarning, match="not used") as caught:
        table_for(H100_NAME, (9, 0))
        table_for(H100_NAME, (9, 0))
    assert len([w for w in caught if "not used" in str(w.message)]) == 1


def test_a_user_table_with_a_duplicated_rule_is_refused_where_it_is_read():
    """A rule copied ahead of the others shadowed them (the first match wins): `where` showed the copy's config
    without a word. Now the table is refused, naming the file and both rules."""
    data = json.loads((CONFIGS / "h100.json").read_text())
    rules = data["families"]["rms_norm/bf16/wbf16/nobias/save-input"]["rules"]
    rules.insert(3, dict(rules[3]))
    path = user_dir() / "h100.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    bounds = f"(n_max {rules[3]['n_max']}, m_max {rules[3]['m_max']})"
    one_line_error(runner.invoke(app, ["where", "--gpu", "h100", "--shape", "8x64"]), str(path),
                   f"rule 4 {bounds} is never used: rule 3 {bounds} comes first and covers it",
                   "normtune emit --gpu h100 --user")


def test_interpreter_user_table_is_refused_on_a_gpu():
    path = h100_table(user_dir(), interpret=True)
    with pytest.raises(TableError, match=rf"{path}: it holds Triton-interpreter timings.*--user"):
        choose_table(H100_NAME, (9, 0))


# ------------------------------------------------------------------------------------------- normtune where


def where(*args: str):
    result = runner.invoke(app, ["where", *args])
    assert result.exit_code == 0, result.output
    return result.output


def printed_config(output: str) -> BackwardConfig:
    line = next(line for line in output.splitlines() if line.startswith("config "))
    return BackwardConfig.from_json(line.split(None, 1)[1])


def test_where_names_the_shipped_rule():
    out = where("--gpu", "h100", "--shape", "4096x8192", "--norm", "rms_norm")
    shipped = load_table(str(CONFIGS / "h100.json"))
    match = shipped.match(PROBLEM)
    rule = match.rule
    assert "1. $NORMTUNE_CONFIG: not set" in out
    assert f"2. user table {user_dir() / 'h100.json'}: not found" in out
    assert "3. shipped table configs/h100.json: GPU family h100 (tuned on 'NVIDIA H100 80GB HBM3')   <- used" in out
    assert f"rule #{match.index + 1} (n_max {rule.n_max}" in out and ", ".join(rule.fitted_on) in out
    assert printed_config(out) == shipped.lookup(PROBLEM) == select_config(PROBLEM, H100_NAME, (9, 0))
    record = json.loads(where("--gpu", "h100", "--shape", "4096x8192", "--json"))
    assert record["table"] == "configs/h100.json" and record["rule"] == match.index + 1
    assert record["source"] == "table" and BackwardConfig.from_dict(record["config"]) == shipped.lookup(PROBLEM)


def test_where_outside_the_fitted_box_is_the_default():
    out = where("--gpu", "h100", "--shape", "4096x64", "--norm", "rms_norm")
    problem = Problem("rms_norm", 4096, 64)
    assert "4096x64 lies outside the fitted box (M 64…1048576, N 128…65536) → the analytic default" in out
    assert printed_config(out) == default_config(problem) == explain(problem, "h100").config
    out = where("--gpu", "h100", "--shape", "20000x3000", "--norm", "layer_norm")
    problem = Problem("layer_norm", 20000, 3000, has_bias=True)
    assert "N=3000 is not a multiple of 16 and the rules were fitted on multiples of 16 only" in out
    assert printed_config(out) == default_config(problem)
    out = where("--gpu", "a100", "--shape", "64x512", "--norm", "layer_norm")
    assert "none for GPU family a100" in out and "the analytic defaults" in out and "table    none" in out


def test_where_names_a_user_table_and_an_explicit_table(monkeypatch, tmp_path):
    user = h100_table(user_dir())
    out = where("--gpu", "h100", "--shape", "4096x8192")
    assert f"2. user table {user}: found   <- used" in out and "shipped" not in out
    env = h100_table(tmp_path / "env", "mine.json")
    monkeypatch.setenv(ENV_VAR, str(env))
    clear_caches()
    out = where("--gpu", "h100", "--shape", "4096x8192")
    assert f"1. $NORMTUNE_CONFIG: {env}   <- used" in out and "user table" not in out
    monkeypatch.delenv(ENV_VAR)
    out = where("--gpu", "h100", "--shape", "4096x8192", "--config-file", str(env))
    assert f"1. --config-file {env}: {env}   <- used" in out


@pytest.mark.parametrize("args, needles", [
    (["--gpu", "h100", "--shape", "4096"], ["--shape", "MxN"]),
    (["--gpu", "h100"], ["--shape", "e.g. --shape 4096x8192"]),
    (["--gpu", "h100", "--shape", "8x64", "--bias"], ["--bias", "rms_norm has no bias"]),
    (["--gpu", "h100", "--shape", "8x64", "--config-file", "nope.json"], ["--config-file nope.json", "no such file"]),
    (["--gpu", "interpret", "--shape", "8x64"], ["--gpu 'interpret'", "h100"]),
    (["--gpu", "h100", "--shape", "99999999999999999999x4096"], ["--shape", "M exceeds the supported maximum"]),
])
def test_where_errors_are_one_line(args, needles):
    one_line_error(runner.invoke(app, ["where", *args]), *needles)


# ---------------------------------------------------------------------------------------------- emit --user


GPU = DeviceInfo(name="NVIDIA Test GPU X1", key="test-gpu-x1", compute_capability="9.0", sm_count=8,
                 l2_bytes=50 * 2**20, memory_bytes=80 * 2**30, driver="560.35.03", cuda="12.6", torch="2.6.0",
                 triton="3.2.0", normtune="0.1.0", git_revision="0123abcd", host="gpu-7", python="3.11.9",
                 interpret=False)


def test_emit_user_writes_the_table_the_runtime_then_uses(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    fast = BackwardConfig(kernel_1_config(block_row=1, block_col=256, num_warps=4), Kernel2Config(128, 16, 4))
    slow = BackwardConfig(kernel_1_config(block_row=2, block_col=256, num_warps=8), Kernel2Config(64, 32, 4))
    with Store(url) as store:
        run = store.start_run(GPU, kind="sweep", command_line="normtune sweep --gpu test-gpu-x1")
        for M in (64, 512):
            for cfg, us in ((fast, 5.0), (slow, 9.0)):
                store.add_measurement(run, Problem("rms_norm", M, 256), cfg,
                                      MeasureResult(status="ok", median_us=us, p10_us=us, p90_us=us, reps=20),
                                      source="sweep")
        store.end_run(run)
    result = runner.invoke(app, ["emit", "--gpu", "test-gpu-x1", "--db", url, "--user"])
    assert result.exit_code == 0, result.output
    path = user_dir() / "test-gpu-x1.json"
    assert path.is_file() and str(path) in result.output.replace("\n", "")
    table = parse_table(json.loads(path.read_text()), str(path))
    assert table.gpu_key == "test-gpu-x1" and table.lookup(Problem("rms_norm", 100, 256)) == fast
    why = explain(Problem("rms_norm", 100, 256), GPU.name, (9, 0))
    assert why.table.path == str(path) and why.config == fast and why.match.index == 0
    one_line_error(runner.invoke(app, ["emit", "--gpu", "test-gpu-x1", "--db", url, "--user", "--out", "x.json"]),
                   "--user and --out x.json")
    one_line_error(runner.invoke(app, ["emit", "--interpret", "--db", url, "--user"]), "--user", "interpreter")
