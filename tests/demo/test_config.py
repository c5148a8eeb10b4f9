"""DemoConfig: architectures, their defaults, validation and cache keys."""

import pytest

from xgr.core import XgrError
from xgr.demo import DemoConfig


def test_cache_key_differs_per_arch_and_keeps_the_qwen2_keys():
    # The Qwen2 default's key from before ``arch`` existed: cached models stay valid.
    assert DemoConfig().cache_key == "60e2ebd420f3" == DemoConfig.for_arch("qwen2").cache_key
    t5 = DemoConfig.quick("t5")
    assert t5.cache_key != DemoConfig.quick().cache_key
    assert t5.cache_key != t5.with_changes(seed=1).cache_key
    assert DemoConfig.quick().with_changes(arch="qwen2").cache_key == DemoConfig.quick().cache_key


def test_t5_default_shape_and_training():
    t5 = DemoConfig.for_arch("t5")
    assert t5.arch == "t5" and t5.num_kv_heads == t5.num_heads
    assert (t5.hidden_size, t5.num_layers, t5.max_history) == (128, 2, 50)
    assert t5.max_steps == 1000 and t5.batch_size == 32
    assert DemoConfig.quick("t5").num_kv_heads == DemoConfig.quick("t5").num_heads


def test_bad_arch_settings_are_named():
    with pytest.raises(XgrError, match="arch must be one of \\['qwen2', 't5'\\], got 'bert'"):
        DemoConfig(arch="bert")
    with pytest.raises(XgrError, match="bert"):
        DemoConfig.for_arch("bert")
    with pytest.raises(XgrError, match="num_kv_heads must equal num_heads"):
        DemoConfig(arch="t5", num_heads=4, num_kv_heads=2)
