"""kv_events_config as vLLM spells it: a dict or its JSON, vLLM's defaults, refused with the reason."""

from __future__ import annotations

import dataclasses
import json

import pytest

from iterserve.cli.flags import config_from_args
from iterserve.cli.main import build_parser, main
from iterserve.config import EngineConfig, KVEventsConfig
from iterserve.config.kv_events import offset_endpoint


def test_vllms_defaults_and_publisher_resolution():
    on = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert on is not None and on.publisher == "zmq" and on.publishes
    assert (on.endpoint, on.replay_endpoint, on.buffer_steps, on.hwm, on.max_queue_size, on.topic) == \
        ("tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    off = KVEventsConfig.parse({})
    assert off is not None and off.publisher == "null" and not off.publishes
    assert not KVEventsConfig(enable_kv_cache_events=True, publisher="null").publishes
    assert KVEventsConfig.parse(None) is None and KVEventsConfig.parse("null") is None


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "unknown publisher 'kafka'"),
    ({"enable_kv_cache_events": True, "endpoint": "udp://x:1"}, "endpoint must be"),
    ({"enable_kv_cache_events": True, "endpoint": "tcp://host"}, "has no port"),
    ({"enable_kv_cache_events": "yes"}, "true or false"),
    ({"max_queue_size": 0}, "max_queue_size must be an integer >= 1"),
    ({"enable_kv_cache_events": True, "publish_every": 2}, "unknown key"),
    ([1], "must be a dict"),
])
def test_bad_configs_are_refused_with_the_reason(bad, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.parse(bad)


def test_replicas_publish_on_offset_ports():
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557", replay_endpoint="tcp://*:5600")
    second = config.for_rank(1)
    assert (second.endpoint, second.replay_endpoint, second.data_parallel_rank) == ("tcp://*:5558", "tcp://*:5601", 1)
    assert config.for_rank(0) == config
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2" and offset_endpoint(None, 3) is None


def test_engine_config_takes_a_dict_json_or_its_own_dataclass_back():
    config = EngineConfig(kv_events_config={"enable_kv_cache_events": True, "topic": "kv"})
    assert isinstance(config.kv_events_config, KVEventsConfig) and config.kv_events_config.topic == "kv"
    again = EngineConfig(**json.loads(json.dumps(dataclasses.asdict(config))))  # a worker's JSON copy
    assert again == config


def test_the_serve_flag_takes_vllms_json_and_refuses_bad_input_in_one_line(capsys):
    args = build_parser().parse_args(["serve", "--kv-events-config", '{"enable_kv_cache_events": true}'])
    assert config_from_args(EngineConfig, args).kv_events_config == KVEventsConfig(enable_kv_cache_events=True)
    for bad, reason in (("{oops", "not valid JSON"), ('{"publisher": "kafka"}', "unknown publisher")):
        assert main(["serve", "--kv-events-config", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("iterserve: error: kv_events_config") and reason in err
