"""A checkpoint's manifest and resume state (issue 57): a flipped byte since the save, a hand-edited state file and a
planted malicious pickle are refused in one line naming the file, before anything loads; nothing planted runs."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from trl_helpers import make_trainer

from trl_integration import HardenedSafeVocabGRPOTrainer
from trl_integration.harness.manifest import MANIFEST_NAME, file_crc32, manifest_problem


@pytest.fixture(scope="module")
def saved_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("manifest-run")
    make_trainer(tiny_model_dir, out, HardenedSafeVocabGRPOTrainer, max_steps=2, save_strategy="steps",
                 save_steps=1).train()  # fmt: skip
    return out / "checkpoint-2"


def copy_of(checkpoint, tmp_path):
    target = tmp_path / "run" / checkpoint.name
    shutil.copytree(checkpoint, target)
    return target


def resume(tiny_model_dir, checkpoint, tmp_path, **config):
    trainer = make_trainer(tiny_model_dir, tmp_path / "resumed", HardenedSafeVocabGRPOTrainer, max_steps=3, **config)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return trainer


def test_each_save_lists_every_file_with_its_size_and_crc32(saved_run):
    manifest = json.loads((saved_run / MANIFEST_NAME).read_text())
    files = {p.name for p in saved_run.iterdir() if p.name != MANIFEST_NAME}
    assert set(manifest["files"]) == files >= {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                                                "safevocab_settings.json", "rng_state.pth"}  # fmt: skip
    for name, entry in manifest["files"].items():
        assert entry == {"size": (saved_run / name).stat().st_size, "crc32": file_crc32(saved_run / name)}
    assert manifest_problem(saved_run) is None


def test_a_flipped_byte_is_refused_naming_the_file_unless_verification_is_off(saved_run, tiny_model_dir, tmp_path):
    checkpoint = copy_of(saved_run, tmp_path)
    data = bytearray((checkpoint / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, in a tensor's bytes: the file still loads
    (checkpoint / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError) as err:
        resume(tiny_model_dir, checkpoint, tmp_path)
    message = str(err.value)
    assert (
        "optimizer.pt does not match its CRC-32 in safevocab_manifest.json: the file changed after the save" in message
    )
    assert "resume_verify_checksums=False" in message and "\n" not in message
    with pytest.warns(UserWarning, match=r"without verifying its files against safevocab_manifest\.json"):
        assert resume(tiny_model_dir, checkpoint, tmp_path, resume_verify_checksums=False).state.global_step == 3


@pytest.mark.parametrize(
    "name, content, shown",
    [
        ("optimizer.pt", {}, "optimizer.pt lacks 'state', 'param_groups': it is not an optimizer's state_dict()"),
        ("scheduler.pt", [1, 2], "scheduler.pt holds a list, not the dict the Trainer saves"),
    ],
)
def test_a_hand_edited_state_file_is_refused_naming_it(saved_run, tiny_model_dir, tmp_path, name, content, shown):
    checkpoint = copy_of(saved_run, tmp_path)
    torch.save(content, checkpoint / name)
    with pytest.raises(
        ValueError, match=r"^resume_from_checkpoint=.*: " + shown.replace("(", r"\(").replace(")", r"\)")
    ):
        resume(tiny_model_dir, checkpoint, tmp_path, resume_verify_checksums=False)  # the hand edit is on purpose


class Planted:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('PLANTED_SENTINEL', '/nonexistent/planted')}",))


def test_a_malicious_pickle_is_refused_naming_the_file_and_never_run(saved_run, tiny_model_dir, tmp_path, monkeypatch):
    checkpoint = copy_of(saved_run, tmp_path)
    sentinel = tmp_path / "planted-ran"
    monkeypatch.setenv("PLANTED_SENTINEL", str(sentinel))
    torch.save({"state": Planted(), "param_groups": []}, checkpoint / "optimizer.pt")
    with pytest.raises(ValueError) as err:
        resume(tiny_model_dir, checkpoint, tmp_path, resume_verify_checksums=False)
    message = str(err.value)
    assert "optimizer.pt cannot be loaded safely (" in message and "system" in message
    assert "weights_only=False" not in message and "nothing was run" in message
    assert not sentinel.exists()
