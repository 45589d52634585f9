"""The shipped reference's recorded held-out data resolve on any machine (from the data presets)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from eaglewire.core.presets import recorded_data
from eaglewire.model.checkpoint import read_draft_config


def test_a_recorded_path_that_is_not_here_falls_back_to_its_preset(tmp_path):
    missing = str(tmp_path / "runs" / "sharegpt-5k-6k1")
    assert recorded_data({"data": missing, "data_preset": "sharegpt"}) == "sharegpt"
    assert recorded_data({"data": str(tmp_path), "data_preset": "sharegpt"}) == str(tmp_path)  # here: kept
    assert recorded_data({"data": missing}) == missing  # no preset recorded: the path, for its own error
    assert recorded_data({"data": missing, "data_preset": "no-such-preset"}) == missing
    assert recorded_data({}) is None


def test_the_reference_doctor_finds_its_held_out_conversations_here(smollm2_tokenizer):
    """What `doctor --draft reference` reads with its default data: the recorded path is another
    machine's; the held-out conversations come from the sharegpt preset, every one of them."""
    from eaglewire.doctor.doctor_config import DoctorConfig
    from eaglewire.doctor.verdicts import DoctorReport
    from eaglewire.doctor.doctor_command import _load_sequences

    config = read_draft_config("reference")
    training = config["training"]
    assert not Path(training["data"]).exists()  # as on any machine but the one that trained it
    assert recorded_data(training) == "sharegpt"
    # the training length: at the doctor's shorter default a few replies start past the cut
    doctor = DoctorConfig(draft="reference", num_sequences=len(training["heldout_sequence_ids"]),
                          max_length=training["config"]["max_length"])
    sequences, source = _load_sequences(doctor, SimpleNamespace(tokenizer=smollm2_tokenizer), None, training,
                                        DoctorReport(draft="reference", target="smollm2-135m"))
    assert source == "conversations sharegpt"
    held = set(training["heldout_sequence_ids"])
    assert {s.id for s in sequences} == held
