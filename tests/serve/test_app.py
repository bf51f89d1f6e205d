"""build_app's deployment options (no Ray needed): placement groups, routing, scaling."""

from __future__ import annotations

import os

import pytest

from tandem.router.app import SERVING_DEFAULTS, _group_options, build_app, default_ingress_replicas, num_cpus_needed
from tandem.workers.config import EngineConfig


def options(**engine) -> dict:
    return _group_options(EngineConfig.from_options(**engine), dict(SERVING_DEFAULTS))


def test_single_worker_group_runs_in_its_replica():
    opts = options()
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}
    assert "placement_group_bundles" not in opts
    # A call per request it runs, and each ingress replica's channel.
    channels = default_ingress_replicas(os.cpu_count() or 1)
    assert opts["num_replicas"] == 1 and opts["max_ongoing_requests"] == 2 * 128 + channels
    assert opts["request_router_config"].request_router_class == "tandem.router.request_router:LoadAwareRouter"


def test_parallel_group_gets_a_placement_group_bundle_per_worker():
    tp = options(tensor_parallel_size=2)
    assert tp["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert tp["placement_group_strategy"] == "STRICT_PACK"  # TP ranks share a node
    pp = options(tensor_parallel_size=2, pipeline_parallel_size=2, device="cuda")
    assert pp["placement_group_bundles"] == [{"CPU": 1.0}] + [{"GPU": 1.0}] * 4
    assert pp["placement_group_strategy"] == "PACK"  # stages may span nodes
    assert pp["ray_actor_options"] == {"num_cpus": 1}  # fits bundle 0


def test_autoscaling_replaces_num_replicas():
    serving = {**SERVING_DEFAULTS, "autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}
    opts = _group_options(EngineConfig(), serving)
    assert "num_replicas" not in opts and opts["autoscaling_config"].max_replicas == 3
    build_app({"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}})


def test_unknown_or_bad_args_fail_with_the_field_name():
    with pytest.raises(ValueError, match="^max_tokenz: unknown engine option"):
        build_app({"max_tokenz": 3})
    with pytest.raises(ValueError, match="^tensor_parallel_size:"):
        build_app({"tensor_parallel_size": 0})
    with pytest.raises(ValueError, match="^routing: must be one of prefix, load"):
        build_app({"routing": "random"})
    with pytest.raises(ValueError, match="^kv_fetch:"):
        build_app({"kv_fetch": "sometimes"})
    with pytest.raises(ValueError, match="^channel_transport: must be one of socket, serve, got 'zmq'"):
        build_app({"channel_transport": "zmq"})
    with pytest.raises(ValueError, match="^max_request_body_bytes_in_flight: must be >= max_request_body_bytes"):
        build_app({"max_request_body_bytes_in_flight": 4096})
    for transport in ("socket", "serve"):  # the groups choose what their Accepted names
        group = build_app({"channel_transport": transport})._bound_deployment.init_args[0]._bound_deployment
        assert group.init_args[1]["channel_transport"] == transport
    with pytest.raises(ValueError, match="^host_kv_cache_memory:"):
        build_app({"host_kv_cache_memory": -1})


def test_streamed_requests_go_on_the_channel_up_to_the_ingress_share_of_a_group():
    def sent(**serving) -> int:
        ingress = build_app({"ingress_num_replicas": 2, **serving})._bound_deployment
        return ingress.init_args[1]["max_sent_on_channel"]

    assert sent() == 128  # 2 x max_num_seqs 128 ongoing per group, over two ingress replicas
    assert sent(max_ongoing_requests=101) == 51
    # Never where Serve must see each request (autoscaling reads its calls), nor without sockets.
    assert sent(autoscaling_config={"min_replicas": 1, "max_replicas": 3}) == 0
    assert sent(channel_transport="serve") == 0
    assert sent(stream_channels=False) == 0
    assert sent(requests_on_channel=False) == 0
    with pytest.raises(ValueError, match="^requests_on_channel: must be true or false, got 'yes'"):
        build_app({"requests_on_channel": "yes"})


def test_router_gets_the_routing_policy_and_block_size():
    kwargs = options(block_size=32)["request_router_config"].request_router_kwargs
    assert kwargs == {"routing": "prefix", "block_size": 32, "tokens_per_request": 256.0, "max_imbalance": 4.0,
                      "metrics": True}
    quiet = _group_options(EngineConfig.from_options(), {**SERVING_DEFAULTS, "metrics": False})
    assert quiet["request_router_config"].request_router_kwargs["metrics"] is False  # no router counter either
    # Without a prefix cache there is nothing to route on.
    no_cache = options(enable_prefix_caching=False)["request_router_config"].request_router_kwargs
    assert no_cache["routing"] == "load"


def test_logical_cpus_a_local_ray_needs():
    assert num_cpus_needed({}) == 1
    assert num_cpus_needed({"tensor_parallel_size": 2, "num_replicas": 2}) == 6


def test_env_vars_reach_the_groups_and_the_ingress_and_are_checked():
    serving = {**SERVING_DEFAULTS, "env_vars": {"OTEL_TRACES_EXPORTER": "console"}}
    for config in (EngineConfig.from_options(), EngineConfig.from_options(tensor_parallel_size=2)):
        assert _group_options(config, serving)["ray_actor_options"]["runtime_env"] == {
            "env_vars": {"OTEL_TRACES_EXPORTER": "console"}}
    assert "runtime_env" not in options()["ray_actor_options"]
    app = build_app({"env_vars": {"OTEL_TRACES_EXPORTER": "console"}})
    assert app._bound_deployment.ray_actor_options["runtime_env"] == {"env_vars": {
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "OTEL_TRACES_EXPORTER": "console"}}
    with pytest.raises(ValueError, match="^env_vars: must map names to string values"):
        build_app({"env_vars": {"OTEL_BSP_SCHEDULE_DELAY": 100}})


def test_the_ingress_code_runs_on_its_replicas_main_loop_unless_asked_otherwise():
    def ingress_env(**serving) -> dict | None:
        runtime_env = build_app(serving)._bound_deployment.ray_actor_options.get("runtime_env")
        return None if runtime_env is None else runtime_env["env_vars"]

    assert ingress_env() == {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
    assert ingress_env(ingress_on_main_loop=False) is None
    # env_vars win over what tandem sets
    assert ingress_env(env_vars={"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}) == {
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "1"}
    assert "runtime_env" not in options()["ray_actor_options"]  # the groups: Serve's default
    with pytest.raises(ValueError, match="^ingress_on_main_loop: must be true or false, got 1"):
        build_app({"ingress_on_main_loop": 1})


def test_ingress_replicas_default_to_one_per_8_cores_and_bad_counts_are_refused():
    assert [default_ingress_replicas(c) for c in (1, 2, 8, 16, 63, 64, 200)] == [1, 1, 1, 2, 7, 8, 8]
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="^ingress_num_replicas: must be an integer >= 1"):
            build_app({"ingress_num_replicas": bad})
    with pytest.raises(ValueError, match="^ingress_max_chunks_per_s: must be a number >= 0"):
        build_app({"ingress_max_chunks_per_s": -5})


def test_a_simulated_device_asks_for_no_gpu_even_where_the_device_is_cuda():
    config = EngineConfig.from_options(device="cuda", simulated_step_ms="5.9,0.01")
    opts = _group_options(config, dict(SERVING_DEFAULTS))
    assert opts["ray_actor_options"]["num_gpus"] == 0


def test_only_the_keys_digest_is_deployed_whichever_way_the_key_is_given(tmp_path):
    import hashlib

    digest = hashlib.sha256(b"s3cret-key").hexdigest()
    (tmp_path / "key").write_text("s3cret-key\n")
    for args in ({"api_key": "s3cret-key"}, {"api_key_file": str(tmp_path / "key")},
                 {"api_key_sha256": digest.upper()}):
        ingress = build_app(args)._bound_deployment
        assert ingress.init_args[1]["api_key_sha256"] == digest, args
        # Nothing Serve stores or shows of the application holds the key itself.
        group = ingress.init_args[0]._bound_deployment
        shown = repr((ingress.init_args[1], ingress.init_kwargs, ingress.ray_actor_options, group.init_args,
                      group.init_kwargs, group.ray_actor_options))
        assert "s3cret-key" not in shown, args
    assert build_app({})._bound_deployment.init_args[1]["api_key_sha256"] is None
    with pytest.raises(ValueError, match="^api_key_file: give one of api_key, api_key_file and api_key_sha256"):
        build_app({"api_key": "a", "api_key_file": str(tmp_path / "key")})
    with pytest.raises(ValueError, match="^api_key_file: .* holds no key"):
        build_app({"api_key_file": str(tmp_path / "empty")}) if (tmp_path / "empty").write_text("\n") else None
    with pytest.raises(ValueError, match="^api_key_file: cannot read"):
        build_app({"api_key_file": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="^api_key_sha256: must be 64 hex digits"):
        build_app({"api_key_sha256": "abc"})


def test_gpus_are_decided_by_the_configuration_not_by_the_nodes_joined_so_far(monkeypatch, caplog):
    from tandem.router import app

    cuda = _group_options(EngineConfig.from_options(device="cuda"), dict(SERVING_DEFAULTS))
    assert cuda["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    typed = _group_options(EngineConfig.from_options(tensor_parallel_size=2),
                           {**SERVING_DEFAULTS, "accelerator_type": "H100"})
    assert typed["placement_group_bundles"] == [{"CPU": 1.0}] + [{"GPU": 1.0, "accelerator_type:H100": 0.001}] * 2
    one = _group_options(EngineConfig.from_options(simulated_step_ms="5.9,0.01"),
                         {**SERVING_DEFAULTS, "accelerator_type": "A100"})
    assert one["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "A100"}
    # auto: what is visible when the application is built, and a CPU deployment is said aloud.
    monkeypatch.setattr(app, "gpus_visible", lambda: True)
    assert options()["ray_actor_options"]["num_gpus"] == 1
    monkeypatch.setattr(app, "gpus_visible", lambda: False)
    with caplog.at_level("WARNING", logger="tandem.router.app"):
        assert options()["ray_actor_options"]["num_gpus"] == 0
    assert "its replica groups run on CPU" in caplog.text
    with pytest.raises(ValueError, match="^accelerator_type: H100 asks for GPUs but device is cpu"):
        build_app({"device": "cpu", "accelerator_type": "H100"})
    with pytest.raises(ValueError, match="^accelerator_type: must be a Ray accelerator type"):
        build_app({"accelerator_type": "H100; rm"})
