"""Service settings from the environment: nesting, the BERTKNN_MODEL shorthand, cross-field checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.settings import ServiceSettings


def test_model_shorthand_nested_and_json(monkeypatch):
    monkeypatch.setenv("BERTKNN_MODEL", "/models/proxy")
    assert ServiceSettings().model.name == "/models/proxy"
    monkeypatch.setenv("BERTKNN_MODEL", '{"name": "bert-base-uncased", "device": "cpu"}')
    s = ServiceSettings()
    assert (s.model.name, s.model.device) == ("bert-base-uncased", "cpu")
    monkeypatch.delenv("BERTKNN_MODEL")
    monkeypatch.setenv("BERTKNN_MODEL__DEVICE", "cpu")
    monkeypatch.setenv("BERTKNN_CACHE__REDIS_URL", "rediss://:pw@redis:6380/0")
    s = ServiceSettings()
    assert s.model.device == "cpu" and s.model.name is None and s.cache.redis_url.startswith("rediss://")


def test_cross_field_and_range_checks(monkeypatch):
    monkeypatch.setenv("BERTKNN_DEFAULTS__TOP_K", "500")
    with pytest.raises(ValidationError, match="top_k"):
        ServiceSettings()
    monkeypatch.delenv("BERTKNN_DEFAULTS__TOP_K")
    monkeypatch.setenv("BERTKNN_CACHE__KEY_PREFIX", "bad prefix with spaces")
    with pytest.raises(ValidationError, match="key_prefix"):
        ServiceSettings()
