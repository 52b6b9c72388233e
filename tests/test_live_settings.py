"""The live settings beside the learning rate (app.live_settings), as the web Train tab's fold
(app.web.settings_fold) and the notebook panel's (app.notebook.extras.SettingsControls) offer
them: a box for every field of `set` but lr and the chat's generation defaults, taken from the
command itself; typed text read into the command's arguments or refused naming the setting; the
run's present values worded. Sent to a real run: tests/test_web_backend.py and test_widgets.py."""

from __future__ import annotations

import os

import pytest

from app import live_settings
from app.session import SessionError
from contract.protocol.commands import Set

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def test_every_field_of_set_but_lr_and_generation_has_a_box_in_both_front_ends(tmp_path):
    from app.notebook.extras import SettingsControls
    from app.web import build_app
    from app.web.backend import Backend
    offered = set(Set.model_fields) - {"lr", "generation"}
    assert set(live_settings.names()) == offered and {"weight_decay", "betas", "eps", "serving_budget"} <= offered
    backend = Backend(tmp_path / "runs")
    try:
        page = build_app(backend)
        ids = {getattr(block, "elem_id", None) for block in page.blocks.values()}
        assert {f"train-set-{name}" for name in offered} <= ids
    finally:
        backend.close()
    panel = SettingsControls(lambda: None, lambda *_: None, lambda _: None)
    assert set(panel.boxes) == offered
    assert panel.boxes["betas"].description_tooltip == Set.model_fields["betas"].description


def test_typed_text_becomes_the_commands_arguments():
    assert live_settings.changes({"weight_decay": " 0.05 ", "betas": "0.85, 0.99", "eps": "", "grad_clip": None,
                                  "optimizer": '{"amsgrad": true}', "save_every_n_steps": "25"}) == {
        "weight_decay": 0.05, "betas": [0.85, 0.99], "optimizer": {"amsgrad": True}, "save_every_n_steps": 25}
    Set(**live_settings.changes({"betas": "0.8 0.95"}))  # what the verb builds from it


@pytest.mark.parametrize("name, text, words", [
    ("eps", "abc", "Eps: must be a number, got 'abc'"),
    ("save_every_n_steps", "2.5", "Save every n steps: must be a whole number, got '2.5'"),
    ("betas", "0.9; x", "Betas: must be numbers separated by a comma"),
    ("optimizer", "[1, 2]", "Optimizer: must be a JSON object of optimizer fields")])
def test_text_of_the_wrong_kind_is_refused_naming_the_setting(name, text, words):
    with pytest.raises(SessionError) as refused:
        live_settings.changes({name: text})
    assert str(refused.value).startswith(words)


def test_nothing_typed_is_refused_and_present_values_are_worded():
    with pytest.raises(SessionError, match="at least one box"):
        live_settings.changes({"eps": "  ", "betas": ""})
    settings = {"lr": 1e-3, "grad_clip": 1.0, "weight_decay": 0.05, "betas": [0.85, 0.99], "eps": None,
                "optimizer": {"lr": 1e-3, "betas": [0.85, 0.99], "amsgrad": False, "foreach": None},
                "serving_budget": 0.05}
    assert live_settings.present(settings) == [
        ("Grad clip", "1"), ("Weight decay", "0.05"), ("Betas", "0.85, 0.99"), ("Optimizer", "amsgrad False"),
        ("Serving budget", "0.05")]
    assert live_settings.present(None) == []
