"""Choosing a policy resets its controls: the slider only for a numeric threshold, typed values kept."""
from __future__ import annotations

from app.controls import _reset


def test_choosing_a_policy_resets_slider_and_parameters():
    slider, params = _reset("confidence")
    assert slider["visible"] and slider["value"] == 0.9 and slider["maximum"] == 1.0 and params["value"] == ""
    slider, params = _reset("schedule")
    assert not slider["visible"] and params["value"] == "every=4"


def test_a_typed_spec_keeps_its_values():
    slider, params = _reset("random:share=0.4")
    assert params["value"] == "share=0.4,seed=0"
    slider, _ = _reset("confidence:threshold=0.7")
    assert slider["value"] == 0.7
