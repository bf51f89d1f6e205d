"""`tandem plan`: its JSON, its command lines (parsed by the real parsers), and bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.cli.deploy import kuberay_options
from tandem.cli.main import build_parser, main
from tandem.workers.device_specs import DeviceSpec
from tests.unit.model.published_configs import write_config


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--output-json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_json_has_the_plan(tmp_path, capsys) -> None:
    plan = plan_json(capsys, write_config(tmp_path, "Llama-3-70B"), "--gpus-per-node", "4")
    assert {k: plan[k] for k in ("weight_bytes", "kv_bytes_per_token", "fits", "tensor_parallel_size",
                                 "pipeline_parallel_size", "kv_capacity_tokens", "min_layout")} == {
        "weight_bytes": 141_107_412_992, "kv_bytes_per_token": 327_680, "fits": True, "tensor_parallel_size": 4,
        "pipeline_parallel_size": 1, "kv_capacity_tokens": 489_248,
        "min_layout": {"tensor_parallel_size": 2, "pipeline_parallel_size": 1, "num_nodes": 1}}
    assert plan["predicted_tpot_ms"] == pytest.approx(10.399, abs=1e-3)
    assert plan["reason"].startswith("TP=2 fits the weights but its KV cache holds 28 of 64 sequences")
    assert plan["suggestions"] == []


def test_a_config_json_path_is_read_from_its_directory(tmp_path, capsys) -> None:
    path = Path(write_config(tmp_path, "Mistral-7B")) / "config.json"
    assert plan_json(capsys, str(path), "--gpu", "L4")["weight_bytes"] == 14_483_464_192


def test_the_command_lines_parse_with_the_real_parsers(tmp_path, capsys) -> None:
    model = write_config(tmp_path, "Llama-3.1-405B")
    plan = plan_json(capsys, model, "--nodes", "2", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
                     "--max-model-len", "32768", "--concurrency", "256")
    assert plan["serve_args"] == ["serve", model, "-tp", "8", "-pp", "1", "--num-replicas", "2",
                                  "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--max-model-len", "32768",
                                  "--max-num-seqs", "256"]
    serve = build_parser().parse_args(plan["serve_args"])
    assert (serve.model_tag, serve.tensor_parallel_size, serve.pipeline_parallel_size, serve.num_replicas,
            serve.quantization, serve.kv_cache_dtype, serve.max_model_len, serve.max_num_seqs) == (
        model, 8, 1, 2, "fp8", "fp8", 32768, 256)
    kuberay = kuberay_options(build_parser().parse_args(plan["kuberay_args"]))
    layout = kuberay.layout
    assert (layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.gpus_per_node,
            layout.num_replicas, layout.num_gpus) == (8, 1, 8, 2, 16)
    assert plan["serve_config_args"] == {"quantization": "fp8", "kv_cache_dtype": "fp8", "max_model_len": 32768,
                                         "max_num_seqs": 256}


def test_a_model_that_does_not_fit_prints_why_and_what_would(tmp_path, capsys) -> None:
    assert main(["plan", write_config(tmp_path, "Llama-3.1-405B")]) == 0
    out = capsys.readouterr().out
    assert "fits this cluster            NO" in out
    assert "suggestion: 2 nodes of 8 GPUs fit it (--nodes 2): TP=8 x PP=2" in out
    assert "suggestion: FP8 weights fit this cluster (--quantization fp8): TP=8 x PP=1" in out


def test_a_pre_quantized_checkpoint_is_planned_at_its_size(tmp_path, capsys) -> None:
    model = write_config(tmp_path, "Llama-3-8B", quantization_config={"quant_method": "fbgemm_fp8"})
    plan = plan_json(capsys, model)
    assert plan["weight_bytes"] == 9_081_200_640
    assert "--quantization" not in plan["serve_args"]  # the engine reads the checkpoint's own


def test_cpu_plans_use_this_machine(tmp_path, capsys, monkeypatch) -> None:
    probed = []

    def probe(itemsize: int, step_overhead_s: float = 0.0) -> DeviceSpec:
        probed.append(itemsize)
        return DeviceSpec("cpu (2 cores)", 24 << 30, 20e9, 2e11, None, step_overhead_s)

    monkeypatch.setattr(DeviceSpec, "probe_cpu", staticmethod(probe))
    model = write_config(tmp_path, "Llama-3-8B")
    plan = plan_json(capsys, model, "--device", "cpu", "--max-model-len", "2048")
    assert probed == [4]  # the engine runs float32 on CPU
    assert plan["weight_bytes"] == 4 * 8_030_261_248
    assert plan["serve_args"][:3] == ["serve", model, "--device"]
    assert plan["kuberay_args"] is None
    assert plan_json(capsys, model, "--gpu", "cpu", "--dtype", "bfloat16")["weight_bytes"] == 16_060_522_496


@pytest.mark.parametrize(("argv", "message"), [
    (["--gpu", "B300"], "unknown GPU 'B300'"),
    (["--concurrency", "0"], "concurrency: must be at least 1"),
    (["--max-model-len", "0"], "max_model_len: must be at least 1"),
    (["--gpus-per-node", "0"], "gpus_per_node: must be at least 1"),
    (["--nodes", "-1"], "num_nodes: must be at least 1"),
    (["--context-len", "9000"], "context_len 9000 is longer than max_model_len 8192"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization: must be in (0, 1]"),
    (["--max-model-len", "100000"], "longer than the model's max_position_embeddings (8192)"),
    (["--gpu-memory", "-3"], "--gpu-memory and --gpu-bandwidth must be positive"),
    (["--gpu-bandwidth", "900"], "--gpu-bandwidth goes with --gpu-memory"),
    (["--device", "cpu", "--nodes", "2"], "a CPU plan is this one machine"),
    (["--quantization", "int8", "--dtype", "float16", "--device", "cpu"], "float16 is not supported on CPU"),
])
def test_bad_options_exit_2_with_the_reason(tmp_path, capsys, argv, message) -> None:
    assert main(["plan", write_config(tmp_path, "Llama-3-8B"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_bad_models_exit_2_with_the_reason(tmp_path, capsys) -> None:
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 768}))
    assert main(["plan", str(gpt2)]) == 2
    assert "architecture ['GPT2LMHeadModel'] is not supported" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "nowhere")]) == 2
    assert "no config.json" in capsys.readouterr().err
    broken = write_config(tmp_path, "Llama-3-8B")
    (Path(broken) / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert main(["plan", broken]) == 2
    assert "cannot read" in capsys.readouterr().err
