"""oomb.training.checkpoint: atomic step directories, latest/pruning, round trips of every state."""

from __future__ import annotations

import random

import pytest
import torch

from oomb.training.checkpoint import (
    ADAPTER_WEIGHTS,
    FULL_WEIGHTS,
    STATE_FILE,
    Checkpoint,
    DamagedCheckpointError,
    atomic_directory,
    capture_rng,
    latest_checkpoint,
    latest_intact_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)


def make_checkpoint(step: int, adapter: bool = False) -> Checkpoint:
    param = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.AdamW([param], lr=0.1)
    param.grad = torch.randn(4, 3)
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5)
    return Checkpoint(
        step=step,
        weights={"w": param.detach().clone(), "b": torch.arange(3, dtype=torch.bfloat16)},
        adapter=adapter,
        master={"b": torch.arange(3, dtype=torch.float32) + 0.25},
        optimizer=optimizer.state_dict(),
        scheduler=scheduler.state_dict(),
        rng=capture_rng(),
        state={"tokens": 10 * step, "losses": [1.5, 0.1 + 0.2], "data_position": {"epoch": 0, "file": 1,
                                                                               "unit": 2, "skip": 3}},
        config_yaml="train:\n  max_steps: 4\n",
    )


def test_round_trip_keeps_every_state(tmp_path):
    checkpoint = make_checkpoint(7)
    path = save_checkpoint(checkpoint, tmp_path)
    assert path.name == "step-000007" and (path / FULL_WEIGHTS).is_file()
    loaded = load_checkpoint(path)
    assert loaded.step == 7 and loaded.adapter is False
    assert loaded.weights.keys() == checkpoint.weights.keys()
    assert all(torch.equal(loaded.weights[k], v) and loaded.weights[k].dtype == v.dtype
               for k, v in checkpoint.weights.items())
    assert torch.equal(loaded.master["b"], checkpoint.master["b"])
    state = loaded.optimizer["state"][0]
    assert torch.equal(state["exp_avg"], checkpoint.optimizer["state"][0]["exp_avg"])
    assert loaded.scheduler == checkpoint.scheduler
    assert loaded.state == checkpoint.state  # floats survive JSON exactly (0.1 + 0.2 included)
    assert loaded.config_yaml == checkpoint.config_yaml


def test_adapter_checkpoints_use_the_adapter_file(tmp_path):
    path = save_checkpoint(make_checkpoint(1, adapter=True), tmp_path)
    assert (path / ADAPTER_WEIGHTS).is_file() and not (path / FULL_WEIGHTS).exists()
    assert load_checkpoint(path).adapter is True


def test_incomplete_directories_are_never_picked(tmp_path):
    save_checkpoint(make_checkpoint(2), tmp_path)
    (tmp_path / "step-000009.tmp").mkdir()  # a save killed half way
    (tmp_path / "step-000005").mkdir()  # no trainer_state.json
    (tmp_path / "notes").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002"]
    assert latest_checkpoint(tmp_path).name == "step-000002"
    with pytest.raises(FileNotFoundError, match="not a complete oomb checkpoint .*no complete checkpoint there"):
        load_checkpoint(tmp_path / "step-000005")
    save_checkpoint(make_checkpoint(3), tmp_path)
    assert not (tmp_path / "step-000009.tmp").exists()  # stale temporaries are cleaned by the next save


def test_a_failed_write_leaves_the_previous_directory(tmp_path):
    final = tmp_path / "final"
    with atomic_directory(final) as tmp:
        (tmp / "a.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(final) as tmp:
        (tmp / "a.txt").write_text("new")
        raise RuntimeError("killed while writing")
    assert (final / "a.txt").read_text() == "old"
    with atomic_directory(final) as tmp:
        (tmp / "b.txt").write_text("newer")
    assert sorted(p.name for p in final.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_state_file_is_written_last(tmp_path, monkeypatch):
    """Killed before trainer_state.json: the step directory does not exist at all."""
    import oomb.training.checkpoint

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(oomb.training.checkpoint, "_prune", fail)  # raises after the rename: checkpoint complete
    with pytest.raises(OSError):
        save_checkpoint(make_checkpoint(4), tmp_path)
    assert (tmp_path / "step-000004" / STATE_FILE).is_file()
    monkeypatch.setattr(torch, "save", fail)  # raises before the rename
    with pytest.raises(OSError):
        save_checkpoint(make_checkpoint(5), tmp_path)
    assert not (tmp_path / "step-000005").exists()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004"]


def test_keep_last_prunes_the_oldest(tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(make_checkpoint(step), tmp_path, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    save_checkpoint(make_checkpoint(4), tmp_path, keep_last=2)  # the same step again replaces it
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]


def test_rng_states_round_trip(tmp_path):
    checkpoint = make_checkpoint(1)
    torch.manual_seed(1)
    random.seed(2)
    checkpoint.rng = capture_rng()
    want = (torch.rand(3), random.random())
    path = save_checkpoint(checkpoint, tmp_path)
    torch.manual_seed(0)
    random.seed(0)
    restore_rng(load_checkpoint(path).rng)
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def truncate(path, fraction: float = 0.5) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * fraction))


DAMAGES = {
    # name: (file, what is done to it, the words the message must contain)
    "truncated weights": (FULL_WEIGHTS, truncate, "model.safetensors is damaged"),
    "truncated masters": ("master.safetensors", truncate, "master.safetensors is damaged"),
    "truncated optimizer": ("optimizer.pt", truncate, "optimizer.pt is damaged"),
    "empty rng": ("rng.pt", lambda p: truncate(p, 0), "rng.pt is damaged"),
    "missing scheduler": ("scheduler.pt", lambda p: p.unlink(), "scheduler.pt is missing"),
    "state not JSON": (STATE_FILE, lambda p: p.write_text('{"step": 2, "adap'), "trainer_state.json is damaged"),
    "state without its keys": (STATE_FILE, lambda p: p.write_text('{"step": 2}'),
                               r"trainer_state.json is damaged .*expected the keys \['step', 'adapter'"),
    "config not YAML": ("config.yaml", lambda p: p.write_text("train: [unclosed"), "config.yaml is damaged"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_checkpoint_is_named_and_the_intact_one_before_it_found(tmp_path, damage):
    name, spoil, message = DAMAGES[damage]
    save_checkpoint(make_checkpoint(1), tmp_path)
    newest = save_checkpoint(make_checkpoint(2), tmp_path)
    spoil(newest / name)
    with pytest.raises(DamagedCheckpointError, match=f"checkpoint {newest}: {message}"):
        load_checkpoint(newest)  # fails on opening, before any tensor is handed out
    intact, damaged = latest_intact_checkpoint(tmp_path)
    assert intact == tmp_path / "step-000001"
    assert len(damaged) == 1 and name in damaged[0] and str(newest) in damaged[0]


def test_no_intact_checkpoint_lists_every_damage(tmp_path):
    for step in (1, 2):
        truncate(save_checkpoint(make_checkpoint(step), tmp_path) / "optimizer.pt")
    intact, damaged = latest_intact_checkpoint(tmp_path)
    assert intact is None
    assert [m.split(":")[0] for m in damaged] == [f"checkpoint {tmp_path / s}" for s in ("step-000002", "step-000001")]


def test_required_state_keys_of_the_caller(tmp_path):
    path = save_checkpoint(make_checkpoint(1), tmp_path)
    assert load_checkpoint(path, ("tokens", "losses")).state["tokens"] == 10
    with pytest.raises(DamagedCheckpointError, match="expected the keys .*'elapsed_s'"):
        load_checkpoint(path, ("tokens", "elapsed_s"))


def test_resume_paths_that_are_not_checkpoints_say_where_one_is(tmp_path):
    """A path that does not exist says so; a run's directory (or its checkpoints/) names its newest checkpoint."""
    with pytest.raises(FileNotFoundError, match="checkpoint '.*missing' does not exist: give a checkpoint directory"):
        load_checkpoint(tmp_path / "missing")
    newest = save_checkpoint(make_checkpoint(4), tmp_path / "run" / "checkpoints")
    save_checkpoint(make_checkpoint(2), tmp_path / "run" / "checkpoints")
    for given in (tmp_path / "run", tmp_path / "run" / "checkpoints"):
        with pytest.raises(FileNotFoundError, match=f"the newest complete checkpoint there is '{newest}'"):
            load_checkpoint(given)
